"""A consumer whose admission control refuses a request (vLLM's `--max-num-queued-reqs` or
`--max-num-queued-tokens`: 503 "Service Unavailable" before its engine sees the request) took none
of it: the request goes to the next instance placement chooses, and the refusal is load, not ill
health. Any other 503 is the backend's answer, passed on as before."""

from __future__ import annotations

import orjson
import pytest

from epd_proxy_tools.testing.fake_vllm import QUEUE_OVERFLOW
from epd_proxy_tools.testing.polling import get_json
from tests.http.test_agent_doors import messages_body, responses_body
from tests.media import chat, image


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pd_at_its_queue_limit_hands_the_request_to_another_and_stays_in_rotation(make_stack, stream):
    stack = await make_stack(encoders=1, decoders=2, decode_policy="round_robin")
    busy, free = stack.consumers
    busy.max_queued = 0
    # Round robin turns on for the move too, so every request meets the busy PD first: more
    # refusals in a row than eject an instance for gateway failures (5). Load is not ill health.
    for n in range(14):
        async with await stack.chat(chat(image(f"A{n}"), stream=stream)) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    assert len(busy.requests) == 14 and len(free.requests) == 14
    _, health = await get_json(stack.client, stack.url + "/health")
    view = health["instances"][stack.backend_urls["d"][0]]
    assert view["in_rotation"] and view["ejections"] == 0
    # A moved request is sent whole again: every answer found its media.
    assert free.generation_failures == []


async def test_every_pd_at_its_limit_answers_vllms_503_to_the_client(make_stack):
    stack = await make_stack(encoders=1, decoders=2)
    for fake in stack.consumers:
        fake.max_queued = 0
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 503
        assert (resp.headers["x-epd-stage"], resp.headers["Retry-After"]) == ("decode", "1")
        error = (await resp.json())["error"]
    assert (error["type"], error["message"]) == ("Service Unavailable", QUEUE_OVERFLOW)
    assert [len(fake.requests) for fake in stack.consumers] == [1, 1], "each tried once"


async def test_another_503_is_the_backends_answer_and_is_not_sent_elsewhere(make_stack):
    stack = await make_stack(encoders=1, decoders=2, decode_policy="round_robin")
    for fake in stack.consumers:
        fake.faults.fail_next(1, 503, "upstream connect error or disconnect/reset before headers")
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 503 and "Retry-After" not in resp.headers
    assert sorted(len(fake.requests) for fake in stack.consumers) == [0, 1]


async def test_a_prefill_at_its_limit_hands_the_request_to_another_prefill(make_stack):
    stack = await make_stack(encoders=1, prefills=2, decoders=1, prefill_policy="round_robin")
    busy, free = stack.prefills
    busy.max_queued = 0
    for n in range(4):
        async with await stack.chat(chat(image(f"P{n}"))) as resp:
            assert resp.status == 200, await resp.text()
    assert (len(busy.requests), len(free.requests), len(stack.pd.requests)) == (4, 4, 4)


@pytest.mark.parametrize(("path", "body"), [("/v1/messages", messages_body), ("/v1/responses", responses_body)])
async def test_the_agent_doors_move_a_refused_request_too_and_relay_the_last_refusal_in_their_shape(
    make_stack, path, body
):
    stack = await make_stack(encoders=1, decoders=2, decode_policy="round_robin")
    busy, free = stack.consumers
    busy.max_queued = 0
    for n in range(2):
        async with stack.client.post(path, json=body(f"D{n}")) as resp:
            assert resp.status == 200, await resp.text()
    assert (len(busy.requests), len(free.requests)) == (2, 2)
    free.max_queued = 0
    async with stack.client.post(path, json=body("E")) as resp:
        assert (resp.status, resp.headers["Retry-After"]) == (503, "1")
        answer = orjson.loads(await resp.read())
    error = answer["error"]
    assert (error["type"], error["message"]) == ("Service Unavailable", QUEUE_OVERFLOW)
    if path == "/v1/messages":
        assert answer["type"] == "error"
