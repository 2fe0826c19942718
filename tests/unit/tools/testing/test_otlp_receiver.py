"""The tests' OTLP receiver decodes both protocols the way an exporter sends them."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from epd_proxy.ops import tracing
from epd_proxy_tools.testing.otlp_receiver import Receiver


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_arrive_decoded(monkeypatch, protocol):
    monkeypatch.setenv(tracing.PROTOCOL_VARIABLE, protocol)
    receiver = Receiver().start()
    try:
        url = receiver.http_url if protocol == "http/protobuf" else receiver.grpc_url
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(tracing.span_exporter(url)))
        tracer = provider.get_tracer("t")
        with (
            tracer.start_as_current_span("parent") as parent,
            tracer.start_as_current_span("child", attributes={"n": 3}),
        ):
            pass
        provider.shutdown()
        spans = {span.name: span for span in receiver.spans()}
        assert spans["child"].parent_id == format(parent.get_span_context().span_id, "016x")
        assert spans["child"].attributes == {"n": 3} and spans["child"].trace_id == spans["parent"].trace_id
    finally:
        receiver.stop()
