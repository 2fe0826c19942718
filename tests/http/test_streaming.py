"""Streaming: byte-exact relay, and a real HTTP status whenever anything fails before decode answers."""

from __future__ import annotations

import orjson

from epd_proxy_tools.testing.fake_vllm import ANSWER_SUFFIX
from tests.media import chat, image


async def read_stream(resp):
    return b"".join([chunk async for chunk in resp.content.iter_any()])


async def test_stream_is_relayed_byte_for_byte(make_stack):
    stack = await make_stack(encoders=2)
    body = chat(image("A"), image("B"), stream=True)
    async with await stack.chat(body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        via_proxy = await read_stream(resp)
    forwarded = stack.pd.requests[0].body
    # The proxy asked for usage on the client's behalf (journey/stream_usage.py) and takes it back
    # out: the client gets what the PD answers the request as the client sent it.
    assert forwarded.pop("stream_options") == {"include_usage": True, "continuous_usage_stats": False}
    async with stack.client.post(stack.pd_url + "/v1/chat/completions", json=forwarded) as resp:
        direct = await read_stream(resp)
    via_proxy = via_proxy.replace(b"chatcmpl-0", b"X")
    direct = direct.replace(b"chatcmpl-1", b"X")
    assert via_proxy == direct
    text = "".join(
        orjson.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in via_proxy.decode("utf-8").split("\n\n")
        if line.startswith("data: {")
    )
    assert text.endswith(ANSWER_SUFFIX)


async def test_stream_failure_before_decode_is_a_real_error_status(make_stack):
    stack = await make_stack(encoders=1)
    stack.encoders[0].faults.fail_next(1, 400)
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 400
        assert resp.headers["Content-Type"].startswith("application/json")
        assert (await resp.json())["error"]["stage"] == "encode"


async def test_stream_retries_on_decode_500_before_first_byte(make_stack):
    stack = await make_stack(encoders=1, decode_retries=1)
    stack.pd.faults.fail_next()
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 200
        assert (await read_stream(resp)).endswith(b"data: [DONE]\n\n")
    assert len(stack.encoder_requests()) == 2


async def test_stream_decode_error_keeps_decodes_status_and_body(make_stack):
    stack = await make_stack(encoders=1, decode_retries=0)
    stack.pd.faults.fail_next(1, 503, "overloaded")
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "overloaded"
