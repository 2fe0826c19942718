"""Dynamic registration, health-driven rotation, metrics, admission control, cancellation, logs."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from epd_proxy_tools.testing.polling import eventually, get_json
from tests.media import chat, image

KEY = {"X-API-Key": "sekrit"}


@pytest.fixture
async def dynamic_proxy(make_stack):
    stack = await make_stack(dynamic=True)
    return stack.client, stack.fakes.start


async def test_dynamic_fleet_starts_empty_and_routes_once_registered(dynamic_proxy):
    client, start_fake = dynamic_proxy
    async with client.post("/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 503
    async with client.post("/instances", json={"role": "encode", "url": "http://x"}) as resp:
        assert resp.status == 403
    async with client.post(
        "/instances", json={"role": "encode", "url": "http://x"}, headers={"X-API-Key": "wrong"}
    ) as resp:
        assert resp.status == 403
    pd, pd_url = await start_fake("pd")
    async with client.post("/instances", json={"role": "prefill_decode", "url": pd_url}, headers=KEY) as resp:
        assert resp.status == 200 and await resp.json() == {"registered": True}
    async with client.post("/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200, "text routes without encoders"
    async with client.post("/v1/chat/completions", json=chat(image("A"))) as resp:
        assert resp.status == 200, "without encoders the PD encodes the media itself"
    assert pd.encoded_locally == 1
    encoder, e_url = await start_fake("encode")
    async with client.post("/instances", json={"role": "encode", "url": e_url}, headers=KEY) as resp:
        assert resp.status == 200
    # Another image: the PD holds A since it encoded it, and gets it raw again.
    async with client.post("/v1/chat/completions", json=chat(image("B"))) as resp:
        assert resp.status == 200
    assert len(encoder.requests) == 1 and pd.loaded_from_cache == 1
    async with client.get("/instances") as resp:
        roster = await resp.json()
    assert roster["encode"]["live"] == [e_url] and roster["prefill_decode"]["live"] == [pd_url]
    async with client.post("/instances", json={"role": "decode", "url": "http://d"}, headers=KEY) as resp:
        assert resp.status == 409
    async with client.delete("/instances", params={"url": e_url}, headers=KEY) as resp:
        assert await resp.json() == {"removed": True}
    async with client.get("/health") as resp:
        assert resp.status == 200 and (await resp.json())["instances"]["encode"]["live"] == []


async def test_dynamic_split_decode_needs_a_prefill(dynamic_proxy):
    client, start_fake = dynamic_proxy
    _, d_url = await start_fake("decode")
    async with client.post("/instances", json={"role": "decode", "url": d_url}, headers=KEY) as resp:
        assert resp.status == 200
    async with client.post("/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 503 and "prefill" in (await resp.json())["error"]["message"]
    _, p_url = await start_fake("prefill")
    async with client.post("/instances", json={"role": "prefill", "url": p_url, "dp_size": 2}, headers=KEY) as resp:
        assert resp.status == 200
    async with client.post("/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200


async def in_rotation(stack, url, expected):
    _, body = await get_json(stack.client, stack.url + "/health")
    return body["instances"][url]["in_rotation"] is expected


async def test_probes_evict_a_failing_encoder_and_bring_it_back(make_stack):
    stack = await make_stack(encoders=2, probe_interval_s=0.05, fail_threshold=2, encode_policy="round_robin")
    e1 = stack.backend_urls["e"][1]
    stack.encoders[1].healthy = False
    await eventually(lambda: in_rotation(stack, e1, False), what="encoder 1 leaves the rotation")
    # Images of their own: one the fleet holds would skip the encoders.
    for n in range(4):
        async with await stack.chat(chat(image(f"A{n}"))) as resp:
            assert resp.status == 200
    assert len(stack.encoders[1].requests) == 0 and len(stack.encoders[0].requests) == 4
    async with stack.client.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    assert f'epd_instance_up{{instance="{e1}",role="encode"}} 0.0' in text
    stack.encoders[1].healthy = True
    await eventually(lambda: in_rotation(stack, e1, True), what="encoder 1 back in rotation")
    for n in range(4):
        async with await stack.chat(chat(image(f"B{n}"))) as resp:
            assert resp.status == 200
    assert len(stack.encoders[1].requests) == 2


async def test_live_transport_failures_evict_and_relayed_errors_do_not(make_stack):
    stack = await make_stack(
        encoders=2, probe_interval_s=0, fail_threshold=2, encoder_failovers=1, encode_policy="round_robin"
    )
    stack.encoders[1].faults.fail_next(2, 0)
    for n in range(4):
        async with await stack.chat(chat(image(f"A{n}"))) as resp:
            assert resp.status == 200  # each failure fails over to encoder 0
    async with stack.client.get(stack.url + "/health") as resp:
        body = await resp.json()
    assert body["instances"][stack.backend_urls["e"][1]]["in_rotation"] is False
    stack.pd.faults.fail_next(5, 400)
    for _ in range(3):
        async with await stack.chat(chat()) as resp:
            assert resp.status == 400
    async with stack.client.get(stack.url + "/health") as resp:
        body = await resp.json()
    assert body["instances"][stack.backend_urls["d"][0]]["in_rotation"] is True


async def test_metrics_show_stages_fan_out_and_failover(make_stack):
    stack = await make_stack(encoders=2)
    stack.encoders[0].faults.fail_next(1, 503)
    async with await stack.chat(chat(image("A"), image("B"), image("C"))) as resp:
        assert resp.status == 200
    async with stack.client.get(stack.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    e0 = stack.backend_urls["e"][0]
    assert 'epd_requests_total{status="200"} 1.0' in text
    assert f'epd_encoder_failovers_total{{from_encoder="{e0}"}} 1.0' in text
    assert "epd_encoder_items_per_subrequest_count 3.0" in text
    for stage in ("encode", "decode_ttfb", "total"):
        assert f'epd_stage_seconds_count{{stage="{stage}"}} 1.0' in text
    assert "epd_instance_inflight{instance=" in text


async def test_admission_control_answers_503_with_retry_after(make_stack):
    stack = await make_stack(encoders=1, max_inflight=2)
    stack.pd.faults.delay_s = 0.5
    slow = [asyncio.create_task(stack.client.post(stack.url + "/v1/chat/completions", json=chat())) for _ in range(2)]
    await eventually(lambda: stack.pd.active == 2, what="both slow requests reach decode")
    async with await stack.chat(chat()) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["type"] == "overloaded"
    for response in await asyncio.gather(*slow):
        assert response.status == 200
        response.release()
    async with stack.client.get(stack.url + "/metrics") as resp:
        assert "epd_admission_rejected_total 1.0" in await resp.text()


async def test_client_disconnect_cancels_backend_calls(make_stack):
    stack = await make_stack(encoders=2)
    for encoder in stack.encoders:
        encoder.faults.delay_s = 5
    client = aiohttp.ClientSession()
    task = asyncio.create_task(client.post(stack.url + "/v1/chat/completions", json=chat(image("A"), image("B"))))
    await eventually(lambda: sum(e.active for e in stack.encoders) == 2, what="both encoders busy")
    task.cancel()
    await client.close()
    await eventually(lambda: sum(e.cancelled for e in stack.encoders) == 2, what="both sub-requests cancelled")
    assert [e.cancelled for e in stack.encoders] == [1, 1]
    assert stack.pd.requests == []
    assert all(e.inflight == 0 for e in stack.state.fleet.all())


async def test_client_disconnect_mid_stream_cancels_decode(make_stack):
    stack = await make_stack(encoders=1)
    stack.pd.tokens_per_chunk = 1
    stack.pd.stream_pause_s = 0.05
    client = aiohttp.ClientSession()
    resp = await client.post(stack.url + "/v1/chat/completions", json=chat(image("A"), stream=True))
    assert resp.status == 200
    await resp.content.read(20)
    resp.close()
    await client.close()
    await eventually(lambda: stack.pd.cancelled, what="decode cancelled")
    assert stack.pd.cancelled == 1


async def test_request_log_line_in_json(make_stack, caplog):
    from epd_proxy.ops.logs import JsonFormatter

    stack = await make_stack(encoders=2)
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        async with await stack.chat(chat(image("A"), image("B")), headers={"x-request-id": "r-1"}) as resp:
            assert resp.status == 200
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "r-1" and line["status"] == 200 and line["encoder_requests"] == 2
    assert line["decode"] == stack.backend_urls["d"][0] and line["total_ms"] > 0
    assert "request_id=r-1" in record.getMessage()


async def failed_request_line(stack, fake, status: int, caplog) -> dict:
    """The request log's fields for a request that `fake` fails with `status` after 0.3 s."""
    fake.faults.delay_s = 0.3
    fake.faults.fail_next(1, status=status)
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == status
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    return record.fields


async def test_request_log_times_a_failed_encode_and_names_no_backend_it_never_reached(make_stack, caplog):
    stack = await make_stack(encoders=1, encoder_failovers=0, decode_retries=0)
    line = await failed_request_line(stack, stack.encoders[0], 503, caplog)
    assert line["encode_ms"] >= 300, line
    assert line["decode"] is None and line["prefill"] is None, line
    assert line["prefill_ms"] == 0 and line["decode_ttfb_ms"] == 0, line


async def test_request_log_times_a_failed_prefill_and_names_the_prefill_not_the_decoder(make_stack, caplog):
    stack = await make_stack(encoders=1, prefills=1, decode_retries=0)
    line = await failed_request_line(stack, stack.prefills[0], 400, caplog)
    assert line["prefill_ms"] >= 300, line
    assert line["prefill"] == stack.backend_urls["p"][0] and line["decode"] is None, line
