"""Sharing an encoder never costs a request more than going alone (issue 30): hand-driven fake
encoders that answer late, refuse one image, report no positions, or leave the fleet while
groups wait to share a sub-request with theirs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from epd_proxy.fleet import lanes as lanes_module
from epd_proxy.fleet import stalls
from epd_proxy_tools.testing.fake_vllm import Costs
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_coalescing import answer_of, busy_encoder, lanes, queue_behind, shared_subrequests, uuids_of
from tests.media import chat, image


async def status_of(stack):
    async with stack.client.get(stack.url + "/status.json") as resp:
        return await resp.json()


async def metrics_of(stack):
    async with stack.client.get(stack.url + "/metrics") as resp:
        return await resp.text()


async def test_a_shared_sub_request_never_outgrows_the_encode_timeout_of_its_members(make_stack):
    # 0.25 s per image (sub-requests batched, as vLLM runs them), 2 s per encoder call: one image
    # alone fits eight times over, eight shared (over 2 s) would not. Twelve single-image
    # requests at once must all get 200.
    stack = await make_stack(
        encoders=1, encode_timeout_s=2.0, encoder_options={"costs": Costs(image_s=0.25, request_s=0.02, parallel=True)}
    )
    fake = stack.encoders[0]
    assert (await answer_of(stack, chat(image("warm"))))[0] == 200
    results = await asyncio.gather(*(answer_of(stack, chat(image(f"t{i}"))) for i in range(12)))
    assert [status for status, _ in results] == [200] * 12, results
    assert shared_subrequests(fake), "it still shares"
    per_item = lanes(stack).all()[0].speed.item_s
    # What a shared sub-request may hold: it takes at most a third of the timeout.
    assert all(len(uuids_of(sub)) * per_item <= 2.0 / 3 for sub in shared_subrequests(fake))


async def test_a_shared_sub_request_that_times_out_is_resent_alone_not_failed(make_stack):
    # The encoder stalls on exactly one call (the shared one): its members go alone and succeed,
    # although there is no other encoder to fail over to.
    stack = await make_stack(encoders=1, encode_timeout_s=1.0)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack)
    tasks = await queue_behind(stack, [chat(image(f"s{i}")) for i in range(3)])
    await eventually(lambda: len(fake.requests) >= 4, what="the shared sub-request sent")
    fake.faults.delay_s = 0.0
    results = await asyncio.gather(*tasks, *blockers)
    assert [status for status, _ in results[:3]] == [200] * 3, results


async def test_a_flood_of_bad_images_does_not_turn_sharing_off(make_stack):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    bad = image("undecodable")
    fake.faults.bad_media = bad["image_url"]["url"]
    for round_ in range(5):
        blockers = await busy_encoder(stack)
        bodies = [chat(image(f"g{round_}")), chat(image(f"b{round_}"), bad), chat(image(f"h{round_}"))]
        tasks = await queue_behind(stack, bodies)
        results = await asyncio.gather(*tasks, *blockers)
        assert [status for status, _ in results[:3]] == [200, 400, 200]
    # The split retry found the culprit each time: the requests were charged, not the encoder.
    (view,) = (await status_of(stack))["scheduler"]["encoders"]
    assert view["merge_limit"] == 8 and view["coalescing"] is True
    assert view["refusals_charged_to_requests"] == 5 and view["backoffs"] == 0
    shared_before = len(shared_subrequests(fake))
    blockers = await busy_encoder(stack)
    tasks = await queue_behind(stack, [chat(image(f"good{i}")) for i in range(4)])
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results)
    (shared,) = shared_subrequests(fake)[shared_before:]
    assert len(uuids_of(shared)) == 4
    text = await metrics_of(stack)
    url = stack.backend_urls["e"][0]
    assert f'epd_encoder_share_limit{{encoder="{url}"}} 8.0' in text
    assert f'epd_encoder_shared_refusals_total{{charged="request",encoder="{url}"}} 5.0' in text


async def test_after_an_encoder_that_reported_no_positions_recovers_sharing_grows_back(make_stack):
    stack = await make_stack(encoders=1, encoder_options={"report_indices": False})
    fake = stack.encoders[0]
    size = {"size": {"shortest_edge": 3136, "longest_edge": 1000000}}  # derived hashes: uuids do not help
    gate = asyncio.Event()
    blockers = await busy_encoder(stack, gate=gate)
    tasks = await queue_behind(stack, [chat(image(f"z{i}"), mm_processor_kwargs=size) for i in range(4)])
    gate.set()
    assert all(status == 200 for status, _ in await asyncio.gather(*tasks, *blockers))
    lane = lanes(stack).all()[0]
    # Nobody's fault but the encoder's (each went through alone): it shares less.
    assert (lane.share.backoffs, lane.share.merge_limit) == (1, 2)
    fake.report_indices = True
    # The blockers hold both slots until all eight are queued, however long a loaded machine
    # takes to send them (past the blockers' own hold, none would queue with the others).
    gate = asyncio.Event()
    blockers = await busy_encoder(stack, gate=gate)
    before = len(shared_subrequests(fake))
    tasks = await queue_behind(stack, [chat(image(f"y{i}"), mm_processor_kwargs=size) for i in range(8)])
    gate.set()
    assert all(status == 200 for status, _ in await asyncio.gather(*tasks, *blockers))
    sizes = [len(uuids_of(sub)) for sub in shared_subrequests(fake)[before:]]
    # Probes of two (both slots free at once) that split, then twice that: it grows back by itself.
    assert sizes == [2, 2, 4], sizes
    assert lane.share.merge_limit == 8


async def test_lower_priority_values_leave_the_queue_first(make_stack):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack)
    late = [chat(image(f"p10-{i}"), priority=10) for i in range(4)]
    tasks = await queue_behind(stack, late)
    tasks += await queue_behind(stack, [chat(image("urgent"), priority=0)], already=4)
    sent = len(fake.requests)
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results)
    # The first sub-request from the queue is the urgent one, alone (different priorities never
    # share), then the others together.
    first = fake.requests[sent]
    assert first.body["priority"] == 0 and len(uuids_of(first)) == 1
    assert all(sub.body["priority"] == 10 for sub in fake.requests[sent + 1 :])


async def test_a_shared_sub_request_has_its_own_id_and_its_log_line_names_the_members(make_stack, caplog):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack)
    ids = [f"tenant-{i}" for i in range(3)]
    caplog.set_level(logging.INFO, logger="epd_proxy.encode")
    caplog.set_level(logging.INFO, logger="epd_proxy.request")

    async def send(request_id):
        async with await stack.chat(chat(image(request_id)), headers={"x-request-id": request_id}) as resp:
            return resp.status

    tasks = [asyncio.create_task(send(rid)) for rid in ids]
    lane = lanes(stack).all()[0]
    await eventually(lambda: len(lane.work.waiting) == 3, what="queued")
    inflight = await eventually(lambda: dict(lane.share.shared), what="the shared sub-request in flight")
    ((shared_id, members),) = inflight.items()
    assert members == ids
    view = (await status_of(stack))["scheduler"]["encoders"][0]
    assert view["shared_inflight"] == {shared_id: ids}
    assert await asyncio.gather(*tasks) == [200] * 3
    await asyncio.gather(*blockers)
    (shared,) = shared_subrequests(fake)
    assert shared.headers["x-request-id"] == shared_id
    assert not any(rid in shared_id for rid in ids), "no client's id labels the others' work"
    messages = [r.getMessage() for r in caplog.records]
    (line,) = [m for m in messages if m.startswith(f"shared encoder sub-request {shared_id}")]
    assert line.endswith(" ".join(ids))
    for rid in ids:
        (access,) = [m for m in messages if m.startswith(f"request_id={rid} ")]
        assert f"shared={shared_id}" in access


async def first_encoder_warmed(stack, proxy, *, delay_s, rounds):
    """The first encoder and its lane, once every encoder's speed is known (requests two at a
    time: placement spreads them), so queued groups wait for seconds, not a cold start's floor."""
    encoder = next(e for e in proxy.fleet.members("encode") if e.url == stack.backend_urls["e"][0])
    for fake in stack.encoders:
        fake.faults.delay_s = delay_s
    for i in range(rounds):
        answers = await asyncio.gather(*(answer_of(stack, chat(image(f"w{i}{j}"))) for j in "ab"))
        assert [status for status, _ in answers] == [200, 200]
    return encoder, proxy.lanes.of(encoder)


@pytest.mark.parametrize("how", ["left", "ejected"])
async def test_groups_queued_for_an_encoder_that_goes_move_at_once(make_stack, how, monkeypatch):
    # Its stuck calls move at the overdue floor, well before a health check could bring it back.
    monkeypatch.setattr(stalls, "OVERDUE_FLOOR_S", 1.0)
    stack = await make_stack(encoders=2, max_ejection_percent=50)
    gone, other = stack.encoders
    proxy = stack.state
    encoder, lane = await first_encoder_warmed(stack, proxy, delay_s=0.3, rounds=3)
    # Its two slots held, and groups waiting behind them (the other encoder is busy too).
    gone.faults.delay_s = other.faults.delay_s = 3.0
    sent_there = len(gone.requests) + 2
    stuck = [asyncio.create_task(answer_of(stack, chat(image(f"k{i}")))) for i in range(8)]
    await eventually(lambda: lane.work.waiting and lane.work.inflight == 2, what="groups queued on the encoder")
    await eventually(lambda: len(gone.requests) == sent_there, what="its two calls arrived")
    other.faults.delay_s = 0.0
    if how == "left":
        proxy.fleet._remove(encoder.url)
    else:
        # Its calls in flight will drop (an answer would bring it back into rotation at once).
        gone.faults.fail_next(times=100, status=0)
        while proxy.health.in_rotation(encoder):
            proxy.health.failed(encoder, "test: refused")
    await eventually(lambda: not lane.work.waiting, timeout=0.5, what="its queue emptied at once")
    results = await asyncio.gather(*stuck)
    assert all(status == 200 for status, _ in results), results
    assert len(gone.requests) == sent_there, "nothing new started on it after it went"


async def test_a_stalled_encoder_turns_suspect_its_work_moves_and_it_comes_back(make_stack, monkeypatch):
    monkeypatch.setattr(lanes_module, "SUSPECT_HOLD_S", 0.5)
    # The floor is sized for real CPU engines; the mechanism is the same at 1 s.
    monkeypatch.setattr(stalls, "OVERDUE_FLOOR_S", 1.0)
    stack = await make_stack(encoders=2, encode_timeout_s=30.0)
    stuck, healthy = stack.encoders
    proxy = stack.state
    encoder, lane = await first_encoder_warmed(stack, proxy, delay_s=0.05, rounds=4)
    assert len(stuck.requests) >= 2
    stuck.faults.delay_s = 60.0  # accepts, never answers within the test; /health stays 200
    healthy.faults.delay_s = 0.0
    before = len(stuck.requests)
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(answer_of(stack, chat(image(f"s{i}"))) for i in range(8)))
    elapsed = asyncio.get_running_loop().time() - started
    assert all(status == 200 for status, _ in results), results
    # Far within the encode timeout: the stuck work moved after the overdue floor (1 s).
    assert len(stuck.requests) > before and elapsed < 5.0, elapsed
    assert lane.suspicion.suspect
    text = await metrics_of(stack)
    assert f'epd_encoder_suspect{{encoder="{encoder.url}"}} 1.0' in text
    # Back after its hold: offered work again, and trusted again once it answers.
    stuck.faults.delay_s = 0.0

    probes = iter(range(1000))

    async def trusted_again():
        assert (await answer_of(stack, chat(image(f"probe{next(probes)}"))))[0] == 200
        return not lane.suspicion.suspect

    await eventually(
        trusted_again, timeout=10, what=lambda: f"trusted again: {[lane.view() for lane in proxy.lanes.all()]}"
    )
