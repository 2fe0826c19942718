"""What one request did: filled in by the pipeline's steps, and once it is over, the access log line,
the stage histograms and the root span made of it (`account`); /status reads it too. With
--otlp-traces-endpoint each stage is a span (ops/tracing.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from epd_proxy.ops import tracing

if TYPE_CHECKING:
    from epd_proxy.fleet.backends import Instance
    from epd_proxy.ops.metrics import Metrics

# The name operators' log filters know for the one line per request.
access_log = logging.getLogger("epd_proxy.request")
# The stages whose time the log reports, and the field each adds to, whether it succeeded or not.
TIMED = {"encode": "encode_s", "prefill": "prefill_s", "decode": "decode_ttfb_s", "relay": "relay_s"}


@dataclass(slots=True)
class Trace:
    request_id: str
    # The client's x-request-id when the proxy refused it (http/request_id.py), escaped for the log.
    client_request_id: str | None = None
    # The API the request came in by (doors.py), for the request log and /metrics.
    endpoint: str = "chat"
    # Its tenant (--tenants; None without), and whether its media may share a sub-request.
    tenant: str | None = None
    isolated: bool = False
    # Tenants of other requests waiting for this one's encodes of their images (inflight.py), each
    # with the image-equivalents it waits for and has not been charged yet: its queued groups stand
    # where the least served of them all stands, and whoever a group was lifted for pays its part.
    riders: dict[str, float] = field(default_factory=dict)
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
    # Items the latest attempt sent raw to the consumer instead of to an encoder: it holds them
    # from earlier turns (reused), or no encoder could take them in time (consumer_encoded).
    reused: int = 0
    consumer_encoded: int = 0
    # An encoder that received this request's media and failed them (answered 5xx, dropped or
    # stalled): from then on none of its media go raw to a consumer (reuse.consumer_may_encode).
    media_failed_on: str | None = None
    encode_s: float = 0.0
    # The longest any of its groups waited in the proxy's queue for a busy encoder, until its
    # sub-request was sent (inside encode_s; coalesce.py sets it).
    share_wait_s: float = 0.0
    # Reading the client's body (a slow upload).
    read_s: float = 0.0
    prefill_s: float = 0.0
    decode_ttfb_s: float = 0.0
    # From decode's first token (or whole answer) to the last byte relayed to the client.
    relay_s: float = 0.0
    # The prefill and decode instances the request reached (a stage never begun names none).
    prefill_url: str | None = None
    decode_url: str | None = None
    # How the answer ended once decode committed: complete, aborted (an error event after 200),
    # client_disconnect.
    outcome: str = "-"
    started: float = field(default_factory=time.perf_counter)
    # Instances already charged a 5xx answer for this request: its retries and failovers resend the
    # same input, and an input that makes vLLM answer 500 must count once, not once per attempt.
    charged_5xx: set[str] = field(default_factory=set)
    # The request's spans while tracing is on (None otherwise), and the error it was answered.
    spans: tracing.RequestSpans | None = None
    error: BaseException | None = None

    def stage(self, name: str, instance: Instance | None = None, parent: Any = None, /, **attributes: Any) -> Stage:
        """A step of the request: timed into its field (TIMED) however it ends, its instance
        named once begun, and a span while tracing is on. Positional up to `attributes`, whose
        names (OpenTelemetry's, dotted) are never these."""
        url = instance.url if instance is not None else None
        if name == "prefill":
            self.prefill_url = url
        elif name == "decode":
            self.decode_url = url
        return Stage(self, name, url, attributes, parent)

    def waits(self) -> dict[str, float]:
        """Where the request's time went, stage by stage: the proxy's encoder queue apart from
        the encoders' own time, so a slow request names what held it."""
        return {
            "read": self.read_s,
            "encode_queue": self.share_wait_s,
            "encoders": max(0.0, self.encode_s - self.share_wait_s),
            "prefill": self.prefill_s,
            "decode": self.decode_ttfb_s,
            "relay": self.relay_s,
        }

    def waited_in(self) -> str | None:
        """The stage the request spent longest in, or None if it reached none."""
        stage, seconds = max(self.waits().items(), key=lambda pair: pair[1])
        return stage if seconds > 0 else None

    def span_attributes(self) -> dict[str, Any]:
        """What an operator filters a request's root span by."""
        return {
            "epd.items": self.items,
            "epd.attempts": self.attempts,
            "epd.retries": max(0, self.attempts - 1),
            "epd.encoder_requests": self.encoder_requests,
            "epd.coalesced": self.coalesced,
            "epd.affinity_hits": self.affinity_hits,
            "epd.encoder_failovers": self.encoder_failovers,
            "epd.outcome": self.outcome,
            "epd.waited_in": self.waited_in() or "",
            "epd.tenant": self.tenant or "",
        }


class Stage:
    __slots__ = ("trace", "name", "url", "attributes", "parent", "started", "span", "_token")

    def __init__(self, trace: Trace, name: str, url: str | None, attributes: dict, parent: Any) -> None:
        self.trace = trace
        self.name = name
        self.url = url
        self.attributes = attributes
        self.parent = parent
        self.span: Any = None

    def __enter__(self) -> Stage:
        self.started = time.perf_counter()
        spans = self.trace.spans
        if spans is not None:
            self.span, self._token = tracing.open_span(spans, self.name, self.url, self.attributes, self.parent)
        return self

    def event(self, name: str) -> None:
        """A moment inside the step worth seeing on its span (decode's headers, its first token)."""
        if self.span is not None:
            self.span.add_event(name)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        attribute = TIMED.get(self.name)
        if attribute is not None:
            trace = self.trace
            setattr(trace, attribute, getattr(trace, attribute) + time.perf_counter() - self.started)
        spans = self.trace.spans
        if self.span is not None and spans is not None:  # a span is opened only under `spans`
            tracing.close_span(spans, self.span, self._token, exc)


def account(metrics: Metrics, trace: Trace, status: int | str) -> None:
    """One log line, the stage histograms, the autoscaling figures and the root span per request."""
    total_s = time.perf_counter() - trace.started
    if trace.spans is not None:
        tracing.finish(trace.spans, status, trace.span_attributes(), trace.error)
    metrics.requests.labels(str(status)).inc()
    metrics.endpoint_requests.labels(trace.endpoint, str(status)).inc()
    if trace.tenant is not None:
        metrics.tenant_requests.labels(trace.tenant, str(status)).inc()
    metrics.recent.record(trace.started + total_s, status, total_s, trace)
    if metrics.autoscale is not None:
        metrics.autoscale.finished(trace)
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
        "decode": trace.decode_url,
        "prefill": trace.prefill_url,
        "encode_ms": round(trace.encode_s * 1000, 2),
        "prefill_ms": round(trace.prefill_s * 1000, 2),
        "decode_ttfb_ms": round(trace.decode_ttfb_s * 1000, 2),
        "total_ms": round(total_s * 1000, 2),
        "waited_in": trace.waited_in(),
        "endpoint": trace.endpoint,
        "tenant": trace.tenant,
        "client_request_id": trace.client_request_id,
    }
    access_log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()), extra={"fields": fields})
