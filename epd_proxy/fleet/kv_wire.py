"""vLLM 0.32's KV events as they arrive over ZMQ, read with the proxy's own msgspec structs (pure).

The engine's publisher (`vllm/distributed/kv_events.py`) sends each batch as three frames: the
topic, the sequence number as 8 big-endian bytes, and the batch as msgpack. The batch is an
array (`ts`, `events`, `data_parallel_rank`); each event is a map whose `type` field names it
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), with fields left out when they hold their
default. Only the fields the index reads are declared here, each with a default, so fields a later
vLLM adds, or leaves out, do not stop the decoding. An event of a type not listed here fails the
whole batch: the index cannot know what it changed, so the feed treats it as a hole it cannot fill.

The replay socket answers a request `[b"", start seq]` with `[b"", topic, seq, payload]` per
batch it still buffers from `start` on, then `[b"", b"", END, b""]`.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The replay stream's last frame carries this sequence number (-1, signed).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def read_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big")


class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    """Blocks an engine just cached (or reused from its cache), one entry of `block_hashes` per
    `block_size` tokens of `token_ids`, chained to `parent_block_hash` (None: from the start)."""

    block_hashes: list[int | bytes] = []
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    # One entry per block, None for a block with none; in each entry, in order: the LoRA name
    # (with `lora_name` set), a `[identifier, offset]` pair per media item in the block, the cache
    # salt (first block only), bytes for a prompt-embeds digest.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    # The LoRA adapter whose request stored the blocks, None for the base model; its name leads
    # every entry of `extra_keys` then.
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes] = []
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(Batch)


class Undecodable(ValueError):
    """A payload that is not a batch of the events above."""


def decode(payload: bytes) -> Batch:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise Undecodable(str(exc)) from None
