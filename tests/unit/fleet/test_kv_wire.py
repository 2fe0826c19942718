"""vLLM's KV event batches, encoded by vLLM's own classes, read by the proxy's structs (kv_wire.py)."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from epd_proxy.fleet import kv_wire


def test_every_event_vllm_publishes_reads_back_field_for_field():
    batch = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored(
                block_hashes=[2**63 + 5, b"\x01" * 32],
                parent_block_hash=7,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name="adapter",
                extra_keys=[None, ("adapter", ("img-1", 3), "salt", b"\x00digest")],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                session_id="s",
            ),
            BlockRemoved(block_hashes=[7], medium="CPU", group_idx=1),
            AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    read = kv_wire.decode(msgspec.msgpack.encode(batch))
    stored, removed, cleared = read.events
    assert read.ts == 12.5 and read.data_parallel_rank == 3
    assert stored == kv_wire.BlockStored(
        block_hashes=[2**63 + 5, b"\x01" * 32],
        parent_block_hash=7,
        token_ids=list(range(8)),
        block_size=4,
        medium="GPU",
        extra_keys=[None, ["adapter", ["img-1", 3], "salt", b"\x00digest"]],
        group_idx=1,
        lora_name="adapter",
    )
    assert removed == kv_wire.BlockRemoved(block_hashes=[7], medium="CPU", group_idx=1)
    assert isinstance(cleared, kv_wire.AllBlocksCleared)


def test_fields_left_at_their_default_are_left_out_and_read_as_defaults():
    # vLLM omits defaults: no extra keys, no group, no rank.
    raw = msgspec.msgpack.encode(
        KVEventBatch(
            ts=1.0,
            events=[
                BlockStored(
                    block_hashes=[1],
                    parent_block_hash=None,
                    token_ids=[1, 2],
                    block_size=2,
                    lora_id=None,
                    medium=None,
                    lora_name=None,
                )
            ],
        )
    )
    (stored,) = kv_wire.decode(raw).events
    assert stored.extra_keys is None and stored.group_idx is None and kv_wire.decode(raw).data_parallel_rank is None


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]])],
)
def test_what_is_not_such_a_batch_is_undecodable(payload):
    with pytest.raises(kv_wire.Undecodable):
        kv_wire.decode(payload)


def test_sequence_numbers_are_eight_big_endian_bytes_and_the_end_is_minus_one():
    assert kv_wire.seq_bytes(258) == b"\x00" * 6 + b"\x01\x02" and kv_wire.read_seq(kv_wire.seq_bytes(258)) == 258
    assert kv_wire.END_SEQ == b"\xff" * 8
