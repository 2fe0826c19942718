"""Health against fake backends: checks on their own connections, ejection (transport and 5xx) and
its limits, revival, bounded metrics, and a /health that never probes on the caller's behalf."""

from __future__ import annotations

import asyncio

import pytest

from epd_proxy_tools.testing.polling import eventually, get_json
from tests.media import chat, image

KEY = {"X-API-Key": "sekrit"}


async def views(stack) -> dict:
    _, body = await get_json(stack.client, stack.url + "/health")
    return body["instances"]


async def test_without_checks_an_ejected_encoder_gets_traffic_again_after_the_ejection_time(make_stack):
    stack = await make_stack(
        encoders=2, probe_interval_s=0, fail_threshold=1, ejection_time_s=0.5, encode_policy="round_robin"
    )
    e1 = stack.backend_urls["e"][1]
    stack.encoders[1].faults.fail_next(1, 0)
    for n in range(2):  # round robin: one of the two lands on encoder 1, drops, fails over
        async with await stack.chat(chat(image(f"A{n}"))) as resp:
            assert resp.status == 200
    assert (await views(stack))[e1]["ejections"] == 1
    await eventually(lambda: _in_rotation(stack, e1), what="half-open after the ejection time")
    served = len(stack.encoders[1].requests)
    for n in range(2):  # images of their own: one the fleet holds would skip the encoders
        async with await stack.chat(chat(image(f"B{n}"))) as resp:
            assert resp.status == 200
    assert len(stack.encoders[1].requests) == served + 1
    view = (await views(stack))[e1]
    assert view["state"] == "healthy" and view["ejections"] == 1


async def _in_rotation(stack, url):
    return (await views(stack))[url]["in_rotation"]


async def test_an_encoder_answering_500_to_every_call_leaves_the_rotation_and_everyone_says_why(make_stack):
    # Checks run and pass throughout: the broken encoder's GET /health still answers 200.
    stack = await make_stack(encoders=2, probe_interval_s=0.05, ejection_time_s=600)
    broken, e1 = stack.encoders[1], stack.backend_urls["e"][1]
    broken.faults.fail_next(10_000, 500, "CUDA error: an illegal memory access was encountered")
    for i in range(20):  # round robin: every other sub-request lands on the broken one and fails over
        async with await stack.chat(chat(image(f"X{i}"))) as resp:
            assert resp.status == 200
        if not (await views(stack))[e1]["in_rotation"]:
            break
    assert len(broken.requests) == 5, "ejected at Envoy's default of five 5xx in a row"
    view = (await views(stack))[e1]
    assert view["state"] == "ejected" and view["ejection_reason"] == "5xx" and view["ejections"] == 1
    assert (
        view["last_problem"].startswith("HTTP 500: Encoder request failed") and "illegal memory" in view["last_problem"]
    )
    checks = broken.health_checks
    await eventually(lambda: broken.health_checks >= checks + 3, what="three passing checks of the broken encoder")
    for i in range(4):
        async with await stack.chat(chat(image(f"Y{i}"))) as resp:
            assert resp.status == 200
    assert len(broken.requests) == 5, "out of rotation: passing checks do not bring it back"
    _, status = await get_json(stack.client, stack.url + "/status.json")
    row = next(row for row in status["roster"] if row["url"] == e1)
    assert row["state"] == "ejected" and row["ejection_reason"] == "5xx"
    async with stack.client.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    assert f'epd_ejections_total{{instance="{e1}",reason="5xx",role="encode"}} 1.0' in text


async def test_an_encoder_whose_answers_break_a_limit_is_ejected_as_a_gateway_failure(make_stack):
    """An answer the proxy refuses (here 2 MB where an encoder's answer is a few hundred bytes per
    item) is what a gateway would turn into a 502: it counts as one, and is counted by reason."""
    stack = await make_stack(encoders=2, probe_interval_s=0, ejection_time_s=600)
    broken, e1 = stack.encoders[1], stack.backend_urls["e"][1]
    broken.faults.fail_next(10_000, 200, "x" * (2 << 20))
    for i in range(20):
        async with await stack.chat(chat(image(f"G{i}"))) as resp:
            assert resp.status == 200
        if not (await views(stack))[e1]["in_rotation"]:
            break
    assert len(broken.requests) == 5
    view = (await views(stack))[e1]
    assert view["ejection_reason"] == "gateway" and "answer refused" in view["last_problem"]
    async with stack.client.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    assert 'epd_backend_answers_refused_total{reason="body_too_large",stage="encode"} 5.0' in text


@pytest.mark.parametrize("status", [500, 400])
async def test_a_single_500_or_any_number_of_400s_leaves_an_encoder_in_rotation(make_stack, status):
    stack = await make_stack(encoders=2, probe_interval_s=0, encode_policy="round_robin")
    flaky, e1 = stack.encoders[1], stack.backend_urls["e"][1]
    flaky.faults.fail_next(1 if status == 500 else 10, status)
    answered = []
    for i in range(12):
        async with await stack.chat(chat(image(f"Z{i}"))) as resp:
            answered.append(resp.status)
    # A 500 fails over to the other encoder; a 400 is the client's and reaches it as it was.
    assert answered == [200] * 12 if status == 500 else sorted(set(answered)) == [200, 400]
    assert len(flaky.requests) == 6, "it kept its share of the round robin"
    view = (await views(stack))[e1]
    assert view["state"] == "healthy" and view["ejections"] == 0 and view["ejection_reason"] is None
    assert view["consecutive_5xx"] == 0, "its next success ended the run"


async def test_a_request_retried_on_500_counts_once_against_its_decoder(make_stack):
    stack = await make_stack(encoders=1, decoders=2, decode_retries=5, probe_interval_s=0)
    for fake in stack.consumers:
        fake.faults.fail_next(6)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 500
    assert sorted(len(fake.requests) for fake in stack.consumers) == [0, 6], "every attempt on the routed decoder"
    decoders = [(await views(stack))[url] for url in stack.backend_urls["d"]]
    assert all(view["in_rotation"] and view["ejections"] == 0 for view in decoders)
    assert sorted(view["consecutive_5xx"] for view in decoders) == [0, 1]


async def test_checks_are_answered_while_the_request_pool_is_saturated_by_a_slow_stream(make_stack):
    stack = await make_stack(
        encoders=1, max_connections_per_backend=1, probe_interval_s=0.05, probe_timeout_s=0.3, fail_threshold=1
    )
    stack.pd.tokens_per_chunk = 1
    stack.pd.stream_pause_s = 0.05  # the whole answer would take tens of seconds
    resp = await stack.chat(chat(image("A"), stream=True))
    try:
        assert resp.status == 200
        await resp.content.read(20)
        seen = stack.pd.health_checks
        await eventually(lambda: stack.pd.health_checks >= seen + 5, what="five checks answered during the stream")
        assert stack.pd.active == 1, "the stream is still holding the only pooled connection"
        for view in (await views(stack)).values():
            assert view["in_rotation"] and view["consecutive_failures"] == 0 and view["last_check"] == "ok"
    finally:
        resp.close()
    await eventually(lambda: stack.pd.active == 0, what="stream closed")
    async with await stack.chat(chat()) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("stage", ["decode", "prefill"])
async def test_a_long_generation_does_not_eject_its_instance(make_stack, stage):
    # The same body four times is one conversation; by load, it spreads over both instances.
    by_load = {"decode_policy": "least_loaded", "prefill_policy": "least_loaded"}
    if stage == "decode":
        stack = await make_stack(
            encoders=1, decoders=2, decode_timeout_s=0.2, fail_threshold=1, probe_interval_s=0, **by_load
        )
        slow, urls = stack.consumers, stack.backend_urls["d"]
    else:
        stack = await make_stack(
            encoders=1, prefills=2, prefill_timeout_s=0.2, fail_threshold=1, probe_interval_s=0, **by_load
        )
        slow, urls = stack.prefills, stack.backend_urls["p"]
    for fake in slow:
        fake.faults.delay_s = 2
    for _ in range(4):
        async with await stack.chat(chat()) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["stage"] == stage
    assert all(len(fake.requests) == 2 for fake in slow), "both instances were tried"
    for url in urls:
        view = (await views(stack))[url]
        assert view["in_rotation"] and view["ejections"] == 0 and view["consecutive_failures"] == 0
    for fake in slow:
        fake.faults.delay_s = 0
    async with await stack.chat(chat()) as resp:
        assert resp.status == 200


async def test_max_ejection_percent_holds_with_four_encoders_and_three_failing(make_stack):
    stack = await make_stack(encoders=4, probe_interval_s=0, fail_threshold=1, encoder_failovers=3)
    for fake in stack.encoders[1:]:
        fake.faults.fail_next(1000, 0)
    for i in range(8):
        async with await stack.chat(chat(image(f"I{i}"))) as resp:
            assert resp.status == 200
    states = [(await views(stack))[url]["state"] for url in stack.backend_urls["e"]]
    assert states[0] == "healthy"
    assert sorted(states[1:]) == ["ejected", "ejected", "healthy"], states
    async with stack.client.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    up = [line for line in text.splitlines() if line.startswith("epd_instance_up{") and 'role="encode"' in line]
    assert sorted(line.rsplit(" ", 1)[1] for line in up) == ["0.0", "0.0", "1.0", "1.0"]


async def test_active_checks_alone_may_take_every_encoder_out_in_dynamic_mode(dynamic_fleet):
    client, add = await dynamic_fleet(probe_interval_s=0.05, fail_threshold=1, consumer_encode=False)
    await add("prefill_decode")
    encoder, e_url = await add("encode")
    encoder.healthy = False
    await eventually(lambda: _roster_has(client, "encode", "evicted", e_url), what="the only encoder is down")
    async with client.post("/v1/chat/completions", json=chat(image("A"))) as resp:
        assert resp.status == 503
    encoder.healthy = True
    await eventually(lambda: _roster_has(client, "encode", "live", e_url), what="a passing check brings it back")


async def _roster_has(client, role, column, url):
    _, roster = await get_json(client, "/instances")
    return url in roster[role][column]


async def test_re_registration_revives_an_ejected_instance(dynamic_fleet):
    client, add = await dynamic_fleet(probe_interval_s=0, fail_threshold=1, ejection_time_s=600)
    await add("prefill_decode")
    await add("encode")
    broken, url = await add("encode")
    broken.faults.fail_next(1, 0)
    for i in range(2):
        async with client.post("/v1/chat/completions", json=chat(image(f"R{i}"))) as resp:
            assert resp.status == 200
    assert await _roster_has(client, "encode", "evicted", url)
    async with client.post("/instances", json={"role": "encode", "url": url}, headers=KEY) as resp:
        assert await resp.json() == {"registered": False}
    assert await _roster_has(client, "encode", "live", url)
    served = len(broken.requests)
    for i in range(2):
        async with client.post("/v1/chat/completions", json=chat(image(f"S{i}"))) as resp:
            assert resp.status == 200
    assert len(broken.requests) == served + 1


async def test_metric_series_of_a_removed_instance_disappear(dynamic_fleet):
    client, add = await dynamic_fleet()
    await add("prefill_decode")
    await add("encode")
    flaky, url = await add("encode")
    flaky.faults.fail_next(1, 503)
    for i in range(2):
        async with client.post("/v1/chat/completions", json=chat(image(f"M{i}"))) as resp:
            assert resp.status == 200
    async with client.get("/metrics") as resp:
        text = await resp.text()
    assert f'epd_encoder_failovers_total{{from_encoder="{url}"}} 1.0' in text
    assert f'epd_encoder_subrequests_total{{encoder="{url}"}}' in text
    assert f'epd_instance_up{{instance="{url}",role="encode"}}' in text
    async with client.delete("/instances", params={"url": url}, headers=KEY) as resp:
        assert await resp.json() == {"removed": True}
    async with client.get("/metrics") as resp:
        text = await resp.text()
    assert url not in text


async def test_concurrent_health_calls_cause_no_probe_traffic(make_stack):
    stack = await make_stack(encoders=2, probe_interval_s=3600)
    fakes = stack.encoders + stack.consumers
    await eventually(lambda: all(f.health_checks == 1 for f in fakes), what="the first check round")

    async def one():
        async with stack.client.get(stack.url + "/health") as resp:
            return resp.status

    assert await asyncio.gather(*(one() for _ in range(100))) == [200] * 100
    assert [f.health_checks for f in fakes] == [1, 1, 1]
    _, body = await get_json(stack.client, stack.url + "/health")
    assert all(view["last_check"] == "ok" and view["last_check_age_s"] >= 0 for view in body["instances"].values())


async def test_behind_a_client_key_health_names_no_backend_but_keeps_its_verdict(make_stack):
    stack = await make_stack(
        encoders=2, api_key="client-secret", admin_api_key=KEY["X-API-Key"], probe_interval_s=0.05, fail_threshold=1
    )
    urls = [*stack.backend_urls["e"], *stack.backend_urls["d"]]
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert not any(url in text for url in urls) and "127.0.0.1" not in text
    assert await resp.json() == {
        "proxy": "healthy",
        "encode_cluster": "healthy",
        "prefill_cluster": "empty",
        "decode_cluster": "healthy",
        "roles": {"encode": {"members": 2, "in_rotation": 2}, "prefill_decode": {"members": 1, "in_rotation": 1}},
    }
    # An admin sees the instances; a wrong key is no admin.
    _, full = await get_json_with(stack, "/health", KEY)
    assert set(full["instances"]) == set(urls)
    _, wrong = await get_json_with(stack, "/health", {"X-API-Key": "guess"})
    assert "instances" not in wrong
    stack.consumers[0].healthy = False

    async def decode_down():
        async with stack.client.get(stack.url + "/health") as resp:
            return resp.status == 503 and (await resp.json())["decode_cluster"] == "unhealthy"

    await eventually(decode_down, what="/health says 503 once the decoder is down, still naming no one")


async def test_behind_a_client_key_dynamic_health_names_no_backend(make_stack):
    stack = await make_stack(dynamic=True, api_key="client-secret")
    _, url = await stack.join("prefill_decode")
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 200 and url not in await resp.text()
        assert (await resp.json())["roles"] == {"prefill_decode": {"members": 1, "in_rotation": 1}}
    _, full = await get_json_with(stack, "/health", KEY)
    assert full["instances"]["prefill_decode"]["live"] == [url]


async def get_json_with(stack, path: str, headers: dict):
    async with stack.client.get(stack.url + path, headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def dynamic_fleet(make_stack):
    async def build(**overrides):
        stack = await make_stack(dynamic=True, **overrides)
        return stack.client, stack.join

    return build
