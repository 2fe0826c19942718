"""Conversations through /v1/responses and /v1/messages against the fakes: as on the chat path
(tests/http/test_reuse.py), every turn goes to its conversation's PD and only each turn's new
image reaches an encoder, whether the turn's image comes in a user message or in a tool's
output, and every answer equals what one consumer answers to the client's own request."""

from __future__ import annotations

import orjson
import pytest

from tests.http.test_agent_doors import essentials
from tests.media import agent_messages, agent_responses, data_url

TURNS = 3
CONVERSATIONS = 3


def turn_body(api: str, conv: int, n: int, tools: bool) -> dict:
    build = agent_responses if api == "responses" else agent_messages
    return build(*(f"c{conv}-t{k}" for k in range(n + 1)), tools=tools)


async def answer_of(stack, url: str, api: str, body: dict):
    async with stack.client.post(f"{url}/v1/{api}", json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    return essentials(api, orjson.loads(raw))


def total(fakes, counter: str) -> int:
    return sum(sum(getattr(fake.counts, counter).values()) for fake in fakes)


@pytest.mark.parametrize("tools", [False, True], ids=["user-images", "tool-images"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_each_turn_goes_to_its_conversations_pd_and_only_the_new_image_is_encoded(make_stack, api, tools):
    stack = await make_stack(encoders=2, decoders=2)
    alone = await make_stack(encoders=1, decoders=1, reuse=False)
    for conv in range(CONVERSATIONS):
        for n in range(TURNS):
            body = turn_body(api, conv, n, tools)
            assert await answer_of(stack, stack.url, api, body) == await answer_of(alone, alone.pd_url, api, body)
        # Every turn of the conversation went to one PD: its first image is in each body one got.
        first = data_url(f"c{conv}-t0").split(",", 1)[1]
        served = sorted(
            sum(first in orjson.dumps(seen.body).decode() for seen in pd.requests) for pd in stack.consumers
        )
        assert served == [0, TURNS], (conv, served)
    # One image per turn reached an encoder, the floor; the history went raw to its PD, which
    # found it in its prefix cache under the name the encoder gave it.
    assert total(stack.encoders, "images") == CONVERSATIONS * TURNS
    assert total(stack.consumers, "prefix_items") == CONVERSATIONS * sum(range(TURNS))
    assert all(pd.encoded_locally == 0 for pd in stack.consumers)
    assert total(stack.consumers, "ec_loads") == CONVERSATIONS * TURNS
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        assert f"epd_items_reused_total {float(CONVERSATIONS * sum(range(TURNS)))}" in await resp.text()


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_in_epd_the_prefill_follows_the_conversation(make_stack, api):
    stack = await make_stack(encoders=1, prefills=2, decoders=2)
    alone = await make_stack(encoders=1, decoders=1, reuse=False)
    for n in range(TURNS):
        body = turn_body(api, 0, n, True)
        assert await answer_of(stack, stack.url, api, body) == await answer_of(alone, alone.pd_url, api, body)
    assert sorted(sum(p.counts.requests.values()) for p in stack.prefills) == [0, TURNS]
    assert total(stack.prefills, "prefix_items") == sum(range(TURNS))
    assert total(stack.encoders, "images") == TURNS


@pytest.mark.parametrize(("api", "preamble"), [("responses", "instructions"), ("messages", "system")])
async def test_the_system_prompt_is_part_of_the_opening(make_stack, api, preamble):
    """Agents that open with the same screenshot under different system prompts share no prefix,
    so they are different conversations, spread over the PDs; a per-request billing header, which
    vLLM drops from an Anthropic system prompt, does not split one conversation."""
    stack = await make_stack(encoders=1, decoders=2)
    build = agent_responses if api == "responses" else agent_messages
    # A conversation's home is a point on a ring of the PDs' URLs, whose ports differ per run: 8
    # homes all fell on one PD about once in 128 runs (seen once in the suite), 16 once in 32,768.
    agents = 16
    for agent in range(agents):
        for n in range(2):
            body = build(*("same", "next")[: n + 1], **{preamble: f"You are agent {agent}."})
            if api == "messages":
                billing = {"type": "text", "text": f"x-anthropic-billing-header: cch={agent}{n};"}
                body["system"] = [billing, {"type": "text", "text": body["system"]}]
            async with stack.client.post(f"{stack.url}/v1/{api}", json=body) as resp:
                assert resp.status == 200, await resp.text()
    served = [
        [
            sum(f"You are agent {agent}." in orjson.dumps(seen.body).decode() for seen in pd.requests)
            for pd in stack.consumers
        ]
        for agent in range(agents)
    ]
    assert all(sorted(counts) == [0, 2] for counts in served), served
    assert all(sum(column) for column in zip(*served)), served
