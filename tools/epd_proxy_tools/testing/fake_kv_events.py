"""KV-cache events as vLLM 0.32 publishes them, for the fake PD, prefill and decode servers.

What vLLM does (vllm/distributed/kv_events.py, vllm/v1/core/block_pool.py, kv_cache_utils.py):

- A consumer holds a pool of blocks of `block_size` tokens. Only full blocks are cached, each under
  a hash chained over its parent's hash, its tokens and its extra keys: per multimodal item that
  overlaps the block, the item's identifier (the uuid the request sent, when no processing option
  derives another) and where the item starts relative to the block (negative: in an earlier
  block); the request's `cache_salt` on the first block.
- A request reuses the leading cached blocks of its prompt, never the block holding the prompt's
  last token (one token is always computed to sample from). It takes blocks from the head of a
  free queue, evicting whatever cached block it takes (`BlockRemoved`, one event per hash), stores
  each block as it fills, the prompt's at prefill and the generated tokens' while decoding
  (`BlockStored`), and when it ends gives its blocks back to the tail of the queue, last block
  first, so a request's tail is evicted before its head. A block recomputed while an identical one
  is cached (the prompt's last full block) is stored again: a second `BlockStored` for one hash,
  and each copy's eviction is its own `BlockRemoved`.
- Resetting the prefix cache (the dev endpoint `POST /reset_prefix_cache`) sends `AllBlocksCleared`.
- Batches go out on a ZMQ PUB socket as three frames: topic, sequence number (8 bytes, big
  endian, from 0 per engine start) and the msgpack of the batch. A ROUTER socket replays what its
  buffer still holds: a request `[b"", start seq]` is answered with every buffered batch from that
  seq as `[b"", topic, seq, payload]`, then `[b"", b"", -1, b""]`.

The fake publishes one batch per request it serves (vLLM one per engine step), with the events in
the order vLLM's step makes them. Its tokens come from a stable rule, not a tokenizer: a byte per
token of text, a role marker per message, a fixed placeholder token per multimodal token. The
structs below are written for the tooling with vLLM's field layout and tags, so a subscriber built
on vLLM's own classes decodes them (tests/e2e/test_vllm_kv_events_wire.py holds that).
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import orjson
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM reports "GPU" on its CPU build too.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# The fake's token ids: 0-255 are the bytes of text, then the markers and placeholders.
IM_START = 256
PLACEHOLDER = {"image": 258, "video": 259, "audio": 260}
NEWLINE = 10
GENERATION_PROMPT = [IM_START, *b"assistant", NEWLINE]


@dataclass(frozen=True)
class KvEventsOptions:
    """A fake consumer's prefix cache and KV-event publisher, named as vLLM's `--kv-events-config`
    names them. `tcp://*:0` binds a free port on loopback (vLLM: on the node's address) and
    reports the port taken; `tcp://*:PORT` binds that port; a concrete host connects, as in vLLM."""

    block_size: int = 16
    num_blocks: int = 1024
    endpoint: str = "tcp://*:0"
    replay_endpoint: str | None = "tcp://*:0"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: int = 0
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details with cached_tokens.
    prompt_tokens_details: bool = False


class Feature(NamedTuple):
    """One multimodal item in the prompt: its identifier and placeholder tokens."""

    identifier: str
    offset: int
    length: int


class Prompt(NamedTuple):
    tokens: list[int]
    features: list[Feature]
    # Where each piece of the fake's prompt ends, in tokens.
    ends: list[int]


class Served(NamedTuple):
    """One request's tokens, those of its prompt the cache held, and those of its prompt it newly
    cached (vLLM's `created_cache_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    created_tokens: int


def tokenize(pieces: list[tuple[str, int, str]]) -> Prompt:
    """The prompt of the fake's pieces (key, tokens, kind): a role marker per message, a byte per
    token of text, `tokens` placeholders per media item, then the generation prompt."""
    tokens: list[int] = []
    features: list[Feature] = []
    ends: list[int] = []
    for key, count, kind in pieces:
        if kind == "role":
            tokens += [IM_START, *key[1:-1].encode(), NEWLINE]
        elif kind == "text":
            tokens += key.encode("utf-8", "surrogatepass")
        else:
            features.append(Feature(key, len(tokens), count))
            tokens += [PLACEHOLDER[kind]] * count
        ends.append(len(tokens))
    return Prompt(tokens + GENERATION_PROMPT, features, ends)


def block_extra_keys(
    features: list[Feature], start: int, end: int, salt: str | None, first: int, lora: str | None = None
) -> tuple[tuple[Any, ...] | None, int]:
    """The event's extra keys of block [start, end) and the first feature the next block may
    overlap: the LoRA adapter's name on every block, `(identifier, offset)` per overlapping item,
    then the salt on block 0."""
    keys: list[Any] = [lora] if lora else []
    index = first
    while index < len(features):
        feature = features[index]
        if feature.offset >= end:
            break
        if feature.offset + feature.length <= start:
            index += 1
            continue
        keys.append((feature.identifier, feature.offset - start))
        if feature.offset + feature.length > end:
            break
        index += 1
    if start == 0 and salt:
        keys.append(salt)
    return (tuple(keys) if keys else None), index


def chain_hashes(
    tokens: list[int], features: list[Feature], block_size: int, blocks: int, salt: str | None, lora: str | None = None
) -> list[tuple[int, tuple[Any, ...] | None]]:
    """The first `blocks` full blocks' hashes (64-bit ints, as vLLM publishes them by default) and
    extra keys. The hash function is the fake's own: consumers learn hashes from the events."""
    out: list[tuple[int, tuple[Any, ...] | None]] = []
    parent = 0
    first = 0
    for b in range(blocks):
        start = b * block_size
        extra, first = block_extra_keys(features, start, start + block_size, salt, first, lora)
        digest = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
        digest.update(array("i", tokens[start : start + block_size]).tobytes())
        if extra is not None:
            digest.update(orjson.dumps(extra))
        parent = int.from_bytes(digest.digest(), "big")
        out.append((parent, extra))
    return out


class BlockPool:
    """The blocks of one engine, cached or free, in vLLM's eviction order (pure: events returned)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        # Free blocks, next to be taken first: block id -> nothing (its hash is in `hash_of`).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[int | None] = [None] * num_blocks
        # Hash -> the blocks holding it, first stored first.
        self._holders: dict[int, list[int]] = {}

    def cached(self) -> set[int]:
        return set(self._holders)

    def serve(
        self, prompt: Prompt, generated: list[int], salt: str | None, events: list[Any], lora: str | None = None
    ) -> Served:
        """Run one request (of the LoRA adapter `lora`, None for the base model): reuse, allocate
        (evicting), store as blocks fill, free."""
        size = self.block_size
        generated = generated or [0]
        tokens = prompt.tokens + generated
        n_prompt = len(prompt.tokens)
        # The last generated token is sampled, never computed.
        computed = len(tokens) - 1
        hashes = chain_hashes(tokens, prompt.features, size, computed // size, salt, lora)
        hit = 0
        while hit < min((n_prompt - 1) // size, len(hashes)) and hashes[hit][0] in self._holders:
            hit += 1
        held = [self._holders[hashes[b][0]][0] for b in range(hit)]
        for block in held:
            del self._free[block]
        prefill_blocks = -(-n_prompt // size)
        full_at_prefill = n_prompt // size
        try:
            for _ in range(prefill_blocks - hit):
                held.append(self._allocate(events))
            self._store(held, hashes, hit, full_at_prefill, tokens, events, lora)
            for b in range(full_at_prefill, -(-computed // size)):
                if b >= prefill_blocks:
                    held.append(self._allocate(events))
                if b < len(hashes):
                    self._store(held, hashes, b, b + 1, tokens, events, lora)
        except _PoolFull:
            pass  # vLLM would not have admitted it; what fitted stays cached
        for block in reversed(held):
            self._free[block] = None
        return Served(n_prompt, len(generated), hit * size, max(0, full_at_prefill - hit) * size)

    def clear(self, events: list[Any]) -> None:
        self._hash_of = [None] * len(self._hash_of)
        self._holders.clear()
        events.append(AllBlocksCleared())

    def _allocate(self, events: list[Any]) -> int:
        if not self._free:
            raise _PoolFull
        block, _ = self._free.popitem(last=False)
        old = self._hash_of[block]
        if old is not None:
            holders = self._holders[old]
            holders.remove(block)
            if not holders:
                del self._holders[old]
            self._hash_of[block] = None
            events.append(BlockRemoved(block_hashes=[old], medium=MEDIUM, group_idx=0))
        return block

    def _store(
        self,
        held: list[int],
        hashes: list[tuple[int, tuple[Any, ...] | None]],
        start: int,
        end: int,
        tokens: list[int],
        events: list[Any],
        lora: str | None,
    ) -> None:
        if start >= end:
            return
        for b in range(start, end):
            block, digest = held[b], hashes[b][0]
            self._hash_of[block] = digest
            self._holders.setdefault(digest, []).append(block)
        size = self.block_size
        events.append(
            BlockStored(
                block_hashes=[digest for digest, _ in hashes[start:end]],
                parent_block_hash=hashes[start - 1][0] if start else None,
                token_ids=tokens[start * size : end * size],
                block_size=size,
                # vLLM numbers the adapters it loaded from 1.
                lora_id=1 if lora else None,
                medium=MEDIUM,
                lora_name=lora,
                extra_keys=[extra for _, extra in hashes[start:end]],
                group_idx=0,
            )
        )


class _PoolFull(Exception):
    pass


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for data-parallel ranks: rank k publishes on the configured port + k (port 0 stays 0)."""
    if not endpoint or rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    if endpoint == "tcp://*:0":
        return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    sock.bind(endpoint)
    return endpoint


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """vLLM's ZMQ publisher: PUB for the batches, ROUTER (served by a thread) for replay."""

    def __init__(self, options: KvEventsOptions) -> None:
        self.options = options
        self.topic = options.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(options.hwm)
        endpoint = offset_port(options.endpoint, options.data_parallel_rank) or ""
        if _binds(endpoint):
            self.endpoint = _bind(self._pub, endpoint)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket | None = None
        replay = offset_port(options.replay_endpoint, options.data_parallel_rank)
        if replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self._replay, replay)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self._seq = 0
        self._drop = 0
        self._running = True
        self._thread: threading.Thread | None = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True, name="fake-kv-replay")
            self._thread.start()

    def publish(self, events: list[Any]) -> None:
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.options.data_parallel_rank)
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            dropped = self._drop > 0
            self._drop -= dropped
        if not dropped:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def drop_next(self, batches: int = 1) -> None:
        """The next `batches` batches get their seq and a place in the replay buffer but never
        reach the PUB socket: the gap a slow subscriber (or a full high-water mark) sees."""
        with self._lock:
            self._drop += batches

    def restart(self) -> None:
        """As a restarted engine: seq from 0 again and nothing to replay (same ports)."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()
            self._drop = 0

    def source(self) -> dict[str, Any]:
        """One rank's entry of `GET /kv_event_sources`: vLLM's KVEventsConfig as it resolved it."""
        o = self.options
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": o.buffer_steps,
            "hwm": o.hwm,
            "max_queue_size": o.max_queue_size,
            "topic": o.topic,
        }

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._running:
            if not self._replay.poll(50):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores a malformed request
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = [(seq, payload) for seq, payload in self._buffer if seq >= first]
            for seq, payload in kept:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


class KvEngine:
    """A fake consumer's prefix cache with its publisher: what `FakeVLLM` calls per request."""

    def __init__(self, options: KvEventsOptions) -> None:
        self.options = options
        self.pool = BlockPool(options.num_blocks, options.block_size)
        self.publisher = Publisher(options)

    def serve(self, prompt: Prompt, generated: list[int], salt: str | None, lora: str | None = None) -> Served:
        events: list[Any] = []
        served = self.pool.serve(prompt, generated, salt, events, lora)
        if events:
            self.publisher.publish(events)
        return served

    def reset_prefix_cache(self) -> None:
        events: list[Any] = []
        self.pool.clear(events)
        self.publisher.publish(events)

    def restart(self) -> None:
        """The engine came back empty: a new pool, seq from 0, no AllBlocksCleared (nobody sent one)."""
        self.pool = BlockPool(self.options.num_blocks, self.options.block_size)
        self.publisher.restart()

    def sources(self) -> dict[str, Any]:
        return {str(self.options.data_parallel_rank): self.publisher.source()}

    def close(self) -> None:
        self.publisher.close()
