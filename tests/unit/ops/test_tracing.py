"""ops/tracing.py on its own: off costs nothing and exports nothing, the exporter is chosen as vLLM
chooses it, a setup it cannot export with is refused at startup, and a stage's span is the
context its backend calls carry."""

from __future__ import annotations

import pytest

from epd_proxy.calls.upstream import CONTEXT_HEADERS
from epd_proxy.config import ConfigError
from epd_proxy.journey.trace import Trace
from epd_proxy.ops import tracing


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_VARIABLE, "http/protobuf")
    # Nothing listens there and nothing is exported before shutdown's flush, which fails quietly.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    tracing.setup("http://127.0.0.1:9/v1/traces", 1.0)
    yield
    tracing.shutdown()


def test_off_there_are_no_spans_and_no_context_headers():
    assert tracing.begin({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, "r", 0.0) is None
    trace = Trace("r")
    with trace.stage("decode") as stage:
        assert stage.span is None and CONTEXT_HEADERS.get() is None
    assert tracing.queued_subrequest([None], "http://e:1", 1).__enter__() is None


@pytest.mark.parametrize(
    ("protocol", "module"),
    [("grpc", "opentelemetry.exporter.otlp.proto.grpc"), ("http/protobuf", "opentelemetry.exporter.otlp.proto.http")],
)
def test_the_exporter_follows_the_protocol_variable_as_vllm_reads_it(monkeypatch, protocol, module):
    monkeypatch.setenv(tracing.PROTOCOL_VARIABLE, protocol)
    assert type(tracing.span_exporter("http://127.0.0.1:4317")).__module__.startswith(module)


def test_an_unknown_protocol_is_refused_at_startup(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_VARIABLE, "http/json")
    with pytest.raises(ConfigError, match="only grpc and http/protobuf"):
        tracing.require_sdk()
    monkeypatch.delenv(tracing.PROTOCOL_VARIABLE)
    tracing.require_sdk()  # gRPC by default, installed here


def test_a_stage_span_continues_the_client_and_its_calls_carry_it(traced):
    client = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    trace = Trace("r")
    trace.spans = tracing.begin({"traceparent": client}, "r", trace.started)
    root = trace.spans.root.get_span_context()
    assert format(root.trace_id, "032x") == "a" * 32
    with trace.stage("decode") as stage:
        sent = CONTEXT_HEADERS.get()["traceparent"]
        assert sent == f"00-{'a' * 32}-{format(stage.span.get_span_context().span_id, '016x')}-01"
        assert stage.span.parent.span_id == root.span_id
    assert CONTEXT_HEADERS.get() is None, "the context ends with its stage"


def test_a_failed_stage_says_why(traced):
    trace = Trace("r")
    trace.spans = tracing.begin({}, "r", trace.started)
    with pytest.raises(TimeoutError), trace.stage("prefill") as stage:
        raise TimeoutError("no answer")
    assert stage.span.attributes["error.type"] == "TimeoutError"
    assert not stage.span.status.is_ok
