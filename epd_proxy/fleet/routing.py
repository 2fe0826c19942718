"""Routing policies behind one narrow interface: `choose(candidates, keys)`.

One pick per key: for encoders a key is an item's content uuid, for prefill/decode the request id
or, for `prefix_affinity`, the conversation's key (journey/reuse.py).
Policies see only instance load counters, so they stay pure and testable without sockets.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypedDict

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.kv_holds import MediaDepths
from epd_proxy.fleet.recall import Recall
from epd_proxy.fleet.scheduler import ExpectedFinish

# How many conversations' last placements each process remembers, and for how long: past that a
# turn goes to its key's home again (its prefix there is as likely evicted as anywhere).
LAST_TURNS = 16384
LAST_TURN_TTL_S = 600.0
# What decided a conversation's placement (epd_prefix_decisions_total{decision="placement"}): the
# KV index, where its last turn ran, or its key's walk round the ring.
INDEX, RECORD, HASH = "index", "record", "hash"


class RoutingPolicy(Protocol):
    """An encoder policy: one key per item, its content uuid."""

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]: ...


class ServingPolicy(Protocol):
    """A prefill or decode policy: one key per request, None when there is nothing to be affine to."""

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str | None]) -> list[Instance]: ...


class Policies(TypedDict):
    """The policy of each role the proxy routes, keyed by the role names (fleet/backends.py)."""

    encode: RoutingPolicy
    prefill: ServingPolicy
    decode: ServingPolicy


class RoundRobin:
    """Item k of a call goes to candidate (cursor + k) mod n; the cursor is shared by all calls,
    so consecutive single-item requests rotate over every instance instead of piling on the first."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str | None]) -> list[Instance]:
        n = len(candidates)
        start = self._cursor % n
        self._cursor = (start + len(keys)) % n
        return [candidates[(start + k) % n] for k in range(len(keys))]


class RandomChoice:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str | None]) -> list[Instance]:
        return [self._rng.choice(candidates) for _ in keys]


class LeastLoaded:
    """Fewest in-flight requests wins, counting picks made earlier in the same call; ties rotate
    so an idle fleet still spreads load."""

    def __init__(self) -> None:
        self._tie_cursor = 0

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str | None]) -> list[Instance]:
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

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str | None]) -> list[Instance]:
        if len(candidates) == 1:
            return [candidates[0]] * len(keys)
        picks = []
        for _ in keys:
            a, b = self._rng.sample(candidates, 2)
            picks.append(a if a.inflight <= b.inflight else b)
        return picks


class ContentAffinity:
    """Consistent hashing of the item's content uuid with bounded load.

    The same image lands on the encoder that already has it in its caches across requests, but
    no encoder takes more than `load_factor` times the mean load: past the bound the key walks on
    around the ring to the next instance (Mirrokni et al., consistent hashing with bounded loads).
    """

    def __init__(self, load_factor: float = 1.25, vnodes: int = 64) -> None:
        self.load_factor = load_factor
        self.vnodes = vnodes
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[int] = []

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    def _ring(self, candidates: Sequence[Instance]) -> None:
        urls = tuple(c.url for c in candidates)
        if urls == self._ring_for:
            return
        points = sorted((self._hash(f"{url}#{v}"), i) for i, url in enumerate(urls) for v in range(self.vnodes))
        self._points = [p for p, _ in points]
        self._owners = [i for _, i in points]
        self._ring_for = urls

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]:
        return self._place(candidates, keys, [None] * len(keys))

    def _place(
        self, candidates: Sequence[Instance], keys: Sequence[str], preferred: Sequence[int | None]
    ) -> list[Instance]:
        """One pick per key, counting the picks made earlier in the call; `preferred`: per key,
        the candidate to take while it is under the bound, before the key's walk round the ring."""
        self._ring(candidates)
        n = len(candidates)
        planned = [0] * n
        total = sum(c.inflight for c in candidates)
        picks = []
        for key, prefer in zip(keys, preferred):
            bound = self._bound(total, n)
            loads = [c.inflight + p for c, p in zip(candidates, planned)]
            chosen = bounded_pick(loads, self._walk(key), bound, prefer)
            planned[chosen] += 1
            total += 1
            picks.append(candidates[chosen])
        return picks

    def _bound(self, total: int, n: int) -> int:
        return math.ceil(self.load_factor * (total + 1) / n)

    def _walk(self, key: str) -> Iterator[int]:
        """The candidates in the order the key meets them going round the ring from its point."""
        start = bisect.bisect(self._points, self._hash(key)) % len(self._points)
        for step in range(len(self._points)):
            yield self._owners[(start + step) % len(self._points)]


def bounded_pick(loads: Sequence[int], walk: Iterable[int], bound: int, preferred: int | None = None) -> int:
    """The candidate a key goes to (pure): `preferred` while its load is under `bound`, else the
    first on the key's `walk` under it; every one at the bound: the walk's first, its home."""
    if preferred is not None and loads[preferred] < bound:
        return preferred
    home = None
    for owner in walk:
        if home is None:
            home = owner
        if loads[owner] < bound:
            return owner
    assert home is not None  # a ring of at least one candidate
    return home


def index_pick(depths: Sequence[int], loads: Sequence[int], bound: int) -> int | None:
    """The candidate holding the deepest prefix through the request's media (pure): `depths` per
    candidate (0: holds none, or its KV index is not fresh), among those under the load `bound`;
    the less loaded of equals, then the first. None: none holds any under the bound."""
    best = None
    for i, (depth, load) in enumerate(zip(depths, loads)):
        if depth > 0 and load < bound and (best is None or (depth, -load) > (depths[best], -loads[best])):
            best = i
    return best


class PrefixAffinity(ContentAffinity):
    """Every turn of a conversation to the prefill / PD instance that ran its last turn.

    vLLM's prefix-cache block hashes fold in the multimodal identifiers, which are the proxy's
    uuids (vllm/v1/core/kv_cache_utils.py): turn k+1 where turn k ran reuses its KV, image tokens
    included. The key (the conversation's opening, the same on every turn) is hashed with bounded
    load like an encoder's content uuid, so a hot conversation spills to the next instance on the
    ring instead of piling onto its home. Where each key's last turn went is remembered
    (`last_turns`, bounded and ageing): the next turn goes there while it is under the bound and
    in rotation, so a turn that spilled moves its conversation once, not back to the home and
    away again. Every worker and replica computes the same home from the same key and members;
    each remembers only the spills it made itself (docs/prefix-routing.md).
    A request with no conversation to continue (key None) goes by load.

    With KV events followed (`holds`, the index's answer per instance and media uuid), a
    candidate under the bound holding a deeper prefix through the request's images comes first
    (`index_pick`): the engines' own state, the same in every worker and replica, and aware of
    evictions. `decided` hears what decided each placement (INDEX, RECORD or HASH)."""

    holds: MediaDepths | None = None
    decided: Callable[[str], None] | None = None

    def __init__(
        self,
        load_factor: float = 1.25,
        remember: int = LAST_TURNS,
        ttl_s: float = LAST_TURN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(load_factor=load_factor)
        self._by_load = LeastLoaded()
        self.last_turns: Recall[str, str] = Recall(remember, ttl_s, clock)

    def choose(
        self, candidates: Sequence[Instance], keys: Sequence[str | None], media: Sequence[str] = ()
    ) -> list[Instance]:
        """`media`: the request's image uuids as its consumer's KV events name them (one key)."""
        known = [key for key in keys if key is not None]
        if len(known) < len(keys):
            return self._by_load.choose(candidates, keys)
        where = {c.url: i for i, c in enumerate(candidates)}
        preferred = [where.get(self.last_turns.get(key) or "") for key in known]
        sources = [RECORD] * len(known)
        if media and self.holds is not None and len(known) == 1:
            depths = [max((d or 0 for d in self.holds(c.url, media, None)), default=0) for c in candidates]
            loads = [c.inflight for c in candidates]
            holder = index_pick(depths, loads, self._bound(sum(loads), len(candidates)))
            if holder is not None:
                preferred[0], sources[0] = holder, INDEX
        picks = self._place(candidates, known, preferred)
        for key, pick, prefer, source in zip(known, picks, preferred, sources):
            self.last_turns.put(key, pick.url)
            if self.decided is not None:
                self.decided(source if prefer is not None and candidates[prefer] is pick else HASH)
        return picks


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "expected_finish": ExpectedFinish,
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "content_affinity": ContentAffinity,
    "prefix_affinity": PrefixAffinity,
}


# The ones that take a request without a key (config.py's SERVING_POLICIES).
SERVING: dict[str, Callable[[], ServingPolicy]] = {
    "prefix_affinity": PrefixAffinity,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "round_robin": RoundRobin,
    "random": RandomChoice,
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None


def make_serving_policy(name: str) -> ServingPolicy:
    try:
        return SERVING[name]()
    except KeyError:
        raise ValueError(f"unknown prefill/decode routing policy {name!r}; choose one of {sorted(SERVING)}") from None
