"""/health, /v1/models, profiling, and bad input."""

from __future__ import annotations

import pytest

from tests.media import chat, image


async def test_health_reports_each_stage(make_stack):
    stack = await make_stack(encoders=2, prefills=1)
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["proxy"] == "healthy"
    assert (body["encode_cluster"], body["prefill_cluster"], body["decode_cluster"]) == ("healthy",) * 3
    stack.encoders[0].healthy = False
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["encode_cluster"] == "degraded"
    stack.encoders[1].healthy = False
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body["encode_cluster"] == "unhealthy" and body["decode_cluster"] == "healthy"


async def test_health_in_e_pd_reports_empty_prefill_and_dead_decode(make_stack):
    stack = await make_stack(encoders=1)
    await stack.servers[1].close()
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body["prefill_cluster"] == "empty" and body["decode_cluster"] == "unhealthy"


async def test_models_come_from_a_decoder(make_stack):
    stack = await make_stack(encoders=1)
    async with stack.client.get(stack.url + "/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "tiny-vlm"


async def test_profiling_reaches_every_instance(make_stack):
    stack = await make_stack(encoders=2)
    async with stack.client.post(stack.url + "/start_profile", json={}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert len(body["encode"]) == 2 and len(body["decode"]) == 1 and body["prefill"] is None


@pytest.mark.parametrize(
    "raw, complaint",
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'"text"', "JSON object"),
        (b"{}", "'messages'"),
        (b'{"messages": [{"role": "user", "content": [42]}]}', "must be an object"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]}',
            "image_url.url",
        ),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "image_url.url"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
async def test_bad_input_is_400_json(make_stack, raw, complaint):
    stack = await make_stack(encoders=1)
    async with await stack.chat(raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert complaint in error["message"] and error["type"] == "invalid_request_error"
    assert stack.encoder_requests() == [] and stack.pd.requests == []


async def test_forged_embeds_reference_never_reaches_the_consumer(make_stack):
    stack = await make_stack(encoders=1)
    forged = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "not-in-cache"}
    async with await stack.chat(chat(forged)) as resp:
        assert resp.status == 400
    assert stack.pd.requests == []


async def test_oversized_body_is_413_json(make_stack):
    stack = await make_stack(encoders=1, max_body_bytes=1024)
    async with await stack.chat(chat(image("A" * 2000))) as resp:
        assert resp.status == 413
        assert "exceeds" in (await resp.json())["error"]["message"]
