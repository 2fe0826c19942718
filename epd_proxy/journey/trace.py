"""What one request did: filled in by the pipeline's steps, and once it is over, the access log line
and the stage histograms made of it (`account`); /status reads it too."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd_proxy.ops.metrics import Metrics

# The name operators' log filters know for the one line per request.
access_log = logging.getLogger("epd_proxy.request")


@dataclass(slots=True)
class Trace:
    request_id: str
    # The API the request came in by (doors.py), for the request log and /metrics.
    endpoint: str = "chat"
    items: int = 0
    attempts: int = 0
    # Encoder sub-requests that carried this request's items (shared ones included), and the
    # sum of this request's share of each (1 for its own, 1/n of one shared by n requests).
    encoder_requests: int = 0
    subrequest_share: float = 0.0
    # Sub-requests it shared with other requests, and items sent where they were cached.
    coalesced: int = 0
    # The request ids of the shared sub-requests that carried its items.
    shared: list[str] = field(default_factory=list)
    affinity_hits: int = 0
    encoder_failovers: int = 0
    # Items sent raw to the consumer instead of to an encoder: it holds them from earlier turns
    # (reused), or no encoder could take them in time (consumer_encoded).
    reused: int = 0
    consumer_encoded: int = 0
    encode_s: float = 0.0
    prefill_s: float = 0.0
    decode_ttfb_s: float = 0.0
    # How the answer ended once decode committed: complete, aborted (an error event after 200),
    # client_disconnect.
    outcome: str = "-"
    started: float = field(default_factory=time.perf_counter)
    # Instances already charged a 5xx answer for this request: its retries and failovers resend the
    # same input, and an input that makes vLLM answer 500 must count once, not once per attempt.
    charged_5xx: set[str] = field(default_factory=set)


def account(metrics: Metrics, trace: Trace, status: int | str, route: Any) -> None:
    """One log line and the stage histograms per request."""
    total_s = time.perf_counter() - trace.started
    metrics.requests.labels(str(status)).inc()
    metrics.endpoint_requests.labels(trace.endpoint, str(status)).inc()
    metrics.recent.record(trace.started + total_s, status, total_s, trace)
    stage = metrics.stage
    stage["total"].observe(total_s)
    if trace.encoder_requests:
        stage["encode"].observe(trace.encode_s)
    if trace.prefill_s:
        stage["prefill"].observe(trace.prefill_s)
    if trace.decode_ttfb_s:
        stage["decode_ttfb"].observe(trace.decode_ttfb_s)
    if not access_log.isEnabledFor(logging.INFO):
        return
    fields = {
        "request_id": trace.request_id,
        "status": status,
        "items": trace.items,
        "encoder_requests": trace.encoder_requests,
        "coalesced": trace.coalesced,
        "shared": ",".join(trace.shared) or None,
        "affinity_hits": trace.affinity_hits,
        "encoder_failovers": trace.encoder_failovers,
        "reused": trace.reused,
        "consumer_encoded": trace.consumer_encoded,
        "attempts": trace.attempts,
        "outcome": trace.outcome,
        "decode": route.decoder.url if route else None,
        "prefill": route.prefill.url if route and route.prefill else None,
        "encode_ms": round(trace.encode_s * 1000, 2),
        "prefill_ms": round(trace.prefill_s * 1000, 2),
        "decode_ttfb_ms": round(trace.decode_ttfb_s * 1000, 2),
        "total_ms": round(total_s * 1000, 2),
        "endpoint": trace.endpoint,
    }
    access_log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()), extra={"fields": fields})
