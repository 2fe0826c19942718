"""A Responses or Messages stream that breaks after its 200, read by the official SDKs: each ends in
the door's own in-band error, which the SDK reports, never a message cut short in silence."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest
from openai.types.responses import ResponseFailedEvent

from epd_proxy_tools.testing.polling import eventually
from tests.http.test_agent_doors import messages_body, responses_body

# How the decode stream breaks halfway, after generated events went out: cut, or silent past the
# idle timeout. The SDK shares the test's event loop and its first parse of a type can hold the
# loop for a while, so the idle timeout is only short where a stall is the point.
BREAKS = {"cut": ("cut_streams", 300.0), "stall": ("stall_streams", 2.0)}


async def broken_stack(make_stack, breaks: str):
    fault, idle_timeout = BREAKS[breaks]
    stack = await make_stack(encoders=1, stream_idle_timeout_s=idle_timeout)
    setattr(stack.pd.faults, fault, 1)
    return stack


def request_of(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "stream"}


async def freed(stack) -> None:
    state = stack.state
    await eventually(lambda: state.admission.inflight == 0 and all(i.inflight == 0 for i in state.fleet.all()))


@pytest.mark.parametrize("breaks", BREAKS)
async def test_a_broken_messages_stream_raises_in_the_anthropic_sdk(make_stack, breaks):
    stack = await broken_stack(make_stack, breaks)
    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="unused", max_retries=0)
    text = []
    async with asyncio.timeout(20), client:
        stream = await client.messages.create(**request_of(messages_body("A")), stream=True)
        with pytest.raises(anthropic.APIStatusError) as err:
            async for event in stream:
                if event.type == "content_block_delta":
                    text.append(event.delta.text)
    assert "".join(text).startswith("answer-")  # generated text went out before the break
    error = err.value.body["error"]
    assert err.value.body["type"] == "error" and error["type"] == "upstream_error"
    assert error["message"].startswith("Decode request")
    await freed(stack)


async def test_the_anthropic_stream_helper_raises_rather_than_return_a_cut_message(make_stack):
    stack = await broken_stack(make_stack, "cut")
    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="unused", max_retries=0)
    async with asyncio.timeout(20), client:
        with pytest.raises(anthropic.APIStatusError):
            async with client.messages.stream(**request_of(messages_body("A"))) as stream:
                await stream.get_final_message()


@pytest.mark.parametrize("breaks", BREAKS)
async def test_a_broken_responses_stream_ends_in_response_failed(make_stack, breaks):
    stack = await broken_stack(make_stack, breaks)
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    async with asyncio.timeout(20), client:
        stream = await client.responses.create(**request_of(responses_body("A")), stream=True)
        events = [event async for event in stream]
    created, failed = events[0], events[-1]
    assert isinstance(failed, ResponseFailedEvent), failed
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").startswith("answer-")
    # The failure continues the stream: the same response, the next sequence number.
    assert failed.response.id == created.response.id and failed.response.model == created.response.model
    assert failed.sequence_number == events[-2].sequence_number + 1
    assert failed.response.status == "failed" and failed.response.output == []
    assert failed.response.error.code == "server_error"
    assert failed.response.error.message.startswith("Decode request")
    await freed(stack)


async def test_the_openai_stream_helper_has_no_final_response_for_a_failed_stream(make_stack):
    stack = await broken_stack(make_stack, "cut")
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    async with asyncio.timeout(20), client:
        async with client.responses.stream(**request_of(responses_body("A"))) as stream:
            kinds = [event.type async for event in stream]
            with pytest.raises(RuntimeError, match="response.completed"):
                await stream.get_final_response()
    assert kinds[-1] == "response.failed" and "response.output_text.delta" in kinds
