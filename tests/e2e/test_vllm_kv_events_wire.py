"""The fake's KV events against the pinned vLLM's own classes: what the fake PD publishes decodes
with vLLM's `KVEventBatch` and re-encodes to the same bytes, and its replay socket answers exactly
as vLLM's `ZmqEventPublisher` does for the same batches. No vLLM server is started."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
import pytest

from epd_proxy_tools.testing.fake_kv_events import KvEventsOptions
from epd_proxy_tools.testing.harness import Fakes, free_port
from epd_proxy_tools.testing.kv_tap import KvTap, reachable
from epd_proxy_tools.testing.polling import eventually

pytestmark = pytest.mark.e2e
kv_events = pytest.importorskip("vllm.distributed.kv_events")

VLLM_DECODE = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
ENCODE = msgspec.msgpack.Encoder()
# Four blocks of 16 tokens: the second prompt evicts the first's, so every event kind is sent.
OPTIONS = KvEventsOptions(block_size=16, num_blocks=4, topic="kv")
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}, "uuid": "img-8152"}


def body(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


async def drive(url: str) -> None:
    async with aiohttp.ClientSession() as client:
        for request in (
            body([{"type": "text", "text": "ab"}, IMAGE]),
            body([{"type": "text", "text": "a different prompt, over a block"}]),
        ):
            async with client.post(f"{url}/v1/chat/completions", json=request) as resp:
                assert resp.status == 200, await resp.text()
        async with client.post(f"{url}/reset_prefix_cache") as resp:
            assert resp.status == 200


async def test_the_fakes_batches_decode_with_vllms_classes_to_the_same_bytes():
    fakes = Fakes()
    pd, url = await fakes.start("pd", kv_events=OPTIONS)
    await drive(url)
    tap = KvTap(reachable(pd.kv.publisher.endpoint, "127.0.0.1"), pd.kv.publisher.replay_endpoint, b"kv")
    try:
        answer = tap.replay(0)
    finally:
        tap.close()
    await fakes.close()
    batches = [VLLM_DECODE.decode(payload) for _, _, payload in answer[:-1]]
    assert [ENCODE.encode(batch) for batch in batches] == [payload for _, _, payload in answer[:-1]]
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)
    events = [e for b in batches for e in b.events]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockRemoved", "BlockStored", "AllBlocksCleared"]
    image = events[0]
    assert isinstance(image, kv_events.BlockStored) and image.block_size == 16 and image.medium == "GPU"
    # The image's placeholders start at token 8 (role marker, "ab"): vLLM decodes each
    # (identifier, offset) pair as a list.
    assert image.extra_keys[0] == (["img-8152", 8],) and image.extra_keys[1] == (["img-8152", -8],)
    assert len(image.token_ids) == 16 * len(image.block_hashes) and image.parent_block_hash is None
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in image.block_hashes)
    # The second prompt needs all four blocks: the first's are evicted, its tail first.
    assert [e.block_hashes for e in events[1:3]] == [image.block_hashes[1:], image.block_hashes[:1]]
    assert all(e.medium == "GPU" and e.group_idx == 0 for e in events[1:3])
    assert events[3].extra_keys == [None, None, None] and events[3].parent_block_hash is None


async def test_the_fakes_replay_answers_as_vllms_publisher():
    fakes = Fakes()
    pd, url = await fakes.start("pd", kv_events=OPTIONS)
    await drive(url)
    publisher = pd.kv.publisher
    ours = KvTap(reachable(publisher.endpoint, "127.0.0.1"), publisher.replay_endpoint, b"kv")
    replayed = ours.replay(0)
    # vLLM's publisher, given the very batches the fake sent, in order.
    pub_port, replay_port = free_port(), free_port()
    theirs = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    reference = KvTap(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", b"kv")
    try:
        for _, _, payload in replayed[:-1]:
            theirs.publish(VLLM_DECODE.decode(payload))
        await eventually(lambda: len(reference.replay(0)) == len(replayed), what="vLLM's publisher took the batches")
        for start in (0, 2, len(replayed) - 1, 99):
            assert ours.replay(start) == reference.replay(start), start
    finally:
        theirs.shutdown()
        ours.close()
        reference.close()
        await fakes.close()
