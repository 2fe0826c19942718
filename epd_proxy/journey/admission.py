"""What is let in: the wait a request is predicted as it arrives, the answer to one that cannot
start in time, and `--max-inflight` with its fast 503 (see [Failure behaviour](failures.md)).

A request is counted in flight from when its body is read and validated until its answer ends, so
a client still uploading holds no slot: admission bounds work, not waiting.

The prediction is a lower bound, so a request that could make its deadline is never turned away:
its media cannot be encoded before the least busy encoder has worked off its backlog and then the
request's largest item, and it cannot start on a consumer before a slot there frees.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from epd_proxy.errors import BadRequest, ProxyError
from epd_proxy.tenants import MAX_DEADLINE_MS

# Why a request was turned away (`epd_requests_shed_total{reason}`).
DEADLINE, INFLIGHT, SHARE = "deadline", "inflight", "share"
REASONS = (DEADLINE, INFLIGHT, SHARE)
# A tenant's use of the fleet against its weight (fleet/fairness.py; always WITHIN without --tenants).
WITHIN, OVER = "within", "over"
DEADLINE_HEADER = "x-request-deadline-ms"


class _Counter(Protocol):
    def inc(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Encoder:
    """An encoder in rotation as the lanes see it: seconds of work queued there, seconds per
    sub-request and per image-equivalent."""

    backlog_s: float
    fixed_s: float
    item_s: float
    # The part of backlog_s queued in the proxy that fair queueing sends after this request
    # (fleet/fairness.py, Ledger.behind).
    behind_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Backlog:
    """The fleet's queues as a request arrives."""

    encoders: Sequence[Encoder] = ()
    # Requests in flight on each consumer (PD or decode) in rotation.
    consumers: Sequence[int] = ()
    # Requests one consumer serves at once (--autoscale-concurrency).
    consumer_slots: int = 1
    # Mean seconds a request holds a consumer slot; 0 until one has finished.
    service_s: float = 0.0
    # Past this backlog media go raw to the consumer (--consumer-encode-after); None: they never do.
    raw_after_s: float | None = None
    # While tenants compete, the wait for a place in the least-waited consumer's window (fleet/windows.py).
    window_s: float = 0.0


class Wait(NamedTuple):
    """A request's predicted wait to start on a consumer, its own encoding included."""

    seconds: float
    # Whether other requests' work is part of it: the fleet has a queue, it is not only slow.
    queued: bool


def predicted_wait(backlog: Backlog, largest_item: float) -> Wait:
    """How long a request whose largest media item costs `largest_item` image-equivalents (0: no
    media) waits before it can start on a consumer, at the least."""
    encode, queued = 0.0, False
    if largest_item > 0 and backlog.encoders:

        def before(e: Encoder) -> float:
            return e.backlog_s - e.behind_s if e.behind_s < e.backlog_s else 0.0

        best = min(backlog.encoders, key=lambda e: before(e) + e.fixed_s + e.item_s * largest_item)
        encode = before(best) + best.fixed_s + best.item_s * largest_item
        queued = before(best) > 0
        if backlog.raw_after_s is not None and encode > backlog.raw_after_s:
            encode = backlog.raw_after_s
    if backlog.consumers and backlog.service_s > 0:
        ahead = min(backlog.consumers) - backlog.consumer_slots + 1
        if ahead > 0:
            queue = ahead * backlog.service_s / backlog.consumer_slots
            encode, queued = max(encode, queue), True
    if backlog.window_s > encode:
        encode, queued = backlog.window_s, True
    return Wait(encode, queued)


@dataclass(frozen=True, slots=True)
class Shed:
    """A request turned away at arrival: its status, why, and when to come back."""

    status: int
    reason: str
    retry_after_s: int


def retry_after(seconds: float) -> int:
    """Retry-After in whole seconds, at least one."""
    return max(1, math.ceil(seconds - 1e-9))


def shed_decision(wait: Wait, deadline_s: float | None, share: str) -> Shed | None:
    """Whether a request predicted to `wait` is turned away: only while the fleet has a queue (an
    idle fleet serves anyone) and it cannot start within its deadline. Then 429 when its tenant is
    over its `share` (the fleet is busy with its work: Retry-After is when the backlog it saw is
    worked off), else 503 (the fleet cannot serve it in time: Retry-After is when it could)."""
    if not wait.queued or deadline_s is None or wait.seconds <= deadline_s:
        return None
    if share == OVER:
        return Shed(429, SHARE, retry_after(wait.seconds))
    return Shed(503, DEADLINE, retry_after(wait.seconds - deadline_s))


class TurnedAway(ProxyError):
    """The answer to a request turned away at arrival; `reason` is its metrics label."""

    def __init__(self, shed: Shed, message: str) -> None:
        error_type = "rate_limit_error" if shed.status == 429 else "overloaded"
        super().__init__(shed.status, message, stage="admission", error_type=error_type)
        self.reason = shed.reason
        self.retry_after_s = shed.retry_after_s


def turned_away(shed: Shed, wait_s: float, deadline_s: float | None) -> TurnedAway:
    if shed.reason == SHARE:
        return TurnedAway(shed, "the tenant is over its share of the fleet while others wait; retry later")
    return TurnedAway(
        shed,
        f"the fleet is over capacity: this request would wait at least {wait_s:.1f} s to start, beyond its "
        f"deadline of {deadline_s or 0:.1f} s",
    )


def request_deadline(header: str | None, tenant_s: float | None) -> float | None:
    """Seconds a request may wait to start: the client's `x-request-deadline-ms`, which may
    shorten its tenant's deadline but not lengthen it, at most MAX_DEADLINE_MS; None: no deadline."""
    if header is None:
        return tenant_s
    text = header.strip()
    if not (text.isascii() and text.isdigit()) or not text.strip("0"):
        raise BadRequest(f"{DEADLINE_HEADER} must be a positive integer (milliseconds), got {header[:40]!r}")
    # Any number longer than the cap's is past it (and int() refuses over 4300 digits).
    digits = text.lstrip("0")
    seconds = (MAX_DEADLINE_MS if len(digits) > len(str(MAX_DEADLINE_MS)) else min(int(digits), MAX_DEADLINE_MS)) / 1000
    return seconds if tenant_s is None or seconds < tenant_s else tenant_s


class Admission:
    def __init__(self, limit: int, rejected: _Counter) -> None:
        self.limit = limit
        self.inflight = 0
        self._rejected = rejected

    @contextlib.contextmanager
    def admit(self, wait: Callable[[], float] | None = None) -> Iterator[None]:
        """Hold a slot for the block; an overloaded 503 (stage `admission`) when none is free, whose
        Retry-After is the `wait` a request is predicted now."""
        if self.limit and self.inflight >= self.limit:
            self._rejected.inc()
            raise TurnedAway(
                Shed(503, INFLIGHT, retry_after(wait() if wait is not None else 0.0)),
                f"the proxy is at its limit of {self.limit} requests in flight; retry shortly",
            )
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
