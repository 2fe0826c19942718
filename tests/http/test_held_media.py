"""What the proxy takes the fleet to hold, through the proxy against fake vLLM servers: only media
it saw encoded or sent to a consumer go raw (never a history the client wrote), identical images
in flight at once are encoded once, an image the fleet encoded goes raw under its name for every
later request, and an E+P+D prefill counts as busy from the moment it is chosen."""

from __future__ import annotations

import asyncio

import orjson

from epd_proxy.journey.extract import normalise_request
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, conversation, image


def total(fakes, counter: str) -> int:
    return sum(sum(getattr(fake.counts, counter).values()) for fake in fakes)


async def answer(stack, body) -> tuple[int, str]:
    async with await stack.chat(body) as resp:
        return resp.status, await resp.text()


async def ok(stack, body) -> dict:
    status, text = await answer(stack, body)
    assert status == 200, text
    return orjson.loads(text)


def with_assistant_prefill(body: dict) -> dict:
    """The body continued from an assistant message of the client's own (vLLM's
    `continue_final_message`): every image lies before the last assistant message."""
    body["messages"].append({"role": "assistant", "content": "The pictures show"})
    return {**body, "continue_final_message": True, "add_generation_prompt": False}


async def test_a_history_the_proxy_never_saw_is_encoded_by_the_encoders(make_stack):
    stack = await make_stack(encoders=1, decoders=1)
    body = with_assistant_prefill(conversation([image("f0")], [image("f1")], [image("f2")]))
    await ok(stack, body)
    assert total(stack.encoders, "images") == 3
    assert stack.pd.encoded_locally == 0 and total(stack.consumers, "raw_images") == 0
    # The same request again: now the fleet holds all three, and nothing is encoded twice.
    await ok(stack, body)
    assert total(stack.encoders, "images") == 3 and stack.pd.encoded_locally == 0


async def test_a_client_uuid_never_makes_an_image_count_as_held(make_stack):
    stack = await make_stack(encoders=1, decoders=1)
    await ok(stack, chat(image("known")))
    known = normalise_request(chat(image("known"))).items[0].uuid
    forged = {**image("other"), "uuid": known}
    await ok(stack, with_assistant_prefill(conversation([forged], [image("new")])))
    assert total(stack.encoders, "images") == 3
    assert stack.pd.encoded_locally == 0


async def test_an_image_the_fleet_encoded_goes_raw_under_its_name_in_another_conversation(make_stack):
    stack = await make_stack(encoders=2, decoders=1)
    await ok(stack, chat(image("manual"), text="summarise"))
    await ok(stack, chat(image("manual"), text="translate"))
    assert total(stack.encoders, "images") == 1
    # The second request's consumer loaded it from the EC store by name, outside its prefix.
    assert total(stack.consumers, "raw_images") == 1 and total(stack.consumers, "ec_loads") == 1
    assert stack.pd.encoded_locally == 0


async def both_at_once(stack, first: dict, second: dict) -> tuple:
    """`first` held by the gated encoders until `second` is in the proxy too; both answers."""
    gate = asyncio.Event()
    for encoder in stack.encoders:
        encoder.faults.gate = gate
    one = asyncio.create_task(answer(stack, first))
    await eventually(lambda: sum(e.active for e in stack.encoders) == 1, what="the first encode under way")
    two = asyncio.create_task(answer(stack, second))
    await eventually(lambda: stack.state.admission.inflight == 2, what="the second request in")
    gate.set()
    return await one, await two


async def test_identical_images_in_flight_at_once_are_encoded_once(make_stack):
    stack = await make_stack(encoders=2, decoders=1)
    one, two = await both_at_once(stack, chat(image("popular"), text="one"), chat(image("popular"), text="two"))
    assert one[0] == two[0] == 200, (one, two)
    assert total(stack.encoders, "images") == 1 and sum(len(e.requests) for e in stack.encoders) == 1
    # The second's consumer got the first's embedding as a reference, and it matched the store.
    assert total(stack.consumers, "images") == 2 and stack.pd.generation_failures == []


async def test_when_the_encode_it_waited_for_fails_a_request_encodes_on_its_own(make_stack):
    stack = await make_stack(encoders=1, decoders=1, encoder_failovers=0)
    encoder = stack.encoders[0]
    encoder.faults.fail_next(1, status=500)
    one, two = await both_at_once(stack, chat(image("fragile"), text="one"), chat(image("fragile"), text="two"))
    assert one[0] == 500 and two[0] == 200, (one, two)  # the encoder's own answer, then the second's own
    assert len(encoder.requests) == 2 and total(stack.encoders, "images") == 1


async def test_an_epd_prefill_counts_as_busy_from_the_moment_it_is_chosen(make_stack):
    stack = await make_stack(encoders=1, prefills=2, decoders=2, consumer_encode=False)
    # The encoder holds every sub-request: 24 requests that open alike are all chosen before any
    # prefill call starts, as under a slow encode (and none goes to its consumer to encode instead).
    stack.encoders[0].faults.gate = gate = asyncio.Event()
    bodies = [conversation([image("brief")], [image(f"step{n}")]) for n in range(24)]
    requests = asyncio.gather(*(ok(stack, body) for body in bodies))
    await eventually(lambda: stack.state.admission.inflight == 24, what="every request routed")
    gate.set()
    await requests
    served = sorted(sum(p.counts.requests.values()) for p in stack.prefills)
    # None had its first token when the others were placed: they spread by load, about 12 and 12.
    assert sum(served) == 24 and served[0] >= 8, served
