"""The official openai client talks to the proxy as it would to vLLM."""

from __future__ import annotations

import openai
import pytest

from epd_proxy_tools.testing.fake_vllm import ANSWER_SUFFIX
from tests.media import image


def client_for(stack):
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, image("A"), image("B"), image("A")]}]


async def test_non_streaming_completion(make_stack):
    stack = await make_stack(encoders=2)
    async with client_for(stack) as client:
        completion = await client.chat.completions.create(model="tiny-vlm", messages=MESSAGES, max_tokens=8)
    assert completion.choices[0].message.content.endswith(ANSWER_SUFFIX)
    assert completion.usage.prompt_tokens == 13
    assert len(stack.encoder_requests()) == 2


async def test_streaming_completion(make_stack):
    stack = await make_stack(encoders=2)
    async with client_for(stack) as client:
        stream = await client.chat.completions.create(model="tiny-vlm", messages=MESSAGES, max_tokens=8, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text.startswith("answer-") and text.endswith(ANSWER_SUFFIX)


async def test_errors_surface_as_openai_exceptions(make_stack):
    stack = await make_stack(encoders=1)
    stack.encoders[0].faults.fail_next(1, 400)
    async with client_for(stack) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="tiny-vlm", messages=MESSAGES, stream=True)
    assert "Encoder request failed" in str(err.value)
    async with client_for(stack) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-vlm"]
