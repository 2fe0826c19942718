"""--otlp-traces-endpoint against the fakes: the span tree of a request, as a real OTLP receiver
(tools/testing/otlp_receiver.py, both protocols) decodes it, and the context every backend call
carries."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from epd_proxy.fleet.backends import CHAT_PATH
from epd_proxy.ops import tracing
from epd_proxy_tools.testing.fake_vllm import Costs
from epd_proxy_tools.testing.otlp_receiver import Receiver
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_agent_doors import BODIES
from tests.http.test_coalescing import busy_encoder, queue_behind, shared_subrequests
from tests.media import chat, image

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SERVER, CLIENT = 2, 3  # OTLP span kinds
STATUS_ERROR = 2


@pytest.fixture
def receiver(monkeypatch):
    # The SDK's own variables: export within 50 ms instead of 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "epd-proxy-under-test")
    monkeypatch.setenv(tracing.PROTOCOL_VARIABLE, "http/protobuf")
    started = Receiver().start()
    yield started
    tracing.shutdown()
    started.stop()


def traced(receiver: Receiver, protocol: str = "http/protobuf", **overrides):
    endpoint = receiver.http_url if protocol == "http/protobuf" else receiver.grpc_url
    return {"otlp_traces_endpoint": endpoint, **overrides}


async def root_of(receiver: Receiver, request_id: str, path: str = CHAT_PATH):
    def find():
        return [
            s
            for s in receiver.spans()
            if s.name == tracing.root_name(path) and s.attributes["epd.request_id"] == request_id
        ]

    (root,) = await eventually(find, what=f"the root span of {request_id}")
    return root


async def tree(receiver: Receiver, request_id: str, expect: int):
    """The root span of a request and every span of its trace, once `expect` have arrived."""
    root = await root_of(receiver, request_id)

    def whole():
        spans = [s for s in receiver.spans() if s.trace_id == root.trace_id]
        return spans if len(spans) >= expect else None

    spans = await eventually(whole, what=lambda: f"{expect} spans: {[s.name for s in receiver.spans()]}")
    return root, spans


def children(spans, parent):
    return sorted((s for s in spans if s.parent_id == parent.span_id), key=lambda s: s.start_ns)


def traceparent_of(seen) -> tuple[str, str, str]:
    _, trace_id, span_id, flags = seen.headers["traceparent"].split("-")
    return trace_id, span_id, flags


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_a_request_continues_the_clients_trace_and_every_backend_call_carries_its_stage(
    make_stack, receiver, monkeypatch, protocol
):
    monkeypatch.setenv(tracing.PROTOCOL_VARIABLE, protocol)
    stack = await make_stack(encoders=2, **traced(receiver, protocol))
    headers = {"x-request-id": "t-1", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with await stack.chat(chat(image("A"), image("B")), headers=headers) as resp:
        assert resp.status == 200
        await resp.read()
    root, spans = await tree(receiver, "t-1", expect=8)
    assert root.trace_id == CLIENT_TRACE and root.parent_id == CLIENT_SPAN and root.kind == SERVER
    assert root.service == "epd-proxy-under-test"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["epd.encoder_requests"] == 2
    assert [s.name for s in children(spans, root)] == ["read_body", "extract", "encode", "rewrite", "decode", "relay"]
    by_name = {s.name: s for s in children(spans, root)}
    assert by_name["extract"].attributes["epd.items"] == 2
    subs = children(spans, by_name["encode"])
    assert [s.name for s in subs] == ["encode.subrequest"] * 2
    assert {s.attributes["server.address"] for s in subs} == set(stack.backend_urls["e"])
    # The engines' spans join under the span that called them.
    sent = {traceparent_of(seen) for e in stack.encoders for seen in e.requests}
    assert sent == {(CLIENT_TRACE, s.span_id, "01") for s in subs}
    (decode_call,) = stack.pd.requests
    assert traceparent_of(decode_call) == (CLIENT_TRACE, by_name["decode"].span_id, "01")
    assert by_name["decode"].kind == CLIENT and by_name["decode"].attributes["server.address"] == stack.pd_url
    # Stages nest in time within the request.
    assert all(root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns for s in children(spans, root))


async def test_split_prefill_has_its_span_and_a_failed_encode_says_why(make_stack, receiver):
    stack = await make_stack(encoders=1, prefills=1, encoder_failovers=0, **traced(receiver))
    async with await stack.chat(chat(image("A")), headers={"x-request-id": "ok"}) as resp:
        assert resp.status == 200
    root, spans = await tree(receiver, "ok", expect=8)
    (prefill,) = [s for s in children(spans, root) if s.name == "prefill"]
    (prefill_call,) = stack.prefills[0].requests
    assert traceparent_of(prefill_call)[1] == prefill.span_id
    assert prefill.attributes["server.address"] == stack.backend_urls["p"][0]

    stack.encoders[0].faults.fail_next(1, status=503)
    async with await stack.chat(chat(image("B")), headers={"x-request-id": "bad"}) as resp:
        assert resp.status == 503
    root, spans = await tree(receiver, "bad", expect=5)
    assert root.status_code == STATUS_ERROR and root.attributes["http.response.status_code"] == 503
    (encode,) = [s for s in children(spans, root) if s.name == "encode"]
    assert encode.status_code == STATUS_ERROR and encode.attributes["error.type"] == "service_unavailable"
    assert encode.attributes["epd.error.stage"] == "encode"
    assert not [s for s in children(spans, root) if s.name in ("prefill", "decode")]


async def test_a_shared_encoder_subrequest_is_one_span_linked_with_each_members_wait(make_stack, receiver):
    stack = await make_stack(encoders=1, **traced(receiver))
    blockers = await busy_encoder(stack)
    bodies = [chat(image("A")), chat(image("B"))]
    tasks = await queue_behind(stack, bodies)
    await asyncio.gather(*tasks, *blockers)
    (shared_call,) = shared_subrequests(stack.encoders[0])
    shared_trace, shared_id, _ = traceparent_of(shared_call)
    (shared,) = await eventually(lambda: [s for s in receiver.spans() if s.span_id == shared_id], what="shared span")
    assert shared.name == "encode.subrequest" and shared.parent_id == "" and shared.trace_id == shared_trace
    assert shared.attributes["epd.shared_by"] == 2

    # Each member's wait span ends, and is exported, on its own request's task.
    def linked_waits():
        waits = [s for s in receiver.spans() if s.name == "encode.wait_to_share"]
        found = [w for w in waits if (shared_trace, shared_id) in w.links]
        return found if len(found) >= 2 else None

    members = await eventually(linked_waits, what="both members' wait spans")
    assert len(members) == 2 and {(w.trace_id, w.span_id) for w in members} == set(shared.links)
    assert all("sent" in w.events for w in members)
    assert len({w.trace_id for w in members}) == 2, "each member's wait is in its own request's trace"


async def test_sampling_is_parent_based_and_off_means_no_context_sent(make_stack, receiver):
    stack = await make_stack(encoders=1, **traced(receiver, otlp_traces_sample_ratio=0.0))
    async with await stack.chat(chat(image("A")), headers={"x-request-id": "unsampled"}) as resp:
        assert resp.status == 200
    unsampled_trace, _, flags = traceparent_of(stack.pd.requests[-1])
    assert int(flags, 16) & 1 == 0, "not sampled"
    sampled = {"x-request-id": "sampled", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with await stack.chat(chat(image("B")), headers=sampled) as resp:
        assert resp.status == 200
    await tree(receiver, "sampled", expect=8)
    assert not [s for s in receiver.spans() if s.trace_id == unsampled_trace]

    untraced = await make_stack(encoders=1)
    tracing.shutdown()  # the first stack's tracer would otherwise serve the second one too
    async with await untraced.chat(chat(image("C"))) as resp:
        assert resp.status == 200
        assert orjson.loads(await resp.read())["choices"]
    assert all("traceparent" not in seen.headers for seen in untraced.pd.requests + untraced.encoders[0].requests)


def tracestate_member(key: str, size: int) -> str:
    return f"{key}={'v' * (size - len(key) - 1)}"


async def test_a_clients_long_tracestate_reaches_no_engine_whole(make_stack, receiver):
    stack = await make_stack(encoders=1, **traced(receiver))
    # 6.5 KB of well-formed members (the SDK alone passes all of it on), and two short ones.
    state = ",".join(["rojo=1", *(tracestate_member(f"v{i}", 256) for i in range(25)), "congo=2"])
    headers = {"x-request-id": "ts", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": state}
    async with await stack.chat(chat(image("A")), headers=headers) as resp:
        assert resp.status == 200
    calls = stack.pd.requests + stack.encoders[0].requests
    assert {seen.headers.get("tracestate") for seen in calls} == {"rojo=1,congo=2"}
    assert {traceparent_of(seen)[0] for seen in calls} == {CLIENT_TRACE}


async def test_ignoring_client_context_a_sampled_traceparent_starts_no_trace(make_stack, receiver):
    stack = await make_stack(
        encoders=1, **traced(receiver, otlp_traces_sample_ratio=0.0, otlp_traces_client_context="ignore")
    )
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "rojo=1"}
    async with await stack.chat(chat(image("A")), headers=headers) as resp:
        assert resp.status == 200
    calls = stack.pd.requests + stack.encoders[0].requests
    # Engines get the proxy's own unsampled context, never the client's: vLLM would sample by it.
    for seen in calls:
        trace_id, _, flags = traceparent_of(seen)
        assert trace_id != CLIENT_TRACE and int(flags, 16) & 1 == 0 and "tracestate" not in seen.headers
    tracing.shutdown()  # exports whatever was recorded, synchronously
    assert receiver.spans() == []


async def test_ignoring_client_context_a_sampled_request_is_a_trace_of_its_own(make_stack, receiver):
    stack = await make_stack(encoders=1, **traced(receiver, otlp_traces_client_context="ignore"))
    headers = {"x-request-id": "own", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with await stack.chat(chat(image("A")), headers=headers) as resp:
        assert resp.status == 200
    root, _ = await tree(receiver, "own", expect=7)
    assert root.trace_id != CLIENT_TRACE and root.parent_id == ""
    assert {traceparent_of(seen)[0] for seen in stack.pd.requests} == {root.trace_id}


async def test_a_streams_decode_span_marks_its_headers_and_first_token(make_stack, receiver):
    # vLLM sends a stream's headers before its engine runs: the first token comes later.
    stack = await make_stack(encoders=1, consumer_options={"costs": Costs(first_token_s=0.4)}, **traced(receiver))
    async with await stack.chat({**chat(image("A")), "stream": True}, headers={"x-request-id": "s"}) as resp:
        assert resp.status == 200
        await resp.read()
    root, spans = await tree(receiver, "s", expect=7)
    (decode,) = [s for s in children(spans, root) if s.name == "decode"]
    assert decode.events == ("headers", "first_token")
    headers_ns, first_token_ns = decode.event_ns
    assert decode.start_ns <= headers_ns and first_token_ns - headers_ns >= 0.4e9 and first_token_ns <= decode.end_ns


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_an_agent_doors_root_span_is_named_after_its_route(make_stack, receiver, api):
    stack = await make_stack(encoders=1, **traced(receiver))
    async with stack.client.post(f"/v1/{api}", json=BODIES[api]("A"), headers={"x-request-id": api}) as resp:
        assert resp.status == 200
    root = await root_of(receiver, api, f"/v1/{api}")
    assert root.attributes["url.path"] == f"/v1/{api}"
