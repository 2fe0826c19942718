"""How much one encoder's queued groups may share a sub-request, and which of them go together.
Pure: the lane (lanes.py) asks it on the caller's clock, coalesce.py reports how shares fared.
What the scheduler reads of a queued group is `Queued`.

- **The share limit**: items a coalesced sub-request may hold. A refused or unsplittable shared
  answer that the split retry pins on no member (each went through alone) is the share's fault:
  the limit halves down to a probe of PROBE_ITEMS, then sharing pauses; each shared answer that
  splits doubles it back. One a member caused is charged to that request only.
- **The batch** (`take_batch`): the oldest waiting group (with `--tenants`, the oldest of the
  least-served tenant's within the first priority class: fairness.py) and other groups of the
  same key (`subrequest.coalesce_key` in journey/) within the limit; with `--tenants`, only
  groups the tenant whose turn it is waits for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from epd_proxy.fleet.speed import Speed

# Items a coalesced sub-request grows to at most (or the batch cap, if lower). Past about four
# images a sub-request's fixed cost is a few percent of it; larger ones only make the first
# request in them wait for the last and risk the encoder's --max-model-len.
COALESCE_TARGET_ITEMS = 8
# The smallest share a back-off falls to: sharing two groups is the probe that tells whether the
# encoder takes shared sub-requests again (as TCP's slow start probes with a small window).
PROBE_ITEMS = 2
# How long sharing pauses after even a probe failed without any member being at fault, doubling
# on each failure in a row up to the maximum; the next probe follows the pause.
PAUSE_FLOOR_S = 1.0
PAUSE_MAX_S = 30.0
# A shared sub-request holds at most what the encoder does in this share of the encode timeout,
# so that behind the one ahead of it in flight it still ends well within each member's own budget.
SHARE_OF_TIMEOUT = 1 / 3


class Queued(Protocol):
    """What the scheduler reads of a group waiting for a sub-request."""

    @property
    def key(self) -> bytes | None: ...
    # Items (what batch caps count) and their cost in image-equivalents (what time follows).
    @property
    def size(self) -> int: ...
    @property
    def cost(self) -> float: ...

    # vLLM's `priority`: lower values first, then arrival order (with --tenants, the least-served
    # tenant's first within a priority: fairness.py).
    priority: int

    @property
    def tenant(self) -> str | None: ...

    # The tenants of other requests that wait for its encodes, and the image-equivalents each
    # still owes (journey/coalesce.py charges them as groups are sent, and lets go once paid).
    @property
    def owed(self) -> Mapping[str, float]: ...

    def move(self) -> None:
        """Its encoder went: it must go elsewhere at once."""


class Sharing:
    """One encoder's share governor, and the shared sub-requests in flight there."""

    __slots__ = ("merge_limit", "paused_until", "pause_s", "backoffs", "charged_requests", "impatient", "shared")

    def __init__(self) -> None:
        self.merge_limit = COALESCE_TARGET_ITEMS
        # Until when (on the caller's clock) nothing shares; 0.0: sharing.
        self.paused_until = 0.0
        self.pause_s = PAUSE_FLOOR_S
        self.backoffs = 0
        self.charged_requests = 0
        # Queued groups sent alone after waiting longer than the backlog explained.
        self.impatient = 0
        # Shared sub-requests in flight: their own request id -> the request ids they carry.
        self.shared: dict[str, list[str]] = {}

    def limit(self, cap: int, now: float, timeout_s: float | None, speed: Speed) -> int:
        """Items the next shared sub-request may hold (0: it carries one group only)."""
        if now < self.paused_until:
            return 0
        limit = min(cap, self.merge_limit) if cap else self.merge_limit
        # Shared groups are images, each at most one image-equivalent (cost.py): counting them
        # at one each errs on the short side.
        known = speed.known()
        if timeout_s is not None and known is not None:
            fixed_s, item_s = known
            limit = min(limit, int((SHARE_OF_TIMEOUT * timeout_s - fixed_s) / item_s))
        return limit

    def gauge(self) -> int:
        """The limit as `epd_encoder_share_limit` shows it: 0 while sharing pauses."""
        return self.merge_limit if self.paused_until == 0.0 else 0

    def sharing(self, now: float) -> bool:
        return now >= self.paused_until

    def failed(self, items: int, now: float) -> None:
        """A shared sub-request of `items` failed although each member went through alone."""
        self.backoffs += 1
        if items > PROBE_ITEMS:
            self.merge_limit = max(PROBE_ITEMS, items // 2)
            return
        self.merge_limit = PROBE_ITEMS
        self.paused_until = now + self.pause_s
        self.pause_s = min(PAUSE_MAX_S, self.pause_s * 2)

    def ok(self, items: int) -> None:
        self.paused_until = 0.0
        self.pause_s = PAUSE_FLOOR_S
        if items * 2 > self.merge_limit:
            self.merge_limit = min(COALESCE_TARGET_ITEMS, self.merge_limit * 2)

    def charged_to_request(self) -> None:
        """A shared sub-request failed through one member's fault: that request is charged."""
        self.charged_requests += 1

    def gave_up(self) -> None:
        """A queued group went alone, having waited longer than the backlog explained."""
        self.impatient += 1

    def opened(self, request_id: str, members: list[str]) -> None:
        self.shared[request_id] = members

    def closed(self, request_id: str) -> None:
        self.shared.pop(request_id, None)


def take_batch(waiting: deque[Any], limit: int, rank: Callable[[str | None], float] | None = None) -> list[Any]:
    """The next sub-request's groups, leaving the rest waiting in order: the first group (or, with
    `rank`, the first of the least-ranked tenant's within the first priority class), and after it
    every other group with the same key that still fits within `limit` items. With `rank` a
    tenant's turn (the least served of the tenants the head stands for) carries only groups that
    tenant waits for: another tenant's images riding in it would make the least-served tenant
    wait for their encoding."""
    head = waiting.popleft() if rank is None else _fairest(waiting, rank)
    batch = [head]
    size = head.size
    if head.key is None or size >= limit or not waiting:
        return batch
    turn = None if rank is None else min(head.tenants, key=rank)
    kept: list[Any] = []
    while waiting:
        work = waiting.popleft()
        if work.key == head.key and size + work.size <= limit and (rank is None or turn in work.tenants):
            batch.append(work)
            size += work.size
            if size >= limit:
                break
        else:
            kept.append(work)
    waiting.extendleft(reversed(kept))
    return batch


def standing(work: Any, rank: Callable[[str | None], float]) -> float:
    """A waiting group's place by fairness: that of the least served among the tenants whose
    requests wait for it (`work.tenants`)."""
    return min(map(rank, work.tenants))


def _fairest(waiting: deque[Any], rank: Callable[[str | None], float]) -> Any:
    """Off the queue: the first waiting group of the least-served tenant (fairness.Ledger.rank)
    among those of the first priority class (the queue is ordered by priority)."""
    first = waiting[0]
    best, best_rank = 0, standing(first, rank)
    for n, work in enumerate(waiting):
        if work.priority != first.priority:
            break
        if n and work.tenants != first.tenants:
            value = standing(work, rank)
            if value < best_rank:
                best, best_rank = n, value
    head = waiting[best]
    del waiting[best]
    return head
