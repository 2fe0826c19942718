"""What a consumer is handed when encoders cannot take a request's media, against the fakes.

Two rules: what a consumer takes raw is configured or asked of it by the proxy's own probe, never
read from an error a client can make it echo; and the consumer encodes only media no encoder has
received, so one input that takes down the encoders cannot take down the consumer too."""

from __future__ import annotations

import asyncio
import base64

import pytest

from epd_proxy.fleet import stalls
from epd_proxy.fleet.backends import PREFILL_DECODE
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_sharing_bounds import first_encoder_warmed
from tests.media import chat, conversation, image, video

HOSTILE_TYPE = "At most 0 x"


def total(fakes, counter: str) -> int:
    return sum(sum(getattr(fake.counts, counter).values()) for fake in fakes)


def raw_media(fake) -> int:
    """Raw media parts the fake was sent, over every request."""
    return sum(
        1
        for seen in fake.requests
        for message in seen.body.get("messages", ())
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in ("image_url", "video_url", "audio_url")
    )


async def status_of(stack, body, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    async with stack.client.post(path, json=body) as resp:
        return resp.status, await resp.json()


def hostile_messages_body() -> dict:
    """A Messages request with a history image and a block whose type is the text vLLM uses to
    refuse raw media: the consumer's 400 echoes it back."""
    data = base64.b64encode(b"image-hostile").decode()
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    return {
        "model": "tiny-vlm",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, picture]},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": [{"type": HOSTILE_TYPE}, {"type": "text", "text": "and now?"}]},
        ],
    }


async def consumer_verdict(stack, refused: frozenset[str]) -> None:
    """Until the probe has asked every consumer, the proxy assumes vLLM's default."""
    consumers = stack.state.fleet.members(PREFILL_DECODE)
    await eventually(
        lambda: all(c.raw_refused == refused for c in consumers) and stack.state.prober.media.settled(),
        what=f"every consumer probed as refusing {sorted(refused)}",
    )


# -- no client text sets a capability ---------------------------------------------------------------


async def test_a_client_made_refusal_changes_no_later_request(make_stack):
    stack = await make_stack(encoders=1, decoders=1)
    await consumer_verdict(stack, frozenset())
    status, answer = await status_of(stack, hostile_messages_body(), "/v1/messages")
    assert status == 400 and HOSTILE_TYPE in answer["error"]["message"]
    before = total(stack.encoders, "images")
    for n in range(3):
        body = conversation(*([image(f"t{k}")] for k in range(n + 1)))
        status, answer = await status_of(stack, body)
        assert status == 200, answer
    # Reuse still holds: one new image per turn reaches the encoder, the history goes raw.
    assert total(stack.encoders, "images") - before == 3
    assert stack.state.fleet.members(PREFILL_DECODE)[0].raw_refused == frozenset()
    # And with the encoders gone the PD still encodes, as a fresh proxy would have it.
    await stack.servers[0].close()
    status, answer = await status_of(stack, conversation([image("u0")], [image("u1")]))
    assert status == 200, answer


# -- capabilities from the probe --------------------------------------------------------------------


async def test_a_pd_without_raw_video_still_gets_history_images_raw(make_stack):
    stack = await make_stack(encoders=1, decoders=1, consumer_options={"no_raw": frozenset({"video"})})
    await consumer_verdict(stack, frozenset({"video"}))
    for body in (conversation([image("h0")]), conversation([image("h0")], [image("h1"), video("v1")])):
        status, answer = await status_of(stack, body)
        assert status == 200, answer
    seen = stack.pd.requests[-1]
    kinds = [p.get("type") for m in seen.body["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert kinds.count("image_url") == 2 and kinds.count("video_embeds") == 1
    # Only the turn's new image and the video reached the encoder; the history image was reused.
    assert total(stack.encoders, "images") == 1 + 2


async def test_the_flag_names_modalities_without_any_probe(make_stack):
    stack = await make_stack(encoders=1, decoders=1, probe_interval_s=0, no_raw_media=("image",))
    status, answer = await status_of(stack, conversation([image("h0")], [image("h1")]))
    assert status == 200, answer
    assert raw_media(stack.pd) == 0 and total(stack.encoders, "images") == 2


# -- the consumer encodes only media no encoder has received ----------------------------------------


async def test_encoders_that_read_the_media_and_drop_the_connection_fail_the_request(make_stack):
    stack = await make_stack(encoders=2, decoders=1)
    for encoder in stack.encoders:
        encoder.faults.fail_next(1, 0)  # read the request, then drop the connection
    status, answer = await status_of(stack, chat(image("poison")))
    assert status == 502, answer
    assert answer["error"]["stage"] == "encode"
    assert stack.pd.requests == []


async def test_a_drop_after_reading_is_remembered_when_the_next_encoder_refuses(make_stack):
    stack = await make_stack(encoders=2, decoders=1, encode_policy="round_robin")
    stack.encoders[0].faults.fail_next(1, 0)
    await stack.servers[1].close()
    status, answer = await status_of(stack, chat(image("poison")))
    assert status == 502, answer
    assert answer["error"]["stage"] == "encode"
    assert stack.pd.requests == []


async def test_an_encoder_timing_out_after_reading_is_504_and_the_pd_gets_nothing(make_stack):
    stack = await make_stack(encoders=1, decoders=1, encode_timeout_s=0.3)
    stack.encoders[0].faults.delay_s = 30
    status, answer = await status_of(stack, chat(image("slow")))
    assert status == 504, answer
    assert answer["error"]["stage"] == "encode"
    assert stack.pd.requests == []


@pytest.mark.parametrize("encoders", [1, 2])
async def test_encoders_refusing_connections_leave_the_media_to_the_pd(make_stack, encoders):
    stack = await make_stack(encoders=encoders, decoders=1)
    for server in stack.servers[:encoders]:
        await server.close()
    status, answer = await status_of(stack, chat(image("fine")))
    assert status == 200, answer
    assert raw_media(stack.pd) == 1 and stack.pd.encoded_locally == 1


async def test_media_moved_off_a_stalled_encoder_never_reach_the_pd(make_stack, monkeypatch):
    # The overdue floor is sized for real CPU engines; the mechanism is the same at 1 s.
    monkeypatch.setattr(stalls, "OVERDUE_FLOOR_S", 1.0)
    stack = await make_stack(encoders=2, decoders=1, encode_timeout_s=30.0)
    await first_encoder_warmed(stack, stack.state, delay_s=0.05, rounds=4)
    stuck, _ = stack.encoders
    stuck.faults.delay_s = 60.0  # reads the media and never answers in time
    await stack.servers[1].close()  # the other encoder refuses connections
    before = len(stack.pd.requests)
    status, answer = await status_of(stack, chat(image("hangs")))
    assert status in (502, 504), answer
    assert answer["error"]["stage"] == "encode"
    assert len(stack.pd.requests) == before


async def test_an_encoder_that_hangs_before_it_ever_answered_leaves_later_media_to_the_pd(make_stack):
    # Never measured, so only its silence tells how far behind it is: past the bound, the media of
    # later requests (which no encoder received) go to the PD instead of queueing behind it.
    stack = await make_stack(encoders=1, decoders=1, consumer_encode_after_s=2.0, encode_timeout_s=30.0)
    (hung,) = stack.encoders
    hung.faults.delay_s = 60.0
    first = asyncio.create_task(status_of(stack, chat(image("stuck"))))
    try:
        await eventually(lambda: len(hung.requests) == 1, what="the first sub-request reached the encoder")
        url = stack.backend_urls["e"][0]
        registry = stack.state.metrics.registry
        # What the operator's gauge shows is what the proxy decides on.
        await eventually(
            lambda: (registry.get_sample_value("epd_encoder_backlog_seconds", {"encoder": url}) or 0.0) > 2.0,
            timeout=15.0,
            what="the silent encoder's backlog past --consumer-encode-after",
        )
        status, answer = await asyncio.wait_for(status_of(stack, chat(image("later"))), 10.0)
        assert status == 200, answer
        assert len(hung.requests) == 1 and raw_media(stack.pd) == 1 and stack.pd.encoded_locally == 1
    finally:
        first.cancel()
