"""OpenTelemetry traces of chat requests, exported with `--otlp-traces-endpoint` (vLLM's flag).

Off unless set up: `setup()` is the only place the SDK is imported, so the light install never
needs it (`pip install 'epd-proxy[otel]'` brings it) and a request of a proxy without tracing
costs an `is None` test per stage. The exporter is chosen as vLLM chooses it (gRPC unless
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`); the SDK reads its own `OTEL_*` variables
(service name, resource attributes, batch sizes, sampler, propagators).

A request's spans hang under one root span (SERVER), which continues the client's `traceparent`
unless the operator told the proxy to ignore it (`--otlp-traces-client-context ignore`): then a
client's context neither starts a trace nor becomes a parent, and engines never see it. A
client's `tracestate`, which every engine call would carry on, is cut to what W3C Trace Context
lets a vendor keep (`bounded_tracestate`).
Stages open their spans through journey/trace.py's `Trace.stage`; while one is open, every
backend call its task makes carries that span's context (calls/upstream.CONTEXT_HEADERS), so
vLLM's own `llm_request` spans join the trace under the stage that called them. A sub-request
shared by several requests is one span in a trace of its own, linked both ways with each
member's wait span.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any

from epd_proxy.calls.upstream import CONTEXT_HEADERS
from epd_proxy.config import ConfigError

PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_NAME = "epd-proxy"

_tracer: Any = None
_provider: Any = None
_api: Any = None  # what setup() imported of opentelemetry
_follow_client = True

# W3C Trace Context's tracestate: at most 32 `key=value` members; a vendor may cut a list longer
# than 512 characters, dropping members over 128 characters first, then members from the end.
TRACESTATE_MAX_MEMBERS = 32
TRACESTATE_MAX_CHARS = 512
TRACESTATE_LONG_MEMBER = 128
# Longer than this is not read at all (the OpenTelemetry SDK's own limit).
TRACESTATE_READ_MAX = 8192
_KEY_TAIL = r"[a-z0-9_\-*/]"
_TRACESTATE_MEMBER = re.compile(
    rf"(?:[a-z]{_KEY_TAIL}{{0,255}}|[a-z0-9]{_KEY_TAIL}{{0,240}}@[a-z]{_KEY_TAIL}{{0,13}})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


class _Api:
    __slots__ = ("trace", "propagate", "link", "kind", "error")

    def __init__(self, trace: Any, propagate: Any, link: Any, kind: Any, error: Any) -> None:
        self.trace, self.propagate, self.link, self.kind, self.error = trace, propagate, link, kind, error


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint without the OpenTelemetry SDK installed."""


def require_sdk() -> None:
    """At startup, not at the first request: the SDK, the chosen exporter and a known protocol."""
    protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
    module = {"grpc": "grpc", "http/protobuf": "http"}.get(protocol)
    if module is None:
        raise ConfigError(f"{PROTOCOL_VARIABLE}={protocol!r}: only grpc and http/protobuf are supported")
    for name in ("opentelemetry.sdk", f"opentelemetry.exporter.otlp.proto.{module}"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # its parent package is missing
            found = False
        if not found:
            raise ConfigError(f"--otlp-traces-endpoint needs {name}: pip install 'epd-proxy[otel]'")


def setup(endpoint: str, sample_ratio: float | None = None, follow_client: bool = True) -> None:
    """Start exporting this process's spans to `endpoint`.

    `sample_ratio` None leaves sampling to the SDK's OTEL_TRACES_SAMPLER (parent-based, always on
    by default); a ratio samples new traces by trace id and follows the client's decision.
    Without `follow_client` every request is a new trace, whatever the client sent."""
    global _tracer, _provider, _api, _follow_client
    try:
        from opentelemetry import propagate, trace
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'epd-proxy[otel]' ({exc})"
        ) from None
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_KEY: SERVICE_NAME}
    options: dict[str, Any] = {"resource": Resource.create(attributes)}
    if sample_ratio is not None:
        options["sampler"] = ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(**options)
    provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
    _api = _Api(trace, propagate, Link, SpanKind, lambda message: Status(StatusCode.ERROR, message))
    _provider = provider
    _tracer = provider.get_tracer("epd_proxy")
    _follow_client = follow_client


def span_exporter(endpoint: str) -> Any:
    """vLLM's choice (vllm/tracing/otel.py): gRPC, plaintext, unless the protocol variable says
    http/protobuf; anything else is refused at startup."""
    protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    raise TracingUnavailable(f"{PROTOCOL_VARIABLE}={protocol!r}: only grpc and http/protobuf are supported")


def shutdown() -> None:
    """Export what is left and stop: spans of the last requests must not die with the process."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


class RequestSpans:
    """One request's root span and the encode span its encoder sub-requests hang under."""

    __slots__ = ("root", "encode")

    def __init__(self, root: Any) -> None:
        self.root = root
        self.encode: Any = None


def root_name(path: str) -> str:
    """A request's root span is named after the route it came in by (the door's path)."""
    return f"POST {path}"


def begin(headers: Mapping[str, str], request_id: str, started: float, path: str) -> RequestSpans | None:
    """The root span of a request to `path`, continuing the client's trace context if it sent one
    and the proxy follows clients; None while tracing is off. `started` is the request's
    perf_counter start."""
    if _tracer is None:
        return None
    if _follow_client:
        parent = _api.propagate.extract(_client_carrier(headers))
    else:
        parent = _api.trace.set_span_in_context(_api.trace.INVALID_SPAN)
    root = _tracer.start_span(
        root_name(path),
        context=parent,
        kind=_api.kind.SERVER,
        start_time=_ns(started),
        attributes={"http.request.method": "POST", "url.path": path, "epd.request_id": request_id},
    )
    return RequestSpans(root)


def _client_carrier(headers: Mapping[str, str]) -> dict[str, str]:
    """The request's headers as the propagators read them, its tracestate bounded."""
    carrier = {key.lower(): value for key, value in headers.items()}
    getall = getattr(headers, "getall", None)
    fields = getall("tracestate", []) if getall is not None else [carrier.get("tracestate")]
    bounded = bounded_tracestate([field for field in fields if field is not None])
    if bounded is None:
        carrier.pop("tracestate", None)
    else:
        carrier["tracestate"] = bounded
    return carrier


def bounded_tracestate(fields: Sequence[str]) -> str | None:
    """A client's tracestate (all its header fields, one list) as engines may get it: None if it
    is not a valid list (a malformed member, a key twice, more than 32 members), else at most 512
    characters of it, members over 128 characters dropped first, then members from the end."""
    if sum(len(field) + 1 for field in fields) > TRACESTATE_READ_MAX:
        return None
    members: list[str] = []
    keys: set[str] = set()
    for field in fields:
        for member in field.split(","):
            member = member.strip(" \t")
            if not member:
                continue
            key = member.partition("=")[0]
            if key in keys or not _TRACESTATE_MEMBER.fullmatch(member):
                return None
            keys.add(key)
            members.append(member)
    if len(members) > TRACESTATE_MAX_MEMBERS:
        return None
    if _joined(members) > TRACESTATE_MAX_CHARS:
        members = [member for member in members if len(member) <= TRACESTATE_LONG_MEMBER]
        while _joined(members) > TRACESTATE_MAX_CHARS:
            members.pop()
    return ",".join(members) or None


def _joined(members: Sequence[str]) -> int:
    return sum(map(len, members)) + max(0, len(members) - 1)


def lap(spans: RequestSpans, name: str, since: float, **attributes: Any) -> None:
    """A span already over: a step with no backend call in it (reading the body, extracting)."""
    _tracer.start_span(
        name, context=_api.trace.set_span_in_context(spans.root), start_time=_ns(since), attributes=attributes
    ).end()


def open_span(spans: RequestSpans, name: str, url: str | None, attributes: Mapping[str, Any], parent: Any) -> Any:
    """A stage's span, and the trace headers its backend calls carry from now on (a token to
    reset them with)."""
    if parent is None:
        parent = spans.encode if name.startswith("encode.") and spans.encode is not None else spans.root
    kind = _api.kind.CLIENT if url else _api.kind.INTERNAL
    span = _tracer.start_span(name, context=_api.trace.set_span_in_context(parent), kind=kind)
    if url:
        span.set_attribute("server.address", url)
    if attributes:
        span.set_attributes(attributes)
    if name == "encode":
        spans.encode = span
    return span, CONTEXT_HEADERS.set(_headers_of(span))


def close_span(spans: RequestSpans, span: Any, token: Any, exc: BaseException | None) -> None:
    CONTEXT_HEADERS.reset(token)
    if exc is not None:
        failed(span, exc)
    if spans.encode is span:
        spans.encode = None
    span.end()


def failed(span: Any, exc: BaseException) -> None:
    """What an operator filters a failed span by: the error's kind, status and stage."""
    kind = getattr(exc, "kind", None) or getattr(exc, "error_type", None) or type(exc).__name__
    span.set_attribute("error.type", str(kind))
    for name, key in (("status", "http.response.status_code"), ("stage", "epd.error.stage")):
        value = getattr(exc, name, None)
        if value is not None:
            span.set_attribute(key, value)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    span.set_status(_api.error(message[:500]))


def finish(spans: RequestSpans, status: int | str, attributes: Mapping[str, Any], error: BaseException | None) -> None:
    root = spans.root
    root.set_attributes(attributes)
    if isinstance(status, int):
        root.set_attribute("http.response.status_code", status)
    else:
        root.set_attribute("epd.outcome", status)
    if error is not None:
        failed(root, error)
    elif not isinstance(status, int) or status >= 500:
        root.set_status(_api.error(str(status)))
    root.end()


def queued_subrequest(waiting: Iterable[Any], url: str, items: int) -> AbstractContextManager:
    """The span of an encoder sub-request sent from the queue: with one member, a child of that
    member's wait span; shared by several, a trace of its own linked to each member's wait span,
    each of which links back to it (see the module's docstring)."""
    members = [span for span in waiting if span is not None] if _tracer is not None else ()
    if not members:
        return _NOTHING
    trace = _api.trace
    links: list[Any] = []
    if len(members) == 1:
        context = trace.set_span_in_context(members[0])
    else:
        context = trace.set_span_in_context(trace.INVALID_SPAN)
        links = [_api.link(member.get_span_context()) for member in members]
    span = _tracer.start_span(
        "encode.subrequest",
        context=context,
        kind=_api.kind.CLIENT,
        links=links,
        attributes={"server.address": url, "epd.items": items, "epd.shared_by": len(members)},
    )
    for member in members:
        member.add_event("sent")
        if len(members) > 1:
            member.add_link(span.get_span_context())
    return _Current(span)


class _Current:
    """A span whose context the backend calls made inside carry, ended on the way out."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Any) -> None:
        self.span = span

    def __enter__(self) -> Any:
        self._token = CONTEXT_HEADERS.set(_headers_of(self.span))
        return self.span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        CONTEXT_HEADERS.reset(self._token)
        if exc is not None:
            failed(self.span, exc)
        self.span.end()


_NOTHING = nullcontext()


def _headers_of(span: Any) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _api.propagate.inject(carrier, context=_api.trace.set_span_in_context(span))
    return carrier


# perf_counter -> the wall clock in ns the SDK stamps spans with, fixed once per process.
_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def _ns(perf: float) -> int:
    return int(perf * 1e9) + _OFFSET_NS
