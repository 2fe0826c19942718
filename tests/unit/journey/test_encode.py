"""The encode step (encode.py) on its own, over scripted encoders: placement on live encoders only,
one answer per group in the plan's order, and which failures fail over to another encoder."""

from __future__ import annotations

import asyncio

import pytest

from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL
from epd_proxy.fleet.routing import LeastLoaded
from epd_proxy.fleet.scheduler import ExpectedFinish
from epd_proxy.journey.encode import request_priority
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.plan import plan_groups
from epd_proxy.journey.trace import Trace
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image
from tests.unit.journey.test_pipeline import E1, E2, Journey, failed_with
from tests.unit.scripted_upstream import json_reply


def encoded(*hashes: str):
    return json_reply({"ec_transfer_params": {"mm_hashes": list(hashes)}})


async def encode(journey: Journey, body: dict):
    items = normalise_request(body).items
    step = journey.pipeline.encode
    trace = Trace("req-1")
    groups = plan_groups(items, step.place(items, trace), step.options.max_batch_size)
    return groups, await step.run(body, items, groups, None, trace), trace


def test_placement_without_a_live_encoder_is_a_503_naming_the_route():
    journey = Journey(encode_urls=(E1,))
    (encoder,) = journey.fleet.members(ENCODE)
    for _ in range(journey.health.fail_threshold):
        journey.health.checked(encoder, "connection refused")
    with pytest.raises(ProxyError) as err:
        journey.pipeline.encode.place(normalise_request(chat(image("A"))).items, Trace("r"))
    assert (err.value.status, err.value.stage) == (503, "route")


async def test_each_group_gets_its_own_encoders_answer_in_the_plans_order():
    journey = Journey(encode_policy="round_robin")
    journey.script(E1, encoded("a"))
    journey.script(E2, encoded("b"))
    groups, answers, trace = await encode(journey, chat(image("A"), image("B")))
    assert [answer.encoder for answer in answers] == [group.encoder for group in groups]
    assert sorted(answer.ec_transfer_params["mm_hashes"][0] for answer in answers) == ["a", "b"]
    assert trace.encoder_requests == len(groups) == 2


async def test_a_5xx_fails_over_to_the_other_encoder_and_a_4xx_does_not():
    journey = Journey(encode_policy="round_robin", encode_urls=(E1, E2))
    journey.script(E1, failed_with(500))
    journey.script(E2, encoded("a"))
    _, [answer], trace = await encode(journey, chat(image("A")))
    assert answer.encoder.url == E2 and trace.encoder_failovers == 1

    refused = Journey(encode_policy="round_robin", encode_urls=(E1, E2))
    refused.script(E1, failed_with(400))
    with pytest.raises(ProxyError) as err:
        await encode(refused, chat(image("A")))
    assert err.value.status == 400
    assert [sent.url for sent in refused.upstream.sent] == [E1]


@pytest.mark.parametrize(("given", "waits_as"), [(None, 0), (3, 3), (-2, -2), ("1", 0), (True, 0), (1.5, 0)])
def test_a_groups_queue_priority_is_vllms_integer_priority_or_zero(given, waits_as):
    body = {} if given is None else {"priority": given}
    assert request_priority(body) == waits_as


DNS_NAME = "dns://enc.test:8000"
A, B = "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def held_at(upstream, url: str) -> asyncio.Event:
    """Calls to `url` wait until the returned event is set (an encoder still working on them)."""
    release = asyncio.Event()
    open_call = upstream.open

    async def gated(target, *args, **options):
        if target.url == url:
            await release.wait()
        return await open_call(target, *args, **options)

    upstream.open = gated
    return release


@pytest.mark.parametrize("first_answer", ["ok", "500"])
async def test_an_encoder_leaving_with_work_in_flight_and_queued_leaves_no_count_behind(first_answer):
    """Two sub-requests in flight on an encoder and a third group queued behind them; the encoder
    leaves the fleet, one request goes away, and the one left answers or fails: whatever became of
    them, no lane keeps a count that would make its encoder look busy (or never idle, so never
    stale) from then on, and the one that left keeps no lane."""
    policy = ExpectedFinish(affinity=False)
    journey = Journey({ENCODE: policy, PREFILL: LeastLoaded(), DECODE: LeastLoaded()}, encode_urls=(DNS_NAME,))
    journey.fleet.watch(policy.lanes)
    journey.fleet.discovered(DNS_NAME, ENCODE, [A])
    release = held_at(journey.upstream, A)
    journey.script(A, encoded("a1") if first_answer == "ok" else failed_with(500), encoded("a2"))
    journey.script(B, encoded("b1"), encoded("b2"))
    leaving = policy.lanes.of(journey.fleet.members(ENCODE)[0])
    requests = [asyncio.create_task(encode(journey, chat(image(name)))) for name in "xyz"]
    await eventually(
        lambda: (leaving.work.inflight, len(leaving.work.waiting)) == (2, 1), what="two in flight, one queued"
    )

    journey.fleet.discovered(DNS_NAME, ENCODE, [B])  # A leaves with notice, B joins
    requests[1].cancel()  # its client went away
    release.set()
    async with asyncio.timeout(10):
        first, gone, moved = await asyncio.gather(*requests, return_exceptions=True)
    assert isinstance(gone, asyncio.CancelledError)
    assert [answer.encoder.url for answer in first[1] + moved[1]] == [A if first_answer == "ok" else B, B]
    (staying,) = policy.lanes.all()
    assert staying.url == B and staying.speed.samples == (1 if first_answer == "ok" else 2)
    assert (
        staying.work.inflight,
        staying.work.inflight_load,
        staying.work.subs,
        staying.work.load,
        len(staying.work.waiting),
    ) == (0,) * 5
