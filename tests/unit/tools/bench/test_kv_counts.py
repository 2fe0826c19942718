"""The bench's count of what the consumers' KV caches stored and evicted, from vLLM's wire format."""

from __future__ import annotations

import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from epd_proxy_tools.bench.kv_counts import KvEventCounter, Tally, count_batch
from epd_proxy_tools.testing.harness import free_port


def _batch(*events) -> bytes:
    # Encoded by vLLM's own classes, as its publisher does.
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))


STORED = BlockStored(
    block_hashes=[11, 12, 13],
    parent_block_hash=None,
    token_ids=list(range(96)),
    block_size=32,
    lora_id=None,
    medium="GPU",
    lora_name=None,
)
REMOVED = BlockRemoved(block_hashes=[11, 12], medium="GPU")


def test_a_batch_counts_blocks_stored_and_removed_but_not_a_cleared_cache():
    counts = count_batch(_batch(STORED, REMOVED, AllBlocksCleared()))
    assert (counts["stored"], counts["removed"]) == (3, 2)
    assert not count_batch(b"not msgpack")


def test_the_eviction_rate_is_blocks_removed_per_block_stored_over_a_window():
    window = Tally(stored=50, removed=20).minus(Tally(stored=10, removed=0))
    assert window == Tally(40, 20) and window.eviction_rate == 0.5
    assert Tally().eviction_rate is None


def test_the_counter_follows_each_engines_publisher_by_name():
    port = free_port()
    context = zmq.Context.instance()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    counter = KvEventCounter({"pd": f"tcp://127.0.0.1:{port}"})
    try:
        deadline = time.monotonic() + 10
        # A subscriber misses what is published before it joins: publish until it counts.
        while counter.snapshot()["pd"].stored == 0:
            assert time.monotonic() < deadline, "the counter never heard the publisher"
            publisher.send_multipart([b"", (0).to_bytes(8, "big"), _batch(STORED)])
            time.sleep(0.05)
        before = counter.snapshot()["pd"]
        publisher.send_multipart([b"", (1).to_bytes(8, "big"), _batch(REMOVED)])
        while counter.snapshot()["pd"].removed == 0:
            assert time.monotonic() < deadline, "the removal was not counted"
            time.sleep(0.02)
        assert counter.snapshot()["pd"].minus(before) == Tally(0, 2)
    finally:
        counter.close()
        publisher.close(linger=0)
