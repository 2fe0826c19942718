"""Consumers that took none of a request hand it on to the next instance placement chooses:

- one whose admission control refused it (vLLM's `--max-num-queued-reqs` or
  `--max-num-queued-tokens`: 503 "Service Unavailable" before its engine sees the request). The
  refusal is load, not ill health; any other 503 is the backend's answer, passed on as before;
- one that answered having generated no token: vLLM aborted the request before its engine ran it
  (`POST /pause`, a shutdown), in every API's shape;
- one whose JSON answer vLLM aborted partway, where the API says so (chat, Messages): the client
  has nothing of it yet."""

from __future__ import annotations

import re

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


DOORS = {
    "chat": ("/v1/chat/completions", lambda name, stream: chat(image(name), stream=stream)),
    "messages": ("/v1/messages", lambda name, stream: messages_body(name, stream=stream)),
    "responses": ("/v1/responses", lambda name, stream: responses_body(name, stream=stream)),
}


# An answer of no token (any door, either form), and a JSON answer aborted partway where the door
# tells it (chat, Messages).
ABORTED = [
    *((door, stream, "aborts") for door in DOORS for stream in (False, True)),
    ("chat", False, "late_aborts"),
    ("messages", False, "late_aborts"),
]


@pytest.mark.parametrize(("door", "stream", "fault"), ABORTED)
async def test_an_answer_vllm_aborted_goes_to_another_pd(make_stack, door, stream, fault):
    path, body = DOORS[door]
    stack = await make_stack(encoders=1, decoders=2, decode_policy="round_robin")
    aborting, other = stack.consumers
    setattr(aborting.faults, fault, 1)
    async with stack.client.post(path, json=body("A", stream)) as resp:
        assert resp.status == 200
        got = await resp.read()
    assert (len(aborting.requests), len(other.requests)) == (1, 1)
    # The whole answer, as the next request (which the fault spares) gets it.
    async with stack.client.post(path, json=body("A", stream)) as resp:
        again = await resp.read()
    assert _unnumbered(got) == _unnumbered(again)
    _, health = await get_json(stack.client, stack.url + "/health")
    assert health["instances"][stack.backend_urls["d"][0]]["state"] == "healthy"


@pytest.mark.parametrize(("fault", "tried"), [("aborts", 3), ("late_aborts", 2)])
async def test_an_answer_aborted_before_generating_tries_every_pd_and_one_cut_partway_moves_once(
    make_stack, fault, tried
):
    """Under vLLM's fault tolerance an engine failure aborts what the engine runs: a request cut
    partway may be the cause, and is not carried across the fleet."""
    stack = await make_stack(encoders=1, decoders=3, decode_policy="round_robin")
    for fake in stack.consumers:
        setattr(fake.faults, fault, 1)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert sum(len(fake.requests) for fake in stack.consumers) == tried


def _unnumbered(raw: bytes) -> bytes:
    """An answer less what differs between two answers of one text: its ids and times."""
    return re.sub(rb'chatcmpl-\d+|"created(?:_at)?":\d+', b"", raw)


async def test_a_responses_answer_aborted_partway_is_relayed_as_vllm_tells_nothing_of_it(make_stack):
    path, body = DOORS["responses"]
    stack = await make_stack(encoders=1, decoders=2, decode_policy="round_robin")
    aborting, other = stack.consumers
    aborting.faults.late_aborts = 1
    async with stack.client.post(path, json=body("A", False)) as resp:
        answer = orjson.loads(await resp.read())
    assert (len(aborting.requests), len(other.requests)) == (1, 0)
    assert answer["status"] == "completed" and answer["usage"]["output_tokens"] > 0


@pytest.mark.parametrize(("fault", "nothing"), [("aborts", True), ("late_aborts", False)])
async def test_with_no_other_pd_the_aborted_answer_is_relayed_as_vllm_wrote_it(make_stack, fault, nothing):
    stack = await make_stack(encoders=1, decoders=1)
    setattr(stack.pd.faults, fault, 1)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert (answer["usage"]["completion_tokens"] == 0) is nothing


async def test_with_no_other_pd_a_stream_of_no_token_is_relayed_as_vllm_wrote_it(make_stack):
    stack = await make_stack(encoders=1, decoders=1)
    stack.pd.faults.aborts = 1
    async with await stack.chat(chat(image("A"), stream=True)) as resp:
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


# What refuses a budget of no token, and its words: vLLM's SamplingParams on chat and Responses;
# on Messages vLLM's request model, which the proxy's door applies before any backend.
REFUSED_BUDGET = {
    "chat": ("max_completion_tokens", "max_tokens must be at least 1", [0, 1]),
    "responses": ("max_output_tokens", "max_tokens must be at least 1", [0, 1]),
    "messages": ("max_tokens", "max_tokens must be positive", [0, 0]),
}


@pytest.mark.parametrize("door", DOORS)
async def test_no_client_value_makes_every_pd_answer_nothing(make_stack, door):
    """A budget of no token is the only way a client could ask for an answer of no token, and it
    is refused (400) on every door before anything runs: no PD after the first is tried."""
    path, body = DOORS[door]
    budget, words, tried = REFUSED_BUDGET[door]
    stack = await make_stack(encoders=1, decoders=2)
    async with stack.client.post(path, json={**body("Z", False), budget: 0}) as resp:
        assert resp.status == 400
        assert words in await resp.text()
    assert sorted(len(fake.requests) for fake in stack.consumers) == tried
