"""Fair shares between tenants over HTTP (fleet/fairness.py): the encoder queue serves the
least-served tenant first, and a tenant over its share is the one turned away with 429 when the
fleet is past a deadline (docs/keys.md#fair-shares)."""

from __future__ import annotations

import asyncio
import hashlib
import time

import orjson
import pytest

from epd_proxy.fleet.fairness import CONTENDED_GROUP_ITEMS, CONTENTION_LINGER_S, OVER
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

SLOW_S = 0.5

TENANTS = f"""
[tenants.a]
key_sha256 = ["{hashlib.sha256(b"a-key").hexdigest()}"]

[tenants.b]
weight = 2
key_sha256 = ["{hashlib.sha256(b"b-key").hexdigest()}"]
"""


async def tenant_stack(make_stack, tmp_path, tenants: str = TENANTS):
    path = tmp_path / "tenants.toml"
    path.write_text(tenants)
    stack = await make_stack(encoders=1, tenants_file=str(path), consumer_encode=False)
    stack.encoders[0].faults.delay_s = SLOW_S
    return stack


async def answer(
    stack, tenant: str, name: str, deadline_ms: int | None = None, picture: str | None = None, shared_key: bool = False
):
    """One image request of `tenant`, its own coalescing key (a session id), so every group is a
    sub-request of its own and the order the encoder sees is the queue's (with `shared_key`, no
    session id: every such request's group may share a sub-request); its image is drawn from
    `picture`, by default its own `name`."""
    headers = {"Authorization": f"Bearer {tenant}-key", "x-request-id": name}
    if deadline_ms is not None:
        headers["x-request-deadline-ms"] = str(deadline_ms)
    body = chat(image(picture or name), **({} if shared_key else {"session_id": name}))
    async with await stack.chat(body, headers=headers) as resp:
        return resp.status, resp.headers.get("Retry-After"), orjson.loads(await resp.read())


def sent_order(stack) -> list[str]:
    """The requests the encoder received sub-requests of, in order."""
    return [seen.headers["x-request-id"].split(":")[0] for seen in stack.encoders[0].requests]


async def flood(stack, tenant: str, count: int, shared_key: bool = False) -> list[asyncio.Task]:
    """`count` requests of `tenant` at once: two go to the encoder, the rest wait in its lane."""
    tasks = [asyncio.create_task(answer(stack, tenant, f"{tenant}{n}", shared_key=shared_key)) for n in range(count)]
    lane = stack.state.lanes.all()[0]
    await eventually(lambda: len(lane.work.waiting) == count - 2, what=f"{count - 2} groups queued")
    return tasks


async def b_after_a_flood(stack) -> list[str]:
    """Tenant a floods eight image requests, then b sends one that queues behind a's six: every
    request answered, the order the encoder received the queued ones in (after the warm-up and
    the two sent at once)."""
    assert (await answer(stack, "a", "warm"))[0] == 200  # the encoder's speed, measured
    flooded = await flood(stack, "a", 8)
    lane = stack.state.lanes.all()[0]
    lone = asyncio.create_task(answer(stack, "b", "b0"))
    await eventually(lambda: len(lane.work.waiting) == 7, what="b's group queued behind a's six")
    results = await asyncio.gather(*flooded, lone)
    assert [status for status, _, _ in results] == [200] * 9
    return sent_order(stack)[3:]


async def test_a_tenants_request_queued_behind_anothers_flood_is_sent_before_the_floods_later_groups(
    make_stack, tmp_path
):
    stack = await tenant_stack(make_stack, tmp_path)
    order = await b_after_a_flood(stack)
    # b starts level with a (idle time banks nothing): at most one of a's queued groups goes
    # first, then b, whose counter is now below a's; FIFO would have sent it last.
    assert order.index("b0") <= 1, order
    assert sorted(order) == sorted([f"a{n}" for n in range(2, 8)] + ["b0"])
    metrics = await stack.metrics()
    assert 'epd_tenant_encoder_seconds_total{tenant="a"}' in metrics
    assert 'epd_tenant_encoder_seconds_total{tenant="b"}' in metrics
    # The fake's answers carry usage: each request's tokens are charged to its tenant.
    assert 'epd_tenant_tokens_total{kind="output",tenant="b"}' in metrics
    assert 'epd_tenant_tokens_total{kind="prompt",tenant="a"}' in metrics
    status = await stack.client.get(stack.url + "/status.json")
    tenants = (await status.json())["tenants"]
    assert set(tenants) == {"a", "b"} and tenants["b"]["weight"] == 2.0
    assert tenants["a"]["encoder_s"] > tenants["b"]["encoder_s"] > 0
    assert tenants["a"]["output_tokens"] > 0 and tenants["a"]["inflight"] == 0


async def test_a_request_waiting_for_anothers_encode_of_its_image_lifts_that_group_to_its_own_standing(
    make_stack, tmp_path
):
    stack = await tenant_stack(make_stack, tmp_path)
    assert (await answer(stack, "a", "warm"))[0] == 200
    flooded = await flood(stack, "a", 8)
    # b's image is the one a's last queued group carries: b waits for that encode instead of
    # sending the image again, and must not wait at a's place in the queue for it.
    joined = asyncio.create_task(answer(stack, "b", "b0", picture="a7"))
    await eventually(lambda: stack.state.pipeline.in_flight.waiting == 1, what="b waits for a7's encode")
    results = await asyncio.gather(*flooded, joined)
    assert [status for status, _, _ in results] == [200] * 9
    order = sent_order(stack)[3:]
    assert "b0" not in order, "b's image was encoded once, in a7's sub-request"
    assert order.index("a7") <= 1, order
    # The group went at b's standing, so b pays for the image it waited for: no free lift.
    assert stack.state.lanes.fairness.view(("b",))["b"]["encoder_s"] > 0


async def test_a_tenants_turn_at_the_encoder_carries_none_of_another_tenants_images(make_stack, tmp_path):
    stack = await tenant_stack(make_stack, tmp_path)
    assert (await answer(stack, "a", "warm"))[0] == 200
    lane = stack.state.lanes.all()[0]
    flooded = await flood(stack, "a", 8, shared_key=True)
    lone = asyncio.create_task(answer(stack, "b", "b0", shared_key=True))
    await eventually(lambda: len(lane.work.waiting) == 7, what="b's group queued behind a's six")
    assert [result[0] for result in await asyncio.gather(*flooded, lone)] == [200] * 9
    # b's image goes in a sub-request of its own, not beside one of a's; a's queued groups still
    # share sub-requests with each other, a quantum at a time.
    sent = {seen.headers["x-request-id"].split(":")[0]: images_in(seen.body) for seen in stack.encoders[0].requests}
    assert sent.get("b0") == 1, sent
    assert list(sent).index("b0") <= 4, "b's turn came at most one of a's queued sub-requests after a's two in flight"
    assert CONTENDED_GROUP_ITEMS in [n for name, n in sent.items() if name.startswith("shared-")], sent


async def sub_request_sizes(stack, tenant: str, name: str, images: int) -> list[int]:
    """The images in each sub-request one request `name` of `tenant` with `images` images made."""
    before = len(stack.encoders[0].requests)
    headers = {"Authorization": f"Bearer {tenant}-key"}
    body = chat(*(image(f"{name}-{n}") for n in range(images)))
    async with await stack.chat(body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    return [images_in(seen.body) for seen in stack.encoders[0].requests[before:]]


def images_in(body: dict) -> int:
    return sum(
        part.get("type") == "image_url"
        for message in body["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
    )


async def test_while_tenants_compete_a_sub_request_carries_a_quantum_so_another_tenant_waits_behind_little(
    make_stack, tmp_path
):
    stack = await tenant_stack(make_stack, tmp_path)
    stack.encoders[0].faults.delay_s = 0
    # Alone, a tenant's images bound for one encoder go in one sub-request.
    assert await sub_request_sizes(stack, "a", "alone", 5) == [5]
    # With b's request in flight, a's go a quantum at a time.
    stack.state.lanes.fairness.began("b", 2.0)
    sizes = await sub_request_sizes(stack, "a", "beside-b", 5)
    assert sum(sizes) == 5 and max(sizes) == CONTENDED_GROUP_ITEMS, sizes
    # b's request ended a moment ago: it may be pausing before its next, so a's still go a quantum
    # at a time; once b has been quiet CONTENTION_LINGER_S, a's go whole again.
    fairness = stack.state.lanes.fairness
    fairness.ended("b", time.perf_counter())
    sizes = await sub_request_sizes(stack, "a", "b-pausing", 5)
    assert sum(sizes) == 5 and max(sizes) == CONTENDED_GROUP_ITEMS, sizes
    fairness.began("b", 2.0)
    fairness.ended("b", time.perf_counter() - CONTENTION_LINGER_S)
    assert await sub_request_sizes(stack, "a", "alone-again", 6) == [6]


async def test_while_tenants_compete_an_encoder_runs_one_of_our_sub_requests_at_a_time(make_stack, tmp_path):
    stack = await tenant_stack(make_stack, tmp_path)
    encoder = stack.encoders[0]
    encoder.faults.delay_s = 0.2
    assert (await answer(stack, "a", "warm"))[0] == 200
    lane = stack.state.lanes.all()[0]
    # Alone, a tenant's groups go two at a time: the next is on the encoder as one ends.
    encoder.max_active = 0
    assert [status for status, _, _ in await asyncio.gather(*await flood(stack, "a", 4))] == [200] * 4
    assert encoder.max_active == 2
    # While b competes, one at a time: vLLM batches what it runs at once, and b's next image
    # would join a vision batch of two of a's sub-requests.
    fairness = stack.state.lanes.fairness
    fairness.began("b", 2.0)
    encoder.max_active = 0
    tasks = [asyncio.create_task(answer(stack, "a", f"c{n}")) for n in range(4)]
    await eventually(lambda: len(lane.work.waiting) == 3, what="three of a's groups queued behind one")
    assert [status for status, _, _ in await asyncio.gather(*tasks)] == [200] * 4
    assert encoder.max_active == 1
    fairness.ended("b", time.perf_counter())


async def text_answer(stack, tenant: str, name: str, deadline_ms: int | None = None, **fields) -> int:
    headers = {"Authorization": f"Bearer {tenant}-key", "x-request-id": name}
    if deadline_ms is not None:
        headers["x-request-deadline-ms"] = str(deadline_ms)
    async with await stack.chat(chat(stream=True, **fields), headers=headers) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("prefills", [0, 1], ids=["pd", "e+p+d"])
async def test_while_tenants_compete_the_pd_is_sent_a_window_of_prompts_and_the_least_served_tenant_goes_next(
    make_stack, tmp_path, prefills
):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    stack = await make_stack(encoders=1, prefills=prefills, tenants_file=str(path), consumer_window=1)
    # The consumer that prefills: the PD, or in E+P+D the prefill instance.
    prefilling = stack.prefills[0] if prefills else stack.pd
    prefilling.faults.delay_s = 0.3
    ledger = stack.state.lanes.fairness
    ledger.began("b", 2.0)  # a request of b's runs all along: the tenants compete
    ledger.began("a", 1.0)
    ledger.charge_tokens("a", 4000, 0)  # and a has been served more
    flooded = [asyncio.create_task(text_answer(stack, "a", f"a{n}")) for n in range(4)]
    windows = stack.state.pipeline.windows
    await eventually(lambda: windows.waiting() == 3, what="one of a's prompts on the PD, three waiting for it")
    lone = asyncio.create_task(text_answer(stack, "b", "b0"))
    await eventually(lambda: windows.waiting() == 4, what="b's prompt waiting too")
    assert await asyncio.gather(*flooded, lone) == [200] * 5
    order = [seen.headers["x-request-id"].split(":")[0] for seen in prefilling.requests]
    # First come, first served would have sent b's last.
    assert order[1] == "b0" and sorted(order) == ["a0", "a1", "a2", "a3", "b0"], order
    # Alone, a tenant is never held back: all four of a's at once.
    ledger.ended("b", time.perf_counter())
    prefilling.requests.clear()
    flooded = [asyncio.create_task(text_answer(stack, "a", f"alone{n}")) for n in range(4)]
    await eventually(lambda: len(prefilling.requests) == 4, what="all four of a's on the consumer at once")
    assert windows.waiting() == 0 and await asyncio.gather(*flooded) == [200] * 4
    ledger.ended("a", time.perf_counter())


async def test_a_request_that_would_wait_past_its_deadline_for_a_consumer_window_is_answered_at_once(
    make_stack, tmp_path
):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    stack = await make_stack(encoders=1, tenants_file=str(path), consumer_window=1)
    stack.pd.faults.delay_s = 0.5
    ledger = stack.state.lanes.fairness
    ledger.began("b", 2.0)
    assert await text_answer(stack, "a", "warm") == 200  # a place's hold, measured: about 0.5 s
    ledger.charge_tokens("a", 4000, 0)
    flooded = [asyncio.create_task(text_answer(stack, "a", f"a{n}")) for n in range(3)]
    windows = stack.state.pipeline.windows
    await eventually(lambda: windows.waiting() == 2, what="one of a's on the PD, two waiting")
    # Three places' holds before a's next one can start: far past its 0.6 s, it is answered at once.
    assert await text_answer(stack, "a", "late", deadline_ms=600) == 503
    # b's goes before a's waiting ones: one hold, within its deadline.
    assert await text_answer(stack, "b", "b0", deadline_ms=800) == 200
    assert await asyncio.gather(*flooded) == [200] * 3
    ledger.ended("b", time.perf_counter())
    assert "late" not in [seen.headers["x-request-id"].split(":")[0] for seen in stack.pd.requests]
    metrics = await stack.metrics()
    assert 'epd_requests_shed_total{reason="deadline",tenant="a"} 1.0' in metrics
    assert not [
        line for line in metrics.splitlines() if line.startswith("epd_requests_shed_total") and 'tenant="b"' in line
    ]


async def a_floods_while_b_is_active(make_stack, tmp_path):
    """A request of b's runs all along (on the consumer, say), so b is active and has used no
    encoder; a warms the encoder's speed up, then floods eight requests (six queued)."""
    stack = await tenant_stack(make_stack, tmp_path)
    stack.state.lanes.fairness.began("b", 2.0)
    for n in range(3):
        assert (await answer(stack, "a", f"warm{n}"))[0] == 200
    return stack, await flood(stack, "a", 8)


async def test_past_its_deadline_the_tenant_over_its_share_gets_the_429_and_the_other_is_served(make_stack, tmp_path):
    stack, flooded = await a_floods_while_b_is_active(make_stack, tmp_path)
    ledger = stack.state.lanes.fairness
    await eventually(lambda: ledger.share("a") == OVER, what="a over its share")
    # The fleet is past a 1 s deadline: a's request is the one turned away, with 429.
    status, retry_after, body = await answer(stack, "a", "late", deadline_ms=1000)
    assert status == 429, body
    assert body["error"]["type"] == "rate_limit_error" and int(retry_after) >= 2
    # b's media go ahead of a's queued groups, so b fits a deadline the whole backlog would not.
    status, _, body = await answer(stack, "b", "b0", deadline_ms=3500)
    assert status == 200, body
    assert [result[0] for result in await asyncio.gather(*flooded)] == [200] * 8
    order = sent_order(stack)
    assert order.index("b0") < order.index("a7"), order
    ledger.ended("b", time.perf_counter())
    metrics = await stack.metrics()
    assert 'epd_requests_shed_total{reason="share",tenant="a"} 1.0' in metrics
    assert 'reason="deadline"' not in metrics


async def test_a_tenant_served_a_little_less_puts_only_that_little_of_its_queue_ahead_of_anothers_deadline(
    make_stack, tmp_path
):
    stack, flooded = await a_floods_while_b_is_active(make_stack, tmp_path)
    ledger = stack.state.lanes.fairness
    # b has been served a little more than a: a's next two groups go first (each raises a's count
    # by about SLOW_S), then b's, then a's other four. Counting a's whole queue ahead of b would
    # predict b past its deadline and turn it away.
    ledger.charge_encoder("b", 2.0 * (ledger.rank("a") - ledger.rank("b") + 0.7))
    status, _, body = await answer(stack, "b", "b0", deadline_ms=2800)
    assert status == 200, body
    assert [result[0] for result in await asyncio.gather(*flooded)] == [200] * 8
    order = sent_order(stack)
    assert order.index("b0") < order.index("a5"), order
    ledger.ended("b", time.perf_counter())
    assert "epd_requests_shed_total{" not in await stack.metrics()


async def test_an_isolated_tenants_flood_waits_its_turn_too_and_shares_with_no_one(make_stack, tmp_path):
    # Isolation keeps a tenant's media out of others' sub-requests, not out of the queue: sent at
    # once, its flood would take the encoder from everyone.
    isolated = TENANTS.replace("[tenants.a]\n", '[tenants.a]\nisolated = true\nsalt = "' + "s" * 40 + '"\n')
    stack = await tenant_stack(make_stack, tmp_path, isolated)
    order = await b_after_a_flood(stack)
    assert order.index("b0") <= 1, order
    assert not [seen for seen in stack.encoders[0].requests if seen.headers["x-request-id"].startswith("shared-")]


CLASS_TENANTS = f"""
[tenants.a]
key_sha256 = ["{hashlib.sha256(b"a-key").hexdigest()}"]
priority = [0, 0]

[tenants.b]
key_sha256 = ["{hashlib.sha256(b"b-key").hexdigest()}"]
priority = [-1, -1]
"""


async def test_a_class_prompt_goes_to_the_pd_past_a_full_window(make_stack, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(CLASS_TENANTS)
    stack = await make_stack(encoders=1, tenants_file=str(path), consumer_window=1)
    stack.pd.faults.gate = gate = asyncio.Event()
    ledger = stack.state.lanes.fairness
    ledger.began("b", 1.0)  # a request of b's runs all along: the tenants compete
    # a asks for the class's priority, which its grant does not reach: it is held like any of a's.
    flooded = [asyncio.create_task(text_answer(stack, "a", f"a{n}", priority=-5)) for n in range(2)]
    windows = stack.state.pipeline.windows

    def on_pd() -> list[str]:
        return [seen.headers["x-request-id"].split(":")[0] for seen in stack.pd.requests]

    await eventually(lambda: windows.waiting() == 1 and len(on_pd()) == 1, what="one of a's on the PD, one waiting")
    # b's priority class is not held for a place: vLLM's priority scheduling runs it first.
    lone = asyncio.create_task(text_answer(stack, "b", "b0"))
    await eventually(lambda: "b0" in on_pd(), what="b's prompt on the PD while a's waits for the window")
    assert windows.waiting() == 1 and windows.of(stack.pd_url).open == 1, "b took no place"
    assert stack.pd.requests[-1].body["priority"] == -1, "its tenant's grant, as vLLM is sent it"
    gate.set()
    assert await asyncio.gather(*flooded, lone) == [200] * 3
    ledger.ended("b", time.perf_counter())
