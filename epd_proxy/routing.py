"""Routing policies behind one narrow interface: `choose(candidates, keys)`.

One pick per key: for encoders a key is an item's content uuid, for prefill/decode the request id.
Policies see only instance load counters, so they stay pure and testable without sockets.
"""

from __future__ import annotations

import random
from typing import Callable, Protocol, Sequence

from epd_proxy.backends import Instance


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]: ...


class RoundRobin:
    """Item k of a call goes to candidate (cursor + k) mod n; the cursor is shared by all calls,
    so consecutive single-item requests rotate over every instance instead of piling on the first."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]:
        n = len(candidates)
        start = self._cursor % n
        self._cursor = (start + len(keys)) % n
        return [candidates[(start + k) % n] for k in range(len(keys))]


class RandomChoice:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]:
        return [self._rng.choice(candidates) for _ in keys]


class LeastLoaded:
    """Fewest in-flight requests wins, counting picks made earlier in the same call; ties rotate
    so an idle fleet still spreads load."""

    def __init__(self) -> None:
        self._tie_cursor = 0

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]:
        planned = [0] * len(candidates)
        picks = []
        n = len(candidates)
        for _ in keys:
            start = self._tie_cursor % n
            self._tie_cursor += 1
            best = min(range(n), key=lambda i: (candidates[i].inflight + planned[i], (i - start) % n))
            planned[best] += 1
            picks.append(candidates[best])
        return picks


class PowerOfTwo:
    """Two random candidates, the less loaded one wins: near least-loaded quality without a scan."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]:
        if len(candidates) == 1:
            return [candidates[0]] * len(keys)
        picks = []
        for _ in keys:
            a, b = self._rng.sample(candidates, 2)
            picks.append(a if a.inflight <= b.inflight else b)
        return picks


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
}
ENCODE_POLICIES = ("round_robin", "least_loaded", "random", "power_of_two")
SERVING_POLICIES = ("least_loaded", "power_of_two", "round_robin", "random")


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
