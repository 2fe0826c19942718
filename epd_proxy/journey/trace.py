"""What one request did: filled in by the pipeline's steps, read by the access log, /metrics and /status."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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
    affinity_hits: int = 0
    encoder_failovers: int = 0
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
