"""E+PD through the proxy against fake vLLM servers."""

from __future__ import annotations

import orjson

from tests.media import chat, image


async def baseline_answer(stack, body):
    """What the consumer answers when it gets the raw request itself (no EPD)."""
    async with stack.client.post(f"{stack.pd_url}/v1/chat/completions", json=body) as resp:
        return await resp.json()


async def test_single_image_is_encoded_once_and_referenced(make_stack):
    stack = await make_stack(encoders=2)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    assert answer["choices"][0]["message"]["content"].startswith("answer-")
    assert len(stack.encoder_requests()) == 1
    forwarded = stack.pd.requests[0].body
    part = forwarded["messages"][0]["content"][1]
    assert part["type"] == "image_embeds"
    assert set(part) == {"type", "image_embeds", "uuid"}
    assert stack.pd.loaded_from_cache == 1 and stack.pd.encoded_locally == 0
