"""/health, /v1/models, profiling, and bad input."""

from __future__ import annotations

import pytest

from epd_proxy_tools.testing.polling import eventually, get_json
from tests.media import chat, image


async def test_health_reports_each_stage_from_the_latest_checks(make_stack):
    stack = await make_stack(encoders=2, prefills=1, probe_interval_s=0.05, fail_threshold=1)
    status, body = await get_json(stack.client, stack.url + "/health")
    assert status == 200 and body["proxy"] == "healthy"
    assert (body["encode_cluster"], body["prefill_cluster"], body["decode_cluster"]) == ("healthy",) * 3
    stack.encoders[0].healthy = False
    status, body = await eventually(
        lambda: _health_where(stack, lambda body: body["encode_cluster"] == "degraded"), what="encoder 0 down"
    )
    assert status == 200
    stack.encoders[1].healthy = False
    status, body = await eventually(
        lambda: _health_where(stack, lambda body: body["encode_cluster"] == "unhealthy"), what="both down"
    )
    assert status == 503 and body["decode_cluster"] == "healthy"
    view = body["instances"][stack.backend_urls["e"][1]]
    assert view["state"] == "down" and view["last_check"] == "HTTP 503" and view["last_check_age_s"] < 5


async def _health_where(stack, predicate):
    status, body = await get_json(stack.client, stack.url + "/health")
    return (status, body) if predicate(body) else None


async def test_health_in_e_pd_reports_empty_prefill_and_dead_decode(make_stack):
    stack = await make_stack(encoders=1, probe_interval_s=0.05, fail_threshold=1)
    await stack.servers[1].close()
    status, body = await eventually(
        lambda: _health_where(stack, lambda body: body["decode_cluster"] == "unhealthy"), what="decode down"
    )
    assert status == 503 and body["prefill_cluster"] == "empty"


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
