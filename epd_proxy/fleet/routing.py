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
from collections.abc import Callable, Sequence
from typing import Protocol, TypedDict

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.scheduler import ExpectedFinish


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
        self._ring(candidates)
        n = len(candidates)
        planned = [0] * n
        total = sum(c.inflight for c in candidates)
        picks = []
        for key in keys:
            bound = math.ceil(self.load_factor * (total + 1) / n)
            start = bisect.bisect(self._points, self._hash(key)) % len(self._points)
            chosen = None
            for step in range(len(self._points)):
                owner = self._owners[(start + step) % len(self._points)]
                if candidates[owner].inflight + planned[owner] < bound:
                    chosen = owner
                    break
            if chosen is None:  # every instance is at the bound: fall back to the key's home
                chosen = self._owners[start]
            planned[chosen] += 1
            total += 1
            picks.append(candidates[chosen])
        return picks


class PrefixAffinity(ContentAffinity):
    """Every turn of a conversation to the prefill / PD instance that served its earlier turns.

    vLLM's prefix-cache block hashes fold in the multimodal identifiers, which are the proxy's
    uuids (vllm/v1/core/kv_cache_utils.py): turn k+1 where turn k ran reuses its KV, image tokens
    included. The key (the conversation's opening, the same on every turn) is hashed with bounded
    load like an encoder's content uuid, so a hot conversation spills to the next instance on the
    ring instead of piling onto its home. Stateless: every worker and replica computes the same
    home from the same key and members (why not a shared index or KV events: docs/prefix-routing.md).
    A request with no conversation to continue (key None) goes by load."""

    def __init__(self, load_factor: float = 1.25) -> None:
        super().__init__(load_factor=load_factor)
        self._by_load = LeastLoaded()

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str | None]) -> list[Instance]:
        known = [key for key in keys if key is not None]
        if len(known) < len(keys):
            return self._by_load.choose(candidates, keys)
        return super().choose(candidates, known)


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
