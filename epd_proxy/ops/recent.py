"""The last minute of requests, for the status page: rate, status mix, stage p50/p99, batching.

Prometheus histograms answer these questions only through a Prometheus server; an operator
looking at one proxy wants them from the proxy itself. The hot path appends one flat tuple to a
bounded deque; everything else happens when someone asks for a summary.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

STAGES = ("encode", "prefill", "decode_ttfb", "total")
# Tuple layout of one finished request (flat tuples of numbers are cheap to keep and to drop).
(
    _END,
    _STATUS,
    _TOTAL,
    _ENCODE,
    _PREFILL,
    _TTFB,
    _SUBREQUESTS,
    _ITEMS,
    _ATTEMPTS,
    _FAILOVERS,
    _SHARE,
    _COALESCED,
    _HITS,
    _REQUEST_ID,
    _ENDPOINT,
    _WAITS,
) = range(16)
# The slowest requests of the window the summary names, with the stage each waited in.
SLOWEST = 5
_STAGE_FIELD = {"encode": _ENCODE, "prefill": _PREFILL, "decode_ttfb": _TTFB, "total": _TOTAL}


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, `q` from 0 to 1: always a value that was observed. The status page
    and the benchmark's report both use this one."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class Finished(Protocol):
    """What the window keeps of a finished request (journey/trace.py's Trace)."""

    @property
    def request_id(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def items(self) -> int: ...
    @property
    def attempts(self) -> int: ...
    @property
    def encoder_requests(self) -> int: ...
    @property
    def encoder_failovers(self) -> int: ...
    @property
    def subrequest_share(self) -> float: ...
    @property
    def coalesced(self) -> int: ...
    @property
    def affinity_hits(self) -> int: ...
    @property
    def encode_s(self) -> float: ...
    @property
    def prefill_s(self) -> float: ...
    @property
    def decode_ttfb_s(self) -> float: ...
    def waits(self) -> dict[str, float]: ...


class RecentRequests:
    """A ring of the most recent finished requests, summarised over a sliding window."""

    def __init__(
        self, window_s: float = 60.0, capacity: int = 8192, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self.started = clock()
        self._ring: deque[tuple] = deque(maxlen=capacity)

    def record(self, end: float, status: int | str, total_s: float, trace: Finished) -> None:
        """One finished request; `end` is on this object's clock (perf_counter by default).
        `status` is what epd_requests_total counts: the HTTP status, or "aborted"."""
        self._ring.append(
            (
                end,
                status,
                total_s,
                trace.encode_s if trace.encoder_requests else None,
                trace.prefill_s or None,
                trace.decode_ttfb_s or None,
                trace.encoder_requests,
                trace.items,
                trace.attempts,
                trace.encoder_failovers,
                trace.subrequest_share,
                trace.coalesced,
                trace.affinity_hits,
                trace.request_id,
                trace.endpoint,
                trace.waits(),
            )
        )

    def timeline(self, bucket_s: float = 10.0, buckets: int = 30) -> list[dict[str, Any]]:
        return timeline(self._ring, self._clock(), bucket_s, buckets, self.started)

    def uptime_s(self) -> float:
        return self._clock() - self.started

    def summary(self) -> dict[str, Any]:
        now = self._clock()
        start = now - self.window_s
        ring = self._ring
        recent = [r for r in ring if r[_END] >= start]
        # The window actually covered: shorter right after start-up, or when the ring overflowed.
        covered = min(self.window_s, now - self.started)
        if len(ring) == ring.maxlen and ring and ring[0][_END] >= start:
            covered = now - ring[0][_END]
        statuses: dict[str, int] = {}
        for r in recent:
            key = str(r[_STATUS])
            statuses[key] = statuses.get(key, 0) + 1
        latency = {}
        for stage in STAGES:
            field = _STAGE_FIELD[stage]
            values = sorted(r[field] for r in recent if r[field] is not None)
            latency[stage] = {
                "count": len(values),
                "p50_ms": _ms(percentile(values, 0.50)),
                "p99_ms": _ms(percentile(values, 0.99)),
            }
        with_media = [r for r in recent if r[_SUBREQUESTS]]
        # A sub-request shared by n requests counts 1/n for each: these are sub-requests sent.
        subrequests = sum(r[_SHARE] for r in with_media)
        taken_part = sum(r[_SUBREQUESTS] for r in with_media)
        # Every attempt re-encodes all of the request's items.
        images_sent = sum(r[_ITEMS] * max(1, r[_ATTEMPTS]) for r in with_media)
        return {
            "window_s": round(covered, 1),
            "requests": len(recent),
            "rate_per_s": round(len(recent) / covered, 2) if covered > 0 else 0.0,
            "status": dict(sorted(statuses.items())),
            "latency": latency,
            "requests_with_media": len(with_media),
            "subrequests_per_request": round(subrequests / len(with_media), 2) if with_media else None,
            # Of the sub-requests carrying a request's items, the share that carried others' too.
            "coalesced_share": round(sum(r[_COALESCED] for r in with_media) / taken_part, 3) if taken_part else None,
            "affinity_hits": sum(r[_HITS] for r in with_media),
            "images_per_subrequest": round(images_sent / subrequests, 2) if subrequests else None,
            "retries": sum(max(0, r[_ATTEMPTS] - 1) for r in recent),
            "failovers": sum(r[_FAILOVERS] for r in recent),
            "slowest": [_slow(r) for r in heapq.nlargest(SLOWEST, recent, key=lambda r: r[_TOTAL])],
        }


def _slow(r: tuple) -> dict[str, Any]:
    """One slow request: its id, and the stage it spent longest in (trace.Trace.waits)."""
    waits = r[_WAITS]
    stage, seconds = max(waits.items(), key=lambda pair: pair[1])
    return {
        "request_id": r[_REQUEST_ID],
        "endpoint": r[_ENDPOINT],
        "status": r[_STATUS],
        "total_ms": _ms(r[_TOTAL]),
        "waited_in": stage if seconds > 0 else None,
        "stages_ms": {name: _ms(value) for name, value in waits.items()},
    }


def timeline(ring: Sequence[tuple], now: float, bucket_s: float, buckets: int, since: float) -> list[dict[str, Any]]:
    """The ring as `buckets` intervals of `bucket_s` up to `now`, oldest first: request rate and
    total latency p50/p99 in each (what the status page charts); none from before `since`, when
    the process started (a rate of 0 there would be made up)."""
    start = now - bucket_s * buckets
    totals: list[list[float]] = [[] for _ in range(buckets)]
    for r in ring:
        if r[_END] >= start:
            totals[min(buckets - 1, int((r[_END] - start) / bucket_s))].append(r[_TOTAL])
    out = []
    for n, values in enumerate(totals):
        if start + bucket_s * (n + 1) < since:
            continue
        values.sort()
        out.append(
            {
                "ago_s": round(bucket_s * (buckets - n - 1), 1),
                "rate_per_s": round(len(values) / bucket_s, 2),
                "p50_ms": _ms(percentile(values, 0.50)),
                "p99_ms": _ms(percentile(values, 0.99)),
            }
        )
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
