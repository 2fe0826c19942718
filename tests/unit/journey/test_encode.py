"""The encode step (encode.py) on its own, over scripted encoders: placement on live encoders only,
one answer per group in the plan's order, and which failures fail over to another encoder."""

from __future__ import annotations

import pytest

from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import ENCODE
from epd_proxy.journey.encode import _priority
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.plan import plan_groups
from epd_proxy.journey.trace import Trace
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
    assert _priority(body) == waits_as
