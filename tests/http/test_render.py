"""Placement from a rendered prompt (--render-urls) against fake PDs that publish vLLM's KV events
and a fake render server (fake_vllm.py, `scale_out`): a text-only conversation, which has no image
for the index to be asked about, is followed block by block to wherever it ran, by a proxy process
that never saw it; a render server that refuses costs nothing but the sharper placement."""

from __future__ import annotations

import pytest

from epd_proxy.fleet.backends import PREFILL_DECODE
from epd_proxy.fleet.routing import PrefixAffinity
from epd_proxy.journey.doors import CHAT, Door
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.responses_api import RESPONSES
from epd_proxy.journey.reuse import conversation_key
from epd_proxy_tools.testing.harness import Fakes
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_kv_reuse import OPTIONS, decisions, engines_fresh

PREAMBLE = "You are a careful assistant. " * 8


def text_turn(n: int, door: Door = CHAT) -> dict:
    """Turn n of a text-only conversation, in the door's own shape."""
    messages: list[dict] = []
    for k in range(n + 1):
        messages.append({"role": "user", "content": f"Question {k}: what follows {k * 7}?"})
        if k < n:
            messages.append({"role": "assistant", "content": f"The answer to {k} is {k * 7 + 1}."})
    if door is MESSAGES:
        return {"model": "tiny-vlm", "system": PREAMBLE, "messages": messages, "max_tokens": 4}
    if door is RESPONSES:
        return {"model": "tiny-vlm", "instructions": PREAMBLE, "input": messages, "max_output_tokens": 4}
    system = {"role": "system", "content": PREAMBLE}
    return {"model": "tiny-vlm", "messages": [system, *messages], "max_tokens": 4, "temperature": 0}


async def answered(stack, door: Door, body: dict) -> None:
    async with stack.client.post(door.path, json=body) as resp:
        assert resp.status == 200, await resp.text()


def renders(stack, outcome: str) -> float:
    return stack.state.metrics.registry.get_sample_value("epd_render_total", {"outcome": outcome}) or 0.0


async def another_proxy(make_stack, first, **options):
    """A proxy process of its own in front of `first`'s engines, once their KV events are fresh."""
    urls = first.backend_urls["d"]
    stack = await make_stack(
        encoders=0,
        decoders=0,
        fakes=first.fakes,
        encode_urls=tuple(first.backend_urls["e"]),
        decode_urls=tuple(urls),
        kv_events_stale_after_s=1.5,
        **options,
    )
    await eventually(lambda: engines_fresh(stack, urls), timeout=20, what="the PDs' KV events never fresh")
    return stack


@pytest.mark.parametrize("door", [CHAT, MESSAGES, RESPONSES], ids=lambda door: door.name)
async def test_a_text_conversation_is_followed_to_where_its_blocks_are_by_a_process_that_never_saw_it(make_stack, door):
    fakes = Fakes()
    render_fake, render_url = await fakes.start("pd", scale_out=True)
    first = await make_stack(
        encoders=1, decoders=2, fakes=fakes, consumer_options={"kv_events": OPTIONS}, kv_events_stale_after_s=1.5
    )
    urls = first.backend_urls["d"]
    pds = dict(zip(urls, first.consumers))

    rendering = await another_proxy(make_stack, first, render_urls=(render_url,))
    hashing = await another_proxy(make_stack, first)
    body = text_turn(1, door)
    key = conversation_key(body.get("model"), door.conversation(body), [])
    home = PrefixAffinity().choose(first.state.fleet.members(PREFILL_DECODE), [key])[0].url
    (other,) = [url for url in urls if url != home]
    # Turn 0 runs away from the key's home: its home is busy.
    busy = next(m for m in first.state.fleet.members(PREFILL_DECODE) if m.url == home)
    busy.prefill_queue = 1e6
    await answered(first, door, text_turn(0, door))
    busy.prefill_queue = 0.0
    assert len(pds[other].requests) == 1 and not pds[home].requests
    await eventually(
        lambda: (rendering.state.kv_index.size((other, 0)) or 0) > 0, timeout=20, what="turn 0's blocks never indexed"
    )

    # The rendering process finds turn 0's blocks on `other` and sends turn 1 there.
    await answered(rendering, door, text_turn(1, door))
    assert len(pds[other].requests) == 2 and not pds[home].requests
    assert decisions(rendering, "placement", "exact") == 1 and renders(rendering, "rendered") == 1
    assert render_fake.renders == 1
    # Without a render, a process that never saw the conversation has only the key's hash.
    await answered(hashing, door, text_turn(2, door))
    assert len(pds[home].requests) == 1
    assert decisions(hashing, "placement", "hash") == 1


async def test_a_render_server_that_refuses_leaves_the_request_placed_as_without_it(make_stack):
    fakes = Fakes()
    _, render_url = await fakes.start("pd")  # started without --enable-scale-out: 403
    stack = await make_stack(
        encoders=1, decoders=2, fakes=fakes, consumer_options={"kv_events": OPTIONS}, render_urls=(render_url,)
    )
    urls = stack.backend_urls["d"]
    await eventually(lambda: engines_fresh(stack, urls), timeout=20, what="the PDs' KV events never fresh")
    for turn in range(2):
        await answered(stack, CHAT, text_turn(turn))
    # The 403 is the server's: it is left alone for a while, and the next request is not held up.
    assert (renders(stack, "failed"), renders(stack, "skipped"), renders(stack, "rendered")) == (1, 1, 0)


async def test_a_lora_request_goes_where_its_adapters_blocks_are_not_where_the_base_models_are(make_stack):
    """vLLM keys an adapter's blocks by its name; render only echoes `model`. The render server's
    /v1/models says `ada` is an adapter, so its turn is named as its blocks are and followed to them,
    not to the PD holding the same prompt's blocks of the base model."""
    fakes = Fakes()
    lora = {"lora_modules": ("ada",)}
    _, render_url = await fakes.start("pd", scale_out=True, **lora)
    first = await make_stack(
        encoders=1,
        decoders=2,
        fakes=fakes,
        consumer_options={"kv_events": OPTIONS, **lora},
        kv_events_stale_after_s=1.5,
    )
    base_pd, lora_pd = urls = first.backend_urls["d"]
    pds = dict(zip(urls, first.consumers))
    members = {m.url: m for m in first.state.fleet.members(PREFILL_DECODE)}

    async def first_turn_on(url: str, body: dict) -> None:
        (away,) = [u for u in urls if u != url]
        members[away].prefill_queue = 1e6
        await answered(first, CHAT, body)
        members[away].prefill_queue = 0.0

    await first_turn_on(base_pd, text_turn(0))
    await first_turn_on(lora_pd, {**text_turn(0), "model": "ada"})
    assert [len(pds[url].requests) for url in urls] == [1, 1]
    rendering = await another_proxy(make_stack, first, render_urls=(render_url,))
    await eventually(
        lambda: all((rendering.state.kv_index.size((url, 0)) or 0) > 0 for url in urls),
        timeout=20,
        what="the first turns' blocks never indexed",
    )
    await answered(rendering, CHAT, {**text_turn(1), "model": "ada"})
    assert [len(pds[url].requests) for url in urls] == [1, 2]
    assert decisions(rendering, "placement", "exact") == 1 and renders(rendering, "rendered") == 1
    # The base model's next turn still goes where the base model's blocks are.
    await answered(rendering, CHAT, text_turn(1))
    assert [len(pds[url].requests) for url in urls] == [2, 2]
