"""The fake PD's KV events on real ZMQ sockets, as vLLM 0.32 publishes them: the uuid a request sent
names its image's blocks, `GET /kv_event_sources` says where to listen, the replay socket fills a
gap, a restart starts the sequence again, a cache reset says `AllBlocksCleared`. (That the frames
decode with vLLM's own classes: tests/e2e/test_vllm_kv_events_wire.py.)"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from epd_proxy_tools.testing.fake_kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    KvEventsOptions,
)
from epd_proxy_tools.testing.harness import Fakes
from epd_proxy_tools.testing.kv_tap import KvTap, reachable
from epd_proxy_tools.testing.polling import eventually
from tests.media import image

DECODE = msgspec.msgpack.Decoder(KVEventBatch)
OPTIONS = KvEventsOptions(block_size=16, num_blocks=64, topic="kv", prompt_tokens_details=True)
IMAGE = image("cat")


def text_body(text: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }


async def listen(client: aiohttp.ClientSession, url: str) -> KvTap:
    """A tap on the engine at `url`, found through its /kv_event_sources, once its SUB socket hears
    (a subscriber that has just connected misses what is published before its subscription lands)."""
    async with client.get(f"{url}/kv_event_sources") as resp:
        source = (await resp.json())["0"]
    tap = KvTap(reachable(source["endpoint"], "127.0.0.1"), reachable(source["replay_endpoint"], "127.0.0.1"), b"kv")

    async def heard():
        async with client.post(f"{url}/reset_prefix_cache") as resp:
            assert (resp.status, await resp.json()) == (200, {"success": True})
        return tap.receive(0.05)

    await eventually(heard, timeout=10, what="the SUB socket never heard the fake")
    tap.drain()
    return tap


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with client.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_the_uuid_the_proxy_sent_names_the_images_blocks(make_stack):
    stack = await make_stack(encoders=1, consumer_options={"kv_events": OPTIONS})
    fakes = aiohttp.ClientSession()
    async with fakes.get(stack.pd_url + "/kv_event_sources") as resp:
        status, sources = resp.status, await resp.json()
    endpoint = stack.pd.kv.publisher.endpoint
    assert status == 200 and endpoint.startswith("tcp://127.0.0.1:")
    assert list(sources) == ["0"] and sources["0"] == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": stack.pd.kv.publisher.replay_endpoint,
        "buffer_steps": 10_000,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": "kv",
    }
    tap = await listen(fakes, stack.pd_url)
    try:
        content = [IMAGE, {"type": "text", "text": "Describe it."}]
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        async with await stack.chat(body) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        (sent,) = [p for p in stack.pd.requests[-1].body["messages"][0]["content"] if "uuid" in p]
        frames = tap.receive()
        assert frames is not None and frames.topic == b"kv"
        batch = DECODE.decode(frames.payload)
        assert batch.data_parallel_rank == 0
        (stored,) = [e for e in batch.events if isinstance(e, BlockStored)]
        named = {key[0] for keys in stored.extra_keys if keys for key in keys}
        assert named == {sent["uuid"]}
        assert len(stored.token_ids) == 16 * len(stored.block_hashes) == 16 * len(stored.extra_keys)
        image_tokens = usage["prompt_tokens_details"]["multimodal_tokens"]["image"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and image_tokens > 0
        # The role marker, the image's placeholders, the text, the generation prompt: one token each.
        assert usage["prompt_tokens"] == 6 + image_tokens + len("Describe it.") + 11
    finally:
        tap.close()
        await fakes.close()


async def test_the_replay_socket_fills_a_gap_as_vllms_does():
    fakes = Fakes()
    pd, url = await fakes.start("pd", kv_events=OPTIONS)
    async with aiohttp.ClientSession() as client:
        tap = await listen(client, url)
        try:
            pd.kv.publisher.drop_next(1)
            await post(client, url, text_body("a first prompt, long enough to fill a block or two"))
            await post(client, url, text_body("a second prompt, long enough to fill a block or two"))
            (live,) = tap.drain()
            missing = live.seq - 1
            answer = tap.replay(missing)
            assert [frames[:2] for frames in answer] == [
                [b"kv", missing.to_bytes(8, "big")],
                [b"kv", live.seq.to_bytes(8, "big")],
                [b"", END_SEQ],
            ]
            assert answer[1][2] == live.payload and answer[2][2] == b""
            assert DECODE.decode(answer[0][2]).events[0].token_ids[:2] == [256, *b"u"]
            # Past the end: the end marker alone.
            assert tap.replay(live.seq + 1) == [[b"", END_SEQ, b""]]
        finally:
            tap.close()
    await fakes.close()


async def test_a_restarted_engine_counts_from_zero_and_holds_nothing():
    fakes = Fakes()
    pd, url = await fakes.start("pd", kv_events=OPTIONS)
    body = text_body("the same prompt twice, more than one block long")
    async with aiohttp.ClientSession() as client:
        tap = await listen(client, url)
        try:
            await post(client, url, body)
            assert (await post(client, url, body))["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            tap.drain()
            pd.restart_engine()
            after = await post(client, url, body)
            assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            (frames,) = tap.drain()
            assert frames.seq == 0
            assert DECODE.decode(frames.payload).events[0].parent_block_hash is None
            assert [f[1] for f in tap.replay(0)] == [(0).to_bytes(8, "big"), END_SEQ]
            # A reset of the prefix cache says so, and nothing is reused after it.
            async with client.post(f"{url}/reset_prefix_cache") as resp:
                assert resp.status == 200
            (cleared,) = tap.drain()
            assert DECODE.decode(cleared.payload).events == [AllBlocksCleared()]
            assert (await post(client, url, body))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        finally:
            tap.close()
    await fakes.close()


async def test_without_kv_events_a_fake_publishes_nothing_and_says_so():
    fakes = Fakes()
    pd, url = await fakes.start("pd")
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{url}/kv_event_sources") as resp:
            assert (resp.status, await resp.json()) == (200, {})
        usage = (await post(client, url, text_body("hello")))["usage"]
    assert pd.kv is None and "prompt_tokens_details" not in usage
    await fakes.close()


async def test_prefill_hands_its_hits_to_decode_which_reports_them(make_stack):
    stack = await make_stack(
        encoders=1, prefills=1, consumer_options={"kv_events": OPTIONS}, prefill_options={"kv_events": OPTIONS}
    )
    body = text_body("a prompt that both turns share, several blocks of it")
    for turn in range(2):
        async with await stack.chat(body) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        handed = stack.pd.requests[-1].body["kv_transfer_params"]["remote_prefill_cached_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == handed
        assert (handed > 0) == (turn == 1)
