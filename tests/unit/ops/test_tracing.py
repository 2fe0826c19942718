"""ops/tracing.py on its own: off costs nothing and exports nothing, the exporter is chosen as vLLM
chooses it, a setup it cannot export with is refused at startup, and a stage's span is the
context its backend calls carry."""

from __future__ import annotations

import pytest

from epd_proxy.calls.upstream import CONTEXT_HEADERS
from epd_proxy.config import ConfigError
from epd_proxy.fleet.backends import CHAT_PATH
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
    assert tracing.begin({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, "r", 0.0, CHAT_PATH) is None
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
    trace.spans = tracing.begin({"traceparent": client}, "r", trace.started, CHAT_PATH)
    root = trace.spans.root.get_span_context()
    assert format(root.trace_id, "032x") == "a" * 32
    with trace.stage("decode") as stage:
        sent = CONTEXT_HEADERS.get()["traceparent"]
        assert sent == f"00-{'a' * 32}-{format(stage.span.get_span_context().span_id, '016x')}-01"
        assert stage.span.parent.span_id == root.span_id
    assert CONTEXT_HEADERS.get() is None, "the context ends with its stage"


def test_a_failed_stage_says_why(traced):
    trace = Trace("r")
    trace.spans = tracing.begin({}, "r", trace.started, CHAT_PATH)
    with pytest.raises(TimeoutError), trace.stage("prefill") as stage:
        raise TimeoutError("no answer")
    assert stage.span.attributes["error.type"] == "TimeoutError"
    assert not stage.span.status.is_ok


def member(key: str, size: int) -> str:
    """A tracestate list member `key=...` of exactly `size` characters."""
    return f"{key}={'v' * (size - len(key) - 1)}"


def test_a_short_tracestate_passes_as_it_came():
    header = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    assert tracing.bounded_tracestate([header]) == header
    # Several header fields are one list; empty members and blanks around them are nothing.
    assert tracing.bounded_tracestate(["rojo=1", " , congo=2 "]) == "rojo=1,congo=2"
    assert tracing.bounded_tracestate([]) is None and tracing.bounded_tracestate([" , "]) is None


def test_past_512_characters_the_long_members_go_first_then_the_last():
    small = [member(f"k{i}", 60) for i in range(10)]  # 10 x 60 + 9 commas = 609 characters
    big = member("big", 200)
    bounded = tracing.bounded_tracestate([",".join([small[0], big, *small[1:]])])
    # The member over 128 characters goes first, then members from the end until it fits.
    assert bounded == ",".join(small[:8]) and len(bounded) <= tracing.TRACESTATE_MAX_CHARS
    # A client's 6.5 KB of well-formed members: only its short ones are passed on.
    huge = ",".join([member(f"v{i}", 256) for i in range(25)] + ["rojo=1", "congo=2"])
    assert len(huge) > 6400 and tracing.bounded_tracestate([huge]) == "rojo=1,congo=2"


@pytest.mark.parametrize(
    "header",
    [
        ",".join(f"k{i}=v" for i in range(33)),  # more than 32 members
        "rojo=1,rojo=2",  # a key twice
        "Rojo=1",  # keys are lower case
        "rojo=a b=c",
        "rojo=1,=2",
        "rojo=caf\u00e9",
        "rojo=" + "v" * 257,  # a value is at most 256 characters
        "x" * 9000,
    ],
)
def test_an_invalid_tracestate_is_dropped_whole(header):
    assert tracing.bounded_tracestate([header]) is None


def test_multi_tenant_keys_and_32_members_are_valid():
    header = ",".join([f"k{i}=v" for i in range(31)] + ["tenant@vendor=x"])
    assert tracing.bounded_tracestate([header]) == header
