"""One engine's KV events followed into the index: a ZMQ subscriber per data-parallel rank.

The feed keeps the index's view of its engine a subset of what the engine holds: it applies the
batches in sequence order, every one, from wherever the view was last (re)built. Whatever breaks
that chain drops the view and builds it again from what the engine's replay socket still buffers
(vLLM keeps its last `buffer_steps` batches):

- **Joining.** A subscriber misses what was published before its connection was made (ZMQ's slow
  joiner), so right after connecting the feed asks for a replay from the start.
- **A gap** (a sequence number skipped: the socket's queue overflowed, the network dropped) is
  filled by a replay from the last batch applied. When that batch is no longer buffered the
  history between is lost: the engine turns stale for the moment (logged, counted), and the view
  is rebuilt from what is buffered.
- **A restart.** A new publisher numbers from 0 again. A sequence number below the last applied
  (that is not a batch just replayed), or a replay whose first batch is not the last one applied
  (its number or its timestamp differ), means the engine restarted: the view starts empty and is
  built from the new publisher's first batch. `AllBlocksCleared` empties it too (kv_index.py).
- **Silence.** vLLM publishes only when its cache changes, so an idle engine is silent. Every
  third of `--kv-events-stale-after` without a batch, the feed asks for a replay from its last
  batch: the publisher's own thread answers, so an answer proves it alive and that nothing was
  missed (or brings what was). No answer within the limit turns the engine stale. Without a
  replay socket nothing can tell idle from gone, and the engine turns stale after that silence.

Each proxy worker subscribes on its own (ZMQ's PUB socket sends every batch to every subscriber),
so each worker's index, which its routing reads, is complete without sharing state between them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epd_proxy.fleet.kv_index import STALE, Applied, EngineId, KvIndex
from epd_proxy.fleet.kv_wire import END_SEQ, Batch, Undecodable, decode, read_seq, seq_bytes

log = logging.getLogger("epd_proxy.kv_events")

# What a feed counts besides the batches it applies (metrics: epd_kv_event_stream_total{what}).
GAP_FILLED, GAP_LOST, REPLAY, RESTART, STALE_TURNS, UNDECODABLE = (
    "gap_filled",
    "gap_lost",
    "replay",
    "restart",
    "stale",
    "undecodable",
)
# How a catch-up went besides those: the view went on from the last batch, or was built anew.
CONTINUED, JOINED = "continued", "joined"
STREAM_EVENTS = (GAP_FILLED, GAP_LOST, REPLAY, RESTART, STALE_TURNS, UNDECODABLE)
# A ZMQ queue this deep (batches) absorbs a burst while the event loop is busy; beyond it the
# socket drops and the feed replays.
RECEIVE_QUEUE = 10_000
# Batches handled between two turns given to the rest of the event loop.
BATCHES_PER_TURN = 64
# What a publisher that lies or breaks can make a feed hold: a message (ZMQ drops a larger one
# unread), and a replay (twice what vLLM buffers by default, 10,000 batches).
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_REPLAY_BATCHES = 20_000


@dataclass(frozen=True, slots=True)
class Source:
    """Where one engine publishes: its PUB endpoint, its replay endpoint (None: it has none) and
    the topic its batches carry."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


@dataclass
class FeedCounts:
    """How a feed reports what it did (the proxy binds these to its metrics)."""

    applied: Callable[[str, Applied], None] = lambda url, applied: None
    stream: Callable[[str, str], None] = lambda url, what: None


@dataclass(eq=False)
class Feed:
    engine: EngineId
    source: Source
    index: KvIndex
    context: zmq.asyncio.Context
    counts: FeedCounts = field(default_factory=FeedCounts)
    # The longest wait for each frame of a replay.
    replay_timeout_s: float = 2.0
    # The last batch applied: its sequence number and timestamp (None: none yet).
    last: tuple[int, float] | None = field(default=None, init=False)
    # The batches the last replay brought, so that the same batches arriving on the subscription
    # afterwards are known as duplicates rather than as a restarted publisher.
    _replayed: dict[int, float] = field(default_factory=dict, init=False)

    @property
    def heartbeat_s(self) -> float:
        return self.index.stale_after_s / 3

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        token = self.index.watch(self.engine)
        try:
            await self.catch_up()
            while True:
                if not await sub.poll(self.heartbeat_s * 1000):
                    await self.catch_up()
                    continue
                for _ in range(BATCHES_PER_TURN):
                    if (behind := self.receive(await sub.recv_multipart())) is not None:
                        caught = await self.catch_up()
                        if behind and caught == CONTINUED:
                            self.counts.stream(self.engine[0], GAP_FILLED)
                    if not int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        break
                await asyncio.sleep(0)
        finally:
            sub.close(linger=0)
            self.index.forget(self.engine, token)

    # -- the subscription --------------------------------------------------------------------------------
    def receive(self, frames: list[bytes]) -> bool | None:
        """One batch from the subscription, applied when it is the next one. Otherwise it says a
        replay must settle what happened: True for a gap, False for an older number."""
        if len(frames) != 3:
            self._undecodable(f"{len(frames)} frames")
            return None
        seq = read_seq(frames[1])
        batch = self._read(frames[2])
        if batch is None:
            return None
        if self.last is None:
            self._rebuild(seq, batch, complete=seq == 0)
        elif seq == self.last[0] + 1:
            self._apply(seq, batch)
        elif seq <= self.last[0] and self._replayed.get(seq) == batch.ts:
            pass  # the last replay brought it already
        elif self.source.replay is not None:
            return seq > self.last[0]
        elif seq > self.last[0]:
            self._lost(f"batches {self.last[0] + 1} to {seq - 1} missed, and it has no replay socket")
            self._rebuild(seq, batch, complete=False)
        else:
            self._restarted()
            self._rebuild(seq, batch, complete=seq == 0)
        return None

    # -- replays -----------------------------------------------------------------------------------------
    async def catch_up(self) -> str | None:
        """Everything the engine published since the last batch applied, from its replay socket;
        from its first buffered batch when there is no last batch, or it is gone. Says how it
        went (CONTINUED, JOINED, GAP_LOST, RESTART), None when there was no answer."""
        if self.source.replay is None:
            if self.last is not None and self.index.state(self.engine) == STALE:
                self._stale(f"nothing heard for {self.index.stale_after_s:g}s, and it has no replay socket")
            return None
        outcome = JOINED
        replayed = await self._replay(self.last[0] if self.last is not None else 0)
        if replayed is None:
            return None
        if self.last is not None:
            first = replayed[0] if replayed else None
            if first is not None and (first[0], first[1].ts) == self.last:
                self._apply_all(replayed[1:])
                self.index.heard(self.engine)
                return CONTINUED
            if first is None or first[0] == self.last[0]:
                outcome = RESTART
                self._restarted()
            else:
                outcome = GAP_LOST
                self._lost(f"batches {self.last[0] + 1} to {first[0] - 1} are no longer buffered")
            replayed = await self._replay(0)
            if replayed is None:
                return None
        self.last = None
        if replayed:
            seq, batch = replayed[0]
            self._rebuild(seq, batch, complete=seq == 0)
            self._apply_all(replayed[1:])
        else:
            self.index.reset(self.engine, complete=True)  # it has published nothing yet
        self.index.heard(self.engine)
        return outcome

    async def _replay(self, start: int) -> list[tuple[int, Batch]] | None:
        """The batches from `start` on, in order; None when the socket does not answer (the
        engine turns stale) or answers what cannot be read."""
        assert self.source.replay is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        dealer.connect(self.source.replay)
        self._replayed = {}
        out: list[tuple[int, Batch]] = []
        try:
            self.counts.stream(self.engine[0], REPLAY)
            await asyncio.wait_for(dealer.send_multipart((b"", seq_bytes(start))), self.replay_timeout_s)
            while True:
                if not await dealer.poll(self.replay_timeout_s * 1000):
                    self._stale(f"its replay socket did not answer within {self.replay_timeout_s:g}s")
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    self._undecodable(f"a replay frame of {len(frames)} parts")
                    return None
                if frames[2] == END_SEQ:
                    return out
                seq = read_seq(frames[2])
                batch = self._read(frames[3])
                if batch is None:
                    return None
                out.append((seq, batch))
                if len(out) > MAX_REPLAY_BATCHES:
                    self._undecodable(f"a replay of more than {MAX_REPLAY_BATCHES} batches")
                    return None
                self._replayed[seq] = batch.ts
                if len(out) % BATCHES_PER_TURN == 0:
                    await asyncio.sleep(0)
        except TimeoutError:
            self._stale("its replay socket took no request")
            return None
        finally:
            dealer.close(linger=0)

    def _read(self, payload: bytes) -> Batch | None:
        """A batch as the wire carries it; None (the view dropped) when it cannot be read."""
        try:
            return decode(payload)
        except Undecodable as exc:
            self._undecodable(str(exc))
            return None

    # -- applying --------------------------------------------------------------------------------------
    def _apply(self, seq: int, batch: Batch) -> None:
        try:
            applied = self.index.apply(self.engine, batch.events)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            # The wire format takes fields vLLM never sends so (an extra key that is a number):
            # such a batch is one the proxy cannot read, not a reason for the feed to end.
            self._undecodable(f"{type(exc).__name__}: {exc}"[:200])
            return
        self.last = (seq, batch.ts)
        self.index.heard(self.engine)
        self.counts.applied(self.engine[0], applied)

    def _apply_all(self, batches: list[tuple[int, Batch]]) -> None:
        for seq, batch in batches:
            if self.last is not None and seq != self.last[0] + 1:
                self._lost(f"the replay skipped from {self.last[0]} to {seq}")
                self._rebuild(seq, batch, complete=False)
            else:
                self._apply(seq, batch)

    def _rebuild(self, seq: int, batch: Batch, *, complete: bool) -> None:
        self.index.reset(self.engine, complete=complete)
        self._apply(seq, batch)

    # -- trouble ---------------------------------------------------------------------------------------
    def _stale(self, why: str) -> None:
        if self.index.stale(self.engine, why):
            self.counts.stream(self.engine[0], STALE_TURNS)

    def _lost(self, why: str) -> None:
        self.counts.stream(self.engine[0], GAP_LOST)
        self._stale(f"history lost: {why}; rebuilt from what is buffered")

    def _restarted(self) -> None:
        self.counts.stream(self.engine[0], RESTART)
        log.info("KV events of %s rank %d: the publisher restarted; the view starts empty", *self.engine)

    def _undecodable(self, why: str) -> None:
        """A batch the proxy cannot read: what it changed is unknown, so the view is dropped and
        built again from the next batch on."""
        self.counts.stream(self.engine[0], UNDECODABLE)
        self._stale(f"a batch could not be read ({why})")
        self.index.reset(self.engine, complete=False)
        self.last = None
