"""A bounded, ageing record of what this process saw the fleet do (where a conversation's last
turn ran, which media the fleet holds): what the proxy's guesses lean on when nothing better
(an engine's own events) tells it, kept small enough that a flood of new keys only pushes old
ones out."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recall(Generic[K, V]):
    """At most `capacity` entries, the least recently written pushed out first; an entry written
    more than `ttl_s` ago is forgotten. Reading does not refresh an entry: only seeing it happen
    again does, so a belief never outlives what last confirmed it by more than `ttl_s`."""

    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def put(self, key: K, value: V, age_s: float = 0.0) -> None:
        """Written now, or `age_s` ago (what another process saw then: it ages from then, and an
        entry written since is kept)."""
        written = self.clock() - age_s
        if age_s:
            entry = self._entries.get(key)
            if age_s > self.ttl_s or (entry is not None and entry[0] >= written):
                return
        self._entries[key] = (written, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def ages(self) -> list[tuple[K, float]]:
        """Each live entry and how long ago it was written, in the order they were put here (an
        entry put with an age stands where it was put, which is also where `capacity` pushes it
        out from)."""
        now = self.clock()
        return [(key, now - written) for key, (written, _) in self._entries.items() if now - written <= self.ttl_s]

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        written, value = entry
        if self.clock() - written > self.ttl_s:
            del self._entries[key]
            return None
        return value

    def __contains__(self, key: K) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._entries)
