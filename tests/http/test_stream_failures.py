"""Failures as vLLM produces them: in-band stream errors, silent and broken streams, clients that
leave, and what the client, the metrics and the request log see for each."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from pathlib import Path

import aiohttp
import orjson

import epd_proxy.http.routes
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

VLLM_ERROR = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}


async def read_all(resp) -> bytes:
    return b"".join([chunk async for chunk in resp.content.iter_any()])


def events(raw: bytes) -> list:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame.startswith("data: "):
            data = frame[6:]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def text_of(evs: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in evs if isinstance(e, dict) and e.get("choices"))


def state_of(stack):
    return stack.state


async def metric_lines(stack) -> str:
    async with stack.client.get(stack.url + "/metrics") as resp:
        return await resp.text()


# -- 1. in-band errors -------------------------------------------------------------------------------


async def test_in_band_error_before_any_content_is_retried_from_scratch(make_stack):
    stack = await make_stack(encoders=1, decode_retries=1, ec_consumer_zmq_addrs=("tcp://c:1",))
    stack.pd.faults.generation_errors = 1
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 200
        evs = events(await read_all(resp))
    assert not any("error" in e for e in evs if isinstance(e, dict))
    assert evs[-1] == "[DONE]" and text_of(evs).startswith("answer-")
    assert len(stack.pd.requests) == 2 and len(stack.encoder_requests()) == 2
    first, second = (r.body["ec_transfer_params"]["ec_items"][0]["transfer_id"] for r in stack.pd.requests)
    assert first != second
    assert 'epd_retries_total{stage="decode"} 1.0' in await metric_lines(stack)


async def test_in_band_error_is_relayed_as_vllm_sent_it_when_no_attempt_is_left(make_stack):
    stack = await make_stack(encoders=1, decode_retries=1)
    stack.pd.faults.generation_errors = 2
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 200
        evs = events(await read_all(resp))
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert evs[1] == {"error": VLLM_ERROR} and evs[2] == "[DONE]"
    assert len(stack.pd.requests) == 2
    # vLLM's own error event ends a failed stream: counted as aborted, not as a 200 that completed.
    text = await metric_lines(stack)
    assert 'epd_requests_total{status="aborted"} 1.0' in text and 'status="200"' not in text


async def test_non_streaming_generation_error_is_vllms_500_and_is_retried(make_stack):
    stack = await make_stack(encoders=1, decode_retries=1)
    stack.pd.faults.generation_errors = 2
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 500 and resp.headers["x-epd-stage"] == "decode"
        assert (await resp.json())["error"] == VLLM_ERROR
    assert len(stack.pd.requests) == 2 and len(stack.encoder_requests()) == 2


async def test_no_retry_once_content_went_out(make_stack):
    stack = await make_stack(encoders=1, decode_retries=3)
    stack.pd.faults.cut_streams = 1
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 200
        await read_all(resp)
    assert len(stack.pd.requests) == 1


# -- 2. silent streams ----------------------------------------------------------------------------


async def test_stream_silent_after_content_gets_an_error_event_and_frees_everything(make_stack):
    stack = await make_stack(encoders=1, stream_idle_timeout_s=0.3)
    stack.pd.faults.stall_streams = 1
    async with asyncio.timeout(10):
        async with await stack.chat(chat(image("A"), stream=True)) as resp:
            assert resp.status == 200
            evs = events(await read_all(resp))
    assert text_of(evs)
    error = evs[-2]["error"]
    assert evs[-1] == "[DONE]" and error["code"] == 504 and error["stage"] == "decode"
    assert "timed out" in error["message"]
    state = state_of(stack)
    await eventually(lambda: stack.pd.cancelled == 1)
    await eventually(lambda: state.admission.inflight == 0 and all(i.inflight == 0 for i in state.fleet.all()))


async def test_non_streaming_answer_silent_after_headers_is_504(make_stack):
    stack = await make_stack(encoders=1, stream_idle_timeout_s=0.3)
    stack.pd.faults.stall_streams = 1
    async with asyncio.timeout(10):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["stage"] == "decode" and error["backend"] == stack.pd_url
    await eventually(lambda: stack.pd.cancelled == 1)
    assert state_of(stack).admission.inflight == 0


# -- 3. aborted streams, clients that leave -------------------------------------------------------


async def test_stream_cut_midway_ends_with_an_error_event_and_counts_as_aborted(make_stack, caplog):
    stack = await make_stack(encoders=1)
    stack.pd.faults.cut_streams = 1
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        async with await stack.chat(chat(image("A"), stream=True)) as resp:
            assert resp.status == 200
            raw = await read_all(resp)
    evs = events(raw)  # every frame parses: no half event before the error
    assert text_of(evs) and evs[-1] == "[DONE]"
    assert evs[-2]["error"]["stage"] == "decode" and evs[-2]["error"]["code"] == 502
    text = await metric_lines(stack)
    assert 'epd_requests_total{status="aborted"} 1.0' in text and 'status="200"' not in text
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    assert record.fields["status"] == "aborted" and record.fields["outcome"] == "aborted"


async def test_non_streaming_body_cut_after_headers_is_502_naming_decode(make_stack):
    stack = await make_stack(encoders=1)
    stack.pd.faults.cut_streams = 1
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["stage"] == "decode" and error["backend"] == stack.pd_url


async def test_client_leaving_mid_stream_is_a_client_disconnect(make_stack, caplog):
    stack = await make_stack(encoders=1)
    stack.pd.tokens_per_chunk = 1
    stack.pd.stream_pause_s = 0.05
    with caplog.at_level(logging.INFO):
        client = aiohttp.ClientSession()
        resp = await client.post(stack.url + "/v1/chat/completions", json=chat(image("A"), stream=True))
        assert resp.status == 200
        await resp.content.read(200)
        resp.close()
        await client.close()
        await eventually(lambda: any(r.name == "epd_proxy.request" for r in caplog.records))
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    assert record.fields["outcome"] == "client_disconnect" and record.fields["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("epd_proxy")]
    assert 'epd_requests_total{status="499"} 1.0' in await metric_lines(stack)
    await eventually(lambda: stack.pd.cancelled == 1)


# -- 4. memory of a long stream --------------------------------------------------------------------


def _held_by_app(snapshot: tracemalloc.Snapshot) -> int:
    app_file = str(Path(epd_proxy.http.routes.__file__))
    return sum(
        stat.size for stat in snapshot.filter_traces([tracemalloc.Filter(True, app_file)]).statistics("filename")
    )


async def test_client_body_is_let_go_once_decode_commits(make_stack):
    stack = await make_stack(encoders=2)
    for fake in [*stack.encoders, stack.pd]:
        fake.record = False
    stack.pd.tokens_per_chunk = 1
    stack.pd.stream_pause_s = 0.02
    big = [image(f"{n}-" + "x" * 300_000) for n in range(3)]  # about 1.2 MB of base64
    tracemalloc.start()
    try:
        async with await stack.chat(chat(*big, stream=True)) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b'"content":"a')  # generated text is flowing
            during = _held_by_app(tracemalloc.take_snapshot())
            await read_all(resp)
    finally:
        tracemalloc.stop()
    assert during < 200_000, f"{during} bytes parsed by the handler are still alive mid-stream"


async def test_waiting_for_a_decode_connection_is_bounded_by_the_decode_timeout(make_stack):
    """With --max-connections-per-backend, a request queued behind a long stream gets a 504 once
    --decode-timeout has passed, instead of waiting for as long as the stream lasts."""
    stack = await make_stack(encoders=1, max_connections_per_backend=1, decode_timeout_s=0.5, stream_idle_timeout_s=30)
    stack.pd.faults.stall_streams = 1
    first = await stack.chat(chat(image("A"), stream=True))
    try:
        assert first.status == 200
        async with asyncio.timeout(10):
            async with await stack.chat(chat(image("B"))) as resp:
                assert resp.status == 504
                error = (await resp.json())["error"]
        assert error["stage"] == "decode" and "timed out" in error["message"]
    finally:
        first.close()
    state = state_of(stack)
    await eventually(lambda: state.admission.inflight == 0 and all(i.inflight == 0 for i in state.fleet.all()))
