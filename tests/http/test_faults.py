"""Every failure path answers with a clear status and JSON body, and nothing hangs."""

from __future__ import annotations

import asyncio

import pytest

from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image


async def error_of(resp):
    assert resp.headers["Content-Type"].startswith("application/json")
    return (await resp.json())["error"]


# Where the consumer may not encode media itself (--no-consumer-encode; with it, see test_reuse.py).
async def test_encoder_transport_error_is_502_when_no_other_encoder(make_stack):
    stack = await make_stack(encoders=1, consumer_encode=False)
    stack.encoders[0].faults.fail_next(1, 0)  # drop the connection
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 502
        error = await error_of(resp)
    assert error["stage"] == "encode" and "Encoder request failed" in error["message"]
    assert stack.pd.requests == []


async def test_encoder_refusing_connections_is_502(make_stack):
    stack = await make_stack(encoders=1, consumer_encode=False)
    await stack.servers[0].close()
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 502
        assert (await error_of(resp))["backend"] == stack.backend_urls["e"][0]


@pytest.mark.parametrize("status", [400, 413, 503])
async def test_encoder_non_200_keeps_its_status_when_not_failed_over(make_stack, status):
    stack = await make_stack(encoders=1)
    stack.encoders[0].faults.fail_next(1, status)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == status
        assert "Encoder request failed" in (await error_of(resp))["message"]


async def test_encoder_5xx_fails_over_to_another_encoder(make_stack):
    stack = await make_stack(encoders=2)
    stack.encoders[0].faults.fail_next(1, 503)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
    assert len(stack.encoders[0].requests) == 1 and len(stack.encoders[1].requests) == 1
    first, second = stack.encoders[0].requests[0], stack.encoders[1].requests[0]
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


async def test_encoder_4xx_is_not_failed_over(make_stack):
    stack = await make_stack(encoders=2)
    stack.encoders[0].faults.fail_next(1, 400)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 400
    assert stack.encoders[1].requests == []


async def test_one_failed_group_cancels_the_others(make_stack):
    stack = await make_stack(encoders=2, encoder_failovers=0)
    stack.encoders[0].faults.fail_next(1, 400)
    stack.encoders[1].faults.delay_s = 5
    async with asyncio.timeout(3):
        async with await stack.chat(chat(image("A"), image("B"))) as resp:
            assert resp.status == 400
    await eventually(lambda: stack.encoders[1].cancelled == 1, what="the slow group is cancelled")


async def test_hanging_encoder_times_out_with_504_naming_the_stage(make_stack):
    stack = await make_stack(encoders=1, encode_timeout_s=0.2, consumer_encode=False)
    stack.encoders[0].faults.delay_s = 30
    async with asyncio.timeout(5):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 504
            error = await error_of(resp)
    assert error["stage"] == "encode" and "timed out" in error["message"]


async def test_hanging_decode_times_out_with_504(make_stack):
    stack = await make_stack(encoders=1, decode_timeout_s=0.2)
    stack.pd.faults.delay_s = 30
    async with asyncio.timeout(5):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 504
            assert (await error_of(resp))["stage"] == "decode"


async def test_decode_500_is_retried_then_reported(make_stack):
    stack = await make_stack(encoders=1, decode_retries=2)
    stack.pd.faults.fail_next(5)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 500
        assert resp.headers["x-epd-stage"] == "decode"
        assert (await resp.json())["error"]["message"] == "injected failure"
    assert len(stack.pd.requests) == 3 and len(stack.encoder_requests()) == 3


async def test_decode_4xx_is_not_retried(make_stack):
    stack = await make_stack(encoders=1, decode_retries=3)
    stack.pd.faults.fail_next(1, 400)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 400
    assert len(stack.pd.requests) == 1


async def test_decode_unreachable_is_502(make_stack):
    stack = await make_stack(encoders=1)
    await stack.servers[1].close()
    async with await stack.chat(chat()) as resp:
        assert resp.status == 502
        assert (await error_of(resp))["stage"] == "decode"


async def test_encoder_answering_non_json_leaves_media_raw(make_stack):
    stack = await make_stack(encoders=1)
    stack.encoders[0].faults.fail_next(1, 200)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
    part = stack.pd.requests[0].body["messages"][0]["content"][1]
    assert part["type"] == "image_url" and stack.pd.encoded_locally == 1


async def test_hanging_prefill_times_out_with_504(make_stack):
    stack = await make_stack(encoders=1, prefills=1, prefill_timeout_s=0.2)
    stack.prefills[0].faults.delay_s = 30
    async with asyncio.timeout(5):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 504
            error = await error_of(resp)
    assert error["stage"] == "prefill" and "timed out" in error["message"]
    assert stack.pd.requests == []


async def test_connections_per_backend_are_capped(make_stack):
    stack = await make_stack(encoders=1, max_connections_per_backend=1)
    stack.pd.faults.delay_s = 0.1
    responses = await asyncio.gather(*(stack.chat(chat()) for _ in range(4)))
    assert [r.status for r in responses] == [200] * 4
    for r in responses:
        r.release()
    assert stack.pd.max_active == 1
