"""GET /status and /status.json over fake backends (the rendered page is tested in tests/browser)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from epd_proxy_tools.testing.polling import eventually
from tests.http.test_coalescing import SLOW_S, busy_encoder, queue_behind
from tests.media import chat, image


async def status_json(stack) -> dict:
    async with stack.client.get(f"{stack.url}/status.json") as resp:
        assert resp.status == 200
        assert resp.headers["Cache-Control"] == "no-store"
        return await resp.json()


async def poll(stack, predicate, timeout_s: float = 20.0) -> dict:
    """The first /status.json snapshot that satisfies `predicate`."""
    last: list[dict] = []

    async def matched() -> dict | None:
        last[:] = [await status_json(stack)]
        return last[0] if predicate(last[0]) else None

    return await eventually(
        matched, timeout=timeout_s, interval=0.05, what=lambda: f"status never matched; last: {last[0]}"
    )


async def test_status_json_reports_roster_window_and_totals(make_stack):
    stack = await make_stack(encoders=2, prefills=1, decoders=1, encoder_max_batch_size=2)
    for n in range(6):
        async with await stack.chat(chat(image(f"a{n}"), image(f"b{n}"), image(f"c{n}"))) as resp:
            assert resp.status == 200
    async with await stack.chat(b"{not json") as resp:
        assert resp.status == 400
    snap = await status_json(stack)

    roster = snap["roster"]
    assert [(r["role"], r["state"]) for r in roster] == [
        ("encode", "in rotation"),
        ("encode", "in rotation"),
        ("prefill", "in rotation"),
        ("decode", "in rotation"),
    ]
    assert {r["url"] for r in roster} == {*stack.backend_urls["e"], *stack.backend_urls["p"], *stack.backend_urls["d"]}
    assert all(r["inflight"] == 0 for r in roster)

    window = snap["window"]
    assert window["requests"] == 7
    assert window["status"] == {"200": 6, "400": 1}
    assert window["rate_per_s"] > 0
    # Three images round-robin over two encoders, at most two per sub-request: 2 sub-requests.
    assert window["subrequests_per_request"] == 2.0
    assert window["images_per_subrequest"] == 1.5
    for stage in ("encode", "prefill", "decode_ttfb"):
        assert window["latency"][stage]["count"] == 6
        assert 0 < window["latency"][stage]["p50_ms"] <= window["latency"][stage]["p99_ms"]
    assert window["latency"]["total"]["count"] == 7

    totals = snap["totals"]
    assert totals["status"] == {"200": 6, "400": 1}
    assert sum(totals["encoder_subrequests"].values()) == 12
    assert totals["images_per_subrequest"] == 1.5
    assert snap["proxy"]["mode"] == "static" and snap["proxy"]["inflight"] == 0


async def test_a_stopped_instance_is_down_by_its_health_checks(make_stack):
    stack = await make_stack(encoders=2, probe_interval_s=0.1, fail_threshold=2)
    stopped = stack.backend_urls["e"][1]
    # Every instance shows its last check once the first round is in.
    await poll(stack, lambda s: all(r["last_probe"] == "ok" for r in s["roster"]))
    await stack.servers[1].close()
    snap = await poll(stack, lambda s: any(r["url"] == stopped and r["state"] == "down" for r in s["roster"]))
    row = next(r for r in snap["roster"] if r["url"] == stopped)
    assert row["consecutive_failures"] >= 2
    assert row["out_for_s"] >= 0 and row["back_in_s"] is None
    assert row["last_probe"] not in (None, "ok") and row["last_probe_age_s"] < 10
    others = [r for r in snap["roster"] if r["url"] != stopped]
    assert all(r["state"] == "in rotation" and r["last_probe"] == "ok" for r in others)


async def test_an_instance_failing_live_traffic_is_ejected_and_counted(make_stack):
    # No active checks: only requests can notice, and the ejection budget allows 2 of 4 encoders.
    stack = await make_stack(encoders=4, probe_interval_s=0, fail_threshold=1)
    stopped = stack.backend_urls["e"][0]
    await stack.servers[0].close()
    for n in range(4):
        async with await stack.chat(chat(*(image(f"{n}-{i}") for i in range(4)))) as resp:
            assert resp.status == 200  # failed over
    snap = await status_json(stack)
    row = next(r for r in snap["roster"] if r["url"] == stopped)
    assert row["state"] == "ejected" and row["ejections"] == 1
    assert row["back_in_s"] > 0 and row["last_probe"] is None
    assert snap["window"]["failovers"] >= 1


async def test_failovers_and_retries_are_counted(make_stack):
    stack = await make_stack(encoders=2, decode_retries=1)
    stack.encoders[0].faults.fail_next(1, status=503)
    stack.pd.faults.fail_next(1, status=500)
    async with await stack.chat(chat(image("x"))) as resp:
        assert resp.status == 200
    snap = await status_json(stack)
    assert snap["window"]["retries"] == 1 and snap["totals"]["retries"] == 1
    assert snap["window"]["failovers"] == 1 and snap["totals"]["failovers"] == 1


async def test_admission_rejections_show_in_the_status_mix(make_stack):
    stack = await make_stack(encoders=1, max_inflight=1)
    stack.encoders[0].faults.delay_s = 2
    first = asyncio.create_task(stack.chat(chat(image("slow"))))
    await poll(stack, lambda s: s["proxy"]["inflight"] == 1)
    async with await stack.chat(chat(image("refused"))) as resp:
        assert resp.status == 503
    async with await first as resp:
        assert resp.status == 200
    snap = await status_json(stack)
    assert snap["window"]["status"] == {"200": 1, "503": 1}
    assert snap["totals"]["status"] == {"200": 1, "503": 1}


async def test_status_page_is_self_contained_and_locked_down(make_stack):
    stack = await make_stack(encoders=1)
    async with stack.client.get(f"{stack.url}/status") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
        csp = resp.headers["Content-Security-Policy"]
        page = await resp.text()
    # Nothing is fetched from anywhere but the proxy itself: no src/href, no absolute URLs.
    assert not re.search(r"\b(src|href)\s*=", page)
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    assert 'fetch("status.json"' in page
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)
    assert "unsafe-inline" not in csp


@pytest.mark.parametrize("admin_api_key", ["admin-secret", ""])
async def test_behind_a_client_key_status_json_is_for_admins(make_stack, admin_api_key):
    stack = await make_stack(encoders=1, api_key="client-secret", admin_api_key=admin_api_key)
    async with stack.client.get(f"{stack.url}/v1/models") as resp:
        assert resp.status == 401
    for headers in ({}, {"X-API-Key": "guess"}, {"Authorization": "Bearer client-secret"}):
        async with stack.client.get(f"{stack.url}/status.json", headers=headers) as resp:
            assert resp.status == 403
            error = (await resp.json())["error"]
            assert error["type"] == "forbidden" and "read the fleet" in error["message"]
            assert stack.backend_urls["e"][0] not in await resp.text()
    async with stack.client.get(f"{stack.url}/status.json", headers={"X-API-Key": "admin-secret"}) as resp:
        assert resp.status == (200 if admin_api_key else 403)
        if admin_api_key:
            assert {row["url"] for row in (await resp.json())["roster"]} >= set(stack.backend_urls["e"])
    # The page holds no data, only the code that asks for it; Prometheus scrapes without a key.
    for path in ("/status", "/metrics"):
        async with stack.client.get(f"{stack.url}{path}") as resp:
            assert resp.status == 200, path


async def test_status_json_stays_open_without_a_client_key(make_stack):
    stack = await make_stack(encoders=1, admin_api_key="admin-secret")
    await status_json(stack)


async def test_a_stream_aborted_after_its_200_is_not_a_success(make_stack):
    stack = await make_stack(encoders=1)
    stack.pd.faults.cut_streams = 1
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 200
        await resp.read()
    snap = await status_json(stack)
    assert snap["window"]["status"] == {"aborted": 1}
    assert snap["totals"]["status"] == {"aborted": 1}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, (True, True, True)),
        ({"encoder_affinity": False, "coalesce": False}, (False, True, False)),
        ({"adaptive_fan_out": False, "encoder_max_batch_size": 1}, (True, False, False)),
        ({"encode_policy": "round_robin"}, (False, False, True)),
    ],
)
async def test_the_scheduler_section_says_which_parts_are_on(make_stack, overrides, expected):
    stack = await make_stack(encoders=2, **overrides)
    scheduler = (await status_json(stack))["scheduler"]
    assert (scheduler["affinity"], scheduler["adaptive_fan_out"], scheduler["coalescing"]) == expected
    assert scheduler["policy"] == overrides.get("encode_policy", "expected_finish")


async def test_the_slowest_requests_name_the_stage_they_waited_in(make_stack, caplog):
    # Queued behind a busy encoder's two slow sub-requests, and quick once sent, a request's time
    # goes to the proxy's queue: the request log and /status.json both say so.
    stack = await make_stack(encoders=1)
    blockers = await busy_encoder(stack)
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        (queued,) = await queue_behind(stack, [chat(image("queued"))])
        stack.encoders[0].faults.delay_s = 0.0
        results = await asyncio.gather(queued, *blockers)
    assert all(status == 200 for status, _ in results), results
    slowest = (await status_json(stack))["window"]["slowest"]
    (waited,) = [s for s in slowest if s["waited_in"] == "encode_queue"]
    assert waited["stages_ms"]["encode_queue"] >= SLOW_S * 1000 / 2
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_proxy.request"]
    (line,) = [line for line in lines if f"request_id={waited['request_id']} " in line]
    assert "waited_in=encode_queue" in line


async def test_a_queued_request_whose_own_sub_request_is_slow_names_the_encoders(make_stack):
    # The queue holds it until a blocker finishes (about SLOW_S); its own sub-request then takes
    # three times that. The time the encoder spent on it is the encoders', not the proxy's queue.
    stack = await make_stack(encoders=1)
    blockers = await busy_encoder(stack)
    (queued,) = await queue_behind(stack, [chat(image("slow-after-the-queue"))])
    stack.encoders[0].faults.delay_s = 3 * SLOW_S
    results = await asyncio.gather(queued, *blockers)
    assert all(status == 200 for status, _ in results), results
    slowest = (await status_json(stack))["window"]["slowest"]
    (mine,) = [s for s in slowest if s["stages_ms"]["encoders"] + s["stages_ms"]["encode_queue"] > 3 * SLOW_S * 1000]
    assert mine["waited_in"] == "encoders", mine
    assert mine["stages_ms"]["encode_queue"] < mine["stages_ms"]["encoders"], mine


async def test_each_consumers_row_says_how_it_receives_encoder_output_and_what_that_gives_it(make_stack):
    pushed = await make_stack(encoders=1, ec_consumer_zmq_addrs=("tcp://pd:1",))
    (pd,) = [r for r in (await status_json(pushed))["roster"] if r["role"] == "prefill_decode"]
    assert pd["transport"]["name"] == "mooncake push"
    assert pd["transport"]["reuse"] is False and pd["transport"]["consumer_encodes"] is False
    split = await make_stack(encoders=1, prefills=1, decoders=1)
    by_role = {r["role"]: r["transport"] for r in (await status_json(split))["roster"]}
    assert by_role["prefill"]["name"] == "store" and by_role["prefill"]["reuse"] is True
    assert by_role["encode"] is None and by_role["decode"] is None
