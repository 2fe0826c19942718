"""Routing policies behind one narrow interface: `choose(candidates, keys)`.

One pick per key: for encoders a key is an item's content uuid, for prefill/decode the request id
or, for `prefix_affinity`, the conversation's key (journey/reuse.py).
Policies see only instance load counters, so they stay pure and testable without sockets.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.kv_holds import MediaDepths
from epd_proxy.fleet.prefill_cost import Prompt, Turn, cheapest, claim, seconds, seconds_per_token
from epd_proxy.fleet.recall import Recall
from epd_proxy.fleet.scheduler import ExpectedFinish

# How many conversations' last placements each process remembers, and for how long: past that a
# turn goes to its key's home again (its prefix there is as likely evicted as anywhere).
LAST_TURNS = 16384
LAST_TURN_TTL_S = 600.0
# What decided a conversation's placement (epd_prefix_decisions_total{decision="placement"}): the
# KV index (EXACT: through the rendered prompt's blocks; INDEX: through its images), where its last
# turn ran, its key's home on the ring, or the work queued on those.
EXACT, INDEX, RECORD, HASH, LOAD = "exact", "index", "record", "hash", "load"
# How long after its first token a turn counts as held where it went though the KV index has not
# shown it there: vLLM publishes a prefill's blocks within a second of its first token.
SPECULATIVE_S = 10.0


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


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request goes, the work it brings there (prefill_cost.claim, in tokens), and what
    decided it."""

    instance: Instance
    claim: float
    source: str
    # The record of it, which the pipeline marks prefilled at its first token.
    turn: Turn


class PrefixAffinity(ContentAffinity):
    """Each request to the prefill / PD instance where its first token comes soonest: the work
    queued there plus the part of its prompt the instance does not hold, in seconds at the
    instance's measured prefill speed (fleet/prefill_cost.py).

    vLLM's prefix-cache block hashes fold in the multimodal identifiers, which are the proxy's
    uuids (vllm/v1/core/kv_cache_utils.py): turn k+1 where turn k ran reuses its KV, image tokens
    included. What an instance holds of a request comes from its KV events where they say
    (`holds`: the deepest prefix through the request's images, the same answer in every worker
    and replica, aware of evictions); else from where the conversation's last turn ran here
    (`last_turns`, bounded and ageing, with that turn's size); else the key (the conversation's
    opening, the same on every turn) is taken to be held at its home on the ring, which every
    worker and replica computes alike. Among equal costs the holder wins, then the key's walk
    round the ring. A request with no conversation to continue (key None) goes by load.
    `decided` hears what decided each placement (INDEX, RECORD, HASH, or LOAD when the work
    queued on the holder moved it)."""

    holds: MediaDepths | None = None
    decided: Callable[[str], None] | None = None

    def __init__(
        self,
        remember: int = LAST_TURNS,
        ttl_s: float = LAST_TURN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._by_load = LeastLoaded()
        self.clock = clock
        # Per conversation key: its last turn here.
        self.last_turns: Recall[str, Turn] = Recall(remember, ttl_s, clock)

    def choose(
        self, candidates: Sequence[Instance], keys: Sequence[str | None], prompt: Prompt | None = None
    ) -> list[Instance]:
        if any(key is None for key in keys):
            return self._by_load.choose(candidates, keys)
        return [self.place(candidates, key, prompt or Prompt(0.0)).instance for key in keys if key is not None]

    def place(self, candidates: Sequence[Instance], key: str, prompt: Prompt) -> Placement:
        self._ring(candidates)
        walk = self._walk(key)  # the key is hashed once: its home is the walk's first
        home = next(walk)
        held, preferred, source = self._held(candidates, key, prompt, home=home)
        speeds = seconds_per_token([c.prefill_speed for c in candidates], self.clock())
        claims = [claim(prompt.tokens, cached) for cached in held]
        costs = [
            seconds(speed, c.prefill_queue, work, c.inflight) for speed, c, work in zip(speeds, candidates, claims)
        ]
        chosen = cheapest(costs, preferred, itertools.chain((home,), walk))
        if chosen != preferred:
            source = LOAD
        turn = Turn(candidates[chosen].url, prompt.tokens)
        self.last_turns.put(key, turn)
        if self.decided is not None:
            self.decided(source)
        return Placement(candidates[chosen], claims[chosen], source, turn)

    def _held(
        self, candidates: Sequence[Instance], key: str, prompt: Prompt, home: int
    ) -> tuple[list[float], int, str]:
        """The tokens of the prompt each candidate is taken to hold, the one holding most, and
        what says so (`home`: the key's first candidate round the ring). The last turn placed
        here holds its prompt where it went once its first token came, and for SPECULATIVE_S after that it counts even where the index has not shown
        it yet (its blocks reach the index a moment later, and a next turn sent meanwhile must
        not follow the index back to where the conversation was). A last turn still without its
        first token holds nothing yet: requests sent at once with the same opening are siblings,
        not one conversation's turns, and spread by load."""
        held = [0.0] * len(candidates)
        where = {c.url: i for i, c in enumerate(candidates)}
        record = self.last_turns.get(key)
        last = where.get(record.url) if record is not None else None
        done = record.prefilled_at if record is not None else None
        source = self._indexed(candidates, prompt, held)
        if source is not None:
            top = max(held)
            # Among equal holders (a preamble every engine holds), where the conversation last
            # ran, then the key's home: so new conversations still spread round the ring.
            deepest = next((i for i in (last, home) if i is not None and held[i] == top), held.index(top))
            if record is not None and last is not None and done is not None:
                if self.clock() - done <= SPECULATIVE_S:
                    held[last] = max(held[last], min(prompt.tokens, record.tokens))
                    if last != deepest and held[last] >= held[deepest]:
                        return held, last, RECORD
            return held, deepest, source
        if record is not None and last is not None:
            if done is not None:
                held[last] = min(prompt.tokens, record.tokens)
            return held, last, RECORD
        held[home] = prompt.tokens
        return held, home, HASH

    def _indexed(self, candidates: Sequence[Instance], prompt: Prompt, held: list[float]) -> str | None:
        """Fill in `held` from the KV index and say how (EXACT: the rendered prompt's blocks;
        INDEX: the deepest prefix through its images), or None when it shows no candidate holding
        any of the prompt."""
        if self.holds is None:
            return None
        if prompt.rendered is not None:
            for i, c in enumerate(candidates):
                held[i] = min(prompt.tokens, float(self.holds.prefix_tokens(c.url, prompt.rendered) or 0))
            if any(held):
                return EXACT
        if prompt.media:
            # Only instances holding some of the images can hold a prefix through them.
            holding = self.holds.holding(prompt.media)
            for i, c in enumerate(candidates):
                if c.url in holding:
                    depth = max((d or 0 for d in self.holds(c.url, prompt.media, None)), default=0)
                    held[i] = min(prompt.tokens, float(depth * self.holds.block_size(c.url)))
            if any(held):
                return INDEX
        return None


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
