"""One request's trace across the proxy and every real vLLM server it reached.

The shared stacks run every server with `--otlp-traces-endpoint` pointing at the session's OTLP
receiver (conftest.TRACES: gRPC, vLLM's default protocol, decoded with OpenTelemetry's protobuf
definitions), sampling parent-based only. A request whose client sends a sampled `traceparent`
must then come back as one trace: the proxy's root span continuing the client's span, and each
engine's `llm_request` span a child of the proxy's span that called it. A request without one is
not sampled, and no server may export a span of it.
"""

from __future__ import annotations

import json
import os
import secrets
import urllib.request

import pytest

from epd_proxy.fleet.backends import CHAT_PATH
from epd_proxy.ops.tracing import root_name
from epd_proxy_tools.testing.polling import eventually_sync

from .conftest import TRACES
from .e2e_helpers import chat_body, image_source

pytestmark = pytest.mark.e2e
ROOT_SPAN = root_name(CHAT_PATH)

# Seeds no other test sends: the proxy leaves an image it saw encoded before to the consumer.
fresh = image_source(range(80_000, 81_000))
SERVER = 2


def post_traced(url: str, body: dict, traceparent: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if traceparent:
        headers["traceparent"] = traceparent
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=180) as resp:
        resp.read()
        return resp.status


def trace_of(trace_id: str, engines: int):
    """Every span of the trace, once the proxy's root and `engines` vLLM spans have arrived."""

    def whole():
        spans = [s for s in TRACES.spans() if s.trace_id == trace_id]
        roots = [s for s in spans if s.name == ROOT_SPAN]
        engine_spans = [s for s in spans if s.name == "llm_request"]
        return spans if roots and len(engine_spans) >= engines else None

    return eventually_sync(
        whole, timeout=60, what=lambda: f"{engines} engine spans of {trace_id}: {[s.name for s in TRACES.spans()]}"
    )


def check_tree(spans, client_trace: str, client_span: str, stages: dict[str, int]):
    """The proxy's root continues the client's span; each engine span hangs under the proxy span
    named in `stages` (stage name -> how many engine spans under it)."""
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == ROOT_SPAN]
    assert root.trace_id == client_trace and root.parent_id == client_span and root.kind == SERVER
    assert root.attributes["http.response.status_code"] == 200
    engines = [s for s in spans if s.name == "llm_request"]
    under = {}
    for engine in engines:
        parent = by_id[engine.parent_id]
        assert parent.service == "epd-proxy" and engine.kind == SERVER, (parent, engine)
        under.setdefault(parent.name, []).append(engine)
        # The engine span's own figures, as vLLM reports them.
        assert engine.attributes["gen_ai.usage.prompt_tokens"] > 0
    assert {name: len(found) for name, found in under.items()} == stages, under
    # Every proxy span descends from the root.
    for span in spans:
        if span.service == "epd-proxy" and span is not root:
            ancestor = span
            while ancestor.parent_id in by_id and ancestor is not root:
                ancestor = by_id[ancestor.parent_id]
            assert ancestor is root, span
    return root


def client_context() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def test_e_pd_one_trace_from_the_client_through_both_encoders_and_pd(stack):
    trace_id, span_id, traceparent = client_context()
    assert post_traced(stack.proxy_url, chat_body(fresh(2)), traceparent) == 200
    spans = trace_of(trace_id, engines=3)
    check_tree(spans, trace_id, span_id, {"encode.subrequest": 2, "decode": 1})


def test_the_stacks_sampling_stays_with_their_servers(stack):
    # The test process's own SDK users (the proxies the HTTP and unit tests build, after these)
    # would read a sampler variable left here and trace nothing.
    assert not {name for name in os.environ if name.startswith("OTEL_")}
    assert stack.config.extra_env["OTEL_TRACES_SAMPLER_ARG"] == "0"


def test_unsampled_request_leaves_no_span_anywhere(stack):
    TRACES.clear()
    assert post_traced(stack.proxy_url, chat_body(fresh(1)), None) == 200
    # A sampled request after it: once its spans are in, the unsampled one's would be too.
    trace_id, _, traceparent = client_context()
    assert post_traced(stack.proxy_url, chat_body(fresh(1)), traceparent) == 200
    trace_of(trace_id, engines=2)
    assert {s.trace_id for s in TRACES.spans()} == {trace_id}


def test_e_p_d_one_trace_through_encoder_prefill_and_decode(prefill_stack):
    trace_id, span_id, traceparent = client_context()
    assert post_traced(prefill_stack.proxy_url, chat_body(fresh(1)), traceparent) == 200
    spans = trace_of(trace_id, engines=3)
    check_tree(spans, trace_id, span_id, {"encode.subrequest": 1, "prefill": 1, "decode": 1})
