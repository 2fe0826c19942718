"""The KV event feeds (kv_events.py) against real ZMQ sockets in this process: a PUB socket and a
ROUTER replay socket that answer as vLLM 0.32's publisher does, sending batches encoded by vLLM's
own classes, so the proxy's decoder is proven against vLLM's encoder. One test runs vLLM's own
publisher. Replays, gaps, restarts, clears, silence and the cap."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, ZmqEventPublisher

from epd_proxy.fleet.kv_events import (
    GAP_FILLED,
    GAP_LOST,
    REPLAY,
    RESTART,
    STALE_TURNS,
    UNDECODABLE,
    Feed,
    FeedCounts,
    Source,
)
from epd_proxy.fleet.kv_index import FRESH, STALE, KvIndex
from epd_proxy.fleet.kv_names import chain
from epd_proxy_tools.testing.polling import eventually

BS = 32
ENGINE = ("http://127.0.0.1:8000", 0)
END = (-1).to_bytes(8, "big", signed=True)


def prompt(n: int, start: int) -> list[tuple[list[int], None]]:
    return [(list(range(start + i * BS, start + (i + 1) * BS)), None) for i in range(n)]


def stored(hashes: list[int], blocks: list, parent: int | None = None) -> BlockStored:
    """vLLM's own event, as its block pool builds one."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[t for tokens, _ in blocks for t in tokens],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[extra for _, extra in blocks],
        group_idx=0,
        session_id="s-1",
    )


def rebind(sock: zmq.Socket, port: int, timeout_s: float = 10.0) -> None:
    """Bind a port a closed socket held: ZMQ's I/O thread lets go of it a moment after close."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Publisher:
    """vLLM's PUB + ROUTER protocol (ZmqEventPublisher), steerable: a batch can be kept from the
    subscription (a gap), the replay socket can fall silent, the buffer can be short."""

    def __init__(self, context: zmq.asyncio.Context, *, ports: tuple[int, int] | None = None, buffer_steps=10_000):
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        if ports is None:
            ports = (
                self.pub.bind_to_random_port("tcp://127.0.0.1"),
                self.router.bind_to_random_port("tcp://127.0.0.1"),
            )
        else:
            rebind(self.pub, ports[0])
            rebind(self.router, ports[1])
        self.ports = ports
        self.source = Source(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.answering = True
        self.replays = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._task = asyncio.create_task(self._serve_replays())

    async def publish(self, events: list, *, kept_back: bool = False, payload: bytes | None = None) -> int:
        payload = payload or self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self.seq
        self.seq += 1
        if not kept_back:
            await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        return seq

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            if not self.answering:
                continue
            self.replays += 1
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            await self.router.send_multipart((client, b"", b"", END, b""))

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


class Counted(FeedCounts):
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.batches = 0
        super().__init__(applied=self._applied, stream=self._stream)

    def _applied(self, url, applied) -> None:
        self.batches += 1

    def _stream(self, url, what) -> None:
        self.seen[what] = self.seen.get(what, 0) + 1


@pytest.fixture
async def world(context):
    """A publisher, an index and a feed between them, started on demand."""
    publishers: list[Publisher] = []
    tasks: list[asyncio.Task] = []

    class World:
        index = KvIndex(stale_after_s=3.0, max_blocks=100_000)
        counts = Counted()

        def publisher(self, **options) -> Publisher:
            publishers.append(Publisher(context, **options))
            return publishers[-1]

        def follow(self, source: Source, **options) -> Feed:
            feed = Feed(ENGINE, source, self.index, context, self.counts, **options)
            tasks.append(asyncio.create_task(feed.run()))
            return feed

        def held(self, blocks) -> int | None:
            return self.index.prefix_blocks(ENGINE, chain(blocks))

    yield World()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for publisher in publishers:
        await publisher.close()


async def until_held(world, blocks, count, what=""):
    await eventually(lambda: world.held(blocks) == count, what=lambda: f"{what}: held {world.held(blocks)}")


async def test_batches_from_before_the_subscription_come_by_replay_then_live_ones_apply(world):
    publisher = world.publisher()
    early, late = prompt(3, 0), prompt(2, 10_000)
    await publisher.publish([stored([1, 2], early[:2])])
    await publisher.publish([stored([3], early[2:], parent=2)])
    world.follow(publisher.source)
    await until_held(world, early, 3, "published before the feed connected")
    assert world.index.state(ENGINE) == FRESH and world.index.complete(ENGINE)
    await publisher.publish([stored([7, 8], late)])
    await until_held(world, late, 2, "published live")
    assert world.counts.seen.get(GAP_FILLED) is None and world.counts.seen.get(RESTART) is None


async def test_a_batch_the_subscription_missed_is_filled_by_a_replay(world):
    publisher = world.publisher()
    feed = world.follow(publisher.source)
    await eventually(lambda: world.index.state(ENGINE) == FRESH)
    blocks = prompt(3, 0)
    await publisher.publish([stored([1], blocks[:1])])
    await publisher.publish([stored([2], blocks[1:2], parent=1)], kept_back=True)
    await publisher.publish([stored([3], blocks[2:], parent=2)])
    await until_held(world, blocks, 3, "the middle batch came by replay")
    await eventually(lambda: world.counts.seen.get(GAP_FILLED) == 1)
    assert world.index.complete(ENGINE) and feed.last is not None and feed.last[0] == 2
    assert world.counts.seen.get(GAP_LOST) is None and world.counts.seen.get(STALE_TURNS) is None


async def test_a_gap_the_buffer_no_longer_holds_turns_stale_and_rebuilds_from_the_buffer(world):
    publisher = world.publisher(buffer_steps=2)
    world.follow(publisher.source)
    await eventually(lambda: world.index.state(ENGINE) == FRESH)
    old, lost, kept = prompt(1, 0), prompt(1, 5000), prompt(1, 9000)
    await publisher.publish([stored([1], old)])
    await until_held(world, old, 1)
    await publisher.publish([stored([2], lost)], kept_back=True)
    await publisher.publish([stored([3], lost[:0] + prompt(1, 7000))], kept_back=True)
    await publisher.publish([stored([4], kept)])  # buffer holds batches 2 and 3 now, not 1
    await eventually(lambda: world.counts.seen.get(GAP_LOST) == 1)
    await until_held(world, kept, 1, "rebuilt from what the buffer held")
    # The view is a subset again: what came before the lost batches is dropped.
    assert world.held(old) == 0 and world.held(prompt(1, 7000)) == 1
    assert world.counts.seen.get(STALE_TURNS) == 1 and not world.index.complete(ENGINE)
    await eventually(lambda: world.index.state(ENGINE) == FRESH)


async def test_a_restarted_publisher_starts_the_view_empty(world, context):
    first = world.publisher()
    world.follow(first.source)
    before, after = prompt(4, 0), prompt(2, 20_000)
    for seq in range(4):
        await first.publish([stored([seq + 1], before[seq : seq + 1], parent=seq or None)])
    await until_held(world, before, 4)
    ports = first.ports
    await first.close()
    # The engine comes back on the same ports and numbers from 0 again.
    second = world.publisher(ports=ports)
    await second.publish([stored([50, 51], after)])
    await until_held(world, after, 2, "the new publisher's blocks")
    await eventually(lambda: world.counts.seen.get(RESTART, 0) >= 1)
    assert world.held(before) == 0 and world.index.complete(ENGINE)
    await eventually(lambda: world.index.state(ENGINE) == FRESH)


async def test_all_blocks_cleared_empties_the_view(world):
    publisher = world.publisher()
    world.follow(publisher.source)
    blocks = prompt(2, 0)
    await publisher.publish([stored([1, 2], blocks)])
    await until_held(world, blocks, 2)
    await publisher.publish([AllBlocksCleared()])
    await until_held(world, blocks, 0, "after the clear")
    assert world.index.size(ENGINE) == 0 and world.index.state(ENGINE) == FRESH


async def test_a_silent_publisher_turns_stale_and_fresh_again_once_it_answers(world):
    world.index.stale_after_s = 0.6  # a heartbeat replay every 0.2 s
    publisher = world.publisher()
    world.follow(publisher.source, replay_timeout_s=0.3)
    await eventually(lambda: world.index.state(ENGINE) == FRESH)
    replays = publisher.replays
    # Idle but answering: the heartbeats keep it fresh, well past the stale limit.
    await eventually(lambda: publisher.replays >= replays + 5)
    assert world.index.state(ENGINE) == FRESH
    publisher.answering = False
    await eventually(lambda: world.index.state(ENGINE) == STALE)
    assert "did not answer" in (world.index.why_stale(ENGINE) or "")
    assert world.index.prefix_blocks(ENGINE, chain(prompt(1, 0))) is None
    await eventually(lambda: world.counts.seen.get(STALE_TURNS) == 1)
    publisher.answering = True
    await eventually(lambda: world.index.state(ENGINE) == FRESH)
    assert world.counts.seen[REPLAY] >= 5


async def test_a_batch_that_cannot_be_read_drops_the_view_until_the_next(world):
    publisher = world.publisher()
    world.follow(publisher.source)
    blocks, later = prompt(1, 0), prompt(1, 3000)
    await publisher.publish([stored([1], blocks)])
    await until_held(world, blocks, 1)
    await publisher.publish([], payload=msgspec.msgpack.encode([1.0, [{"type": "SomethingNew"}]]))
    await eventually(lambda: world.counts.seen.get(UNDECODABLE) == 1)
    assert world.index.state(ENGINE) == STALE and world.index.size(ENGINE) == 0
    await publisher.publish([stored([2], later)])
    await until_held(world, later, 1)
    assert world.index.state(ENGINE) == FRESH and not world.index.complete(ENGINE)


async def test_the_index_stays_within_its_cap_however_much_is_published(world):
    world.index.max_blocks = 64
    publisher = world.publisher()
    world.follow(publisher.source)
    for n in range(20):
        await publisher.publish([stored(list(range(n * 10, n * 10 + 10)), prompt(10, n * 1000))])
    last = prompt(10, 19_000)
    await until_held(world, last, 10, "the newest batch")
    assert world.index.blocks <= 64 and world.index.evictions >= 200 - 64
    assert world.held(prompt(10, 0)) == 0


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


async def test_vllms_own_publisher_feeds_the_index(world):
    pub_port, replay_port = free_ports(2)
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}"
    )
    try:
        image = [
            (list(range(BS)), None),
            (list(range(BS, 2 * BS)), (("img-7", 5),)),
            (list(range(2 * BS, 3 * BS)), None),
        ]
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([11, 12, 13], image)]))
        world.follow(Source(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"))
        await until_held(world, image, 3, "vLLM's publisher, before the feed connected")
        await eventually(lambda: world.index.media_prefix(ENGINE, "img-7") == 2)
        more = prompt(2, 50_000)
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([21, 22], more)]))
        await until_held(world, more, 2, "vLLM's publisher, live")
    finally:
        await asyncio.to_thread(publisher.shutdown)
