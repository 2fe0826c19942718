"""What the language-model engines' KV caches stored and evicted, counted from their own KV events.

vLLM publishes a `BlockStored` for every block it caches and a `BlockRemoved` for every cached block
it evicts to make room (and `AllBlocksCleared` on a cache reset, which is not an eviction). The
bench subscribes to every consumer's publisher beside the proxies (a PUB socket sends every batch
to every subscriber) and reads the counts before and after each block: evicted blocks per stored
block is the eviction rate, the same measure for every arm whatever the proxy does.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import zmq

from epd_proxy.fleet.kv_wire import BlockRemoved, BlockStored, Undecodable, decode

STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True)
class Tally:
    stored: int = 0
    removed: int = 0

    def minus(self, earlier: Tally) -> Tally:
        return Tally(self.stored - earlier.stored, self.removed - earlier.removed)

    @property
    def eviction_rate(self) -> float | None:
        return self.removed / self.stored if self.stored else None


def count_batch(payload: bytes) -> Counter[str]:
    """Blocks stored and removed in one published batch; nothing for one that does not decode."""
    counts: Counter[str] = Counter()
    try:
        batch = decode(payload)
    except Undecodable:
        return counts
    for event in batch.events:
        if isinstance(event, BlockStored):
            counts[STORED] += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            counts[REMOVED] += len(event.block_hashes)
    return counts


class KvEventCounter:
    """One subscriber thread over every engine's events endpoint (`tcp://host:port`, by name).

    ZMQ reconnects on its own, so an engine restarted on the same port is counted again once its
    new publisher is up; what was published while the subscriber was away is not counted."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self._counts = {name: Counter[str]() for name in endpoints}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context.instance()
        self._sockets = {}
        for name, endpoint in endpoints.items():
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._sockets[sock] = name
        self._thread = threading.Thread(target=self._run, name="kv-event-counter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                # vLLM's frames: topic, sequence number, payload.
                frames = sock.recv_multipart()
                counts = count_batch(frames[-1])
                with self._lock:
                    self._counts[self._sockets[sock]].update(counts)

    def snapshot(self) -> dict[str, Tally]:
        with self._lock:
            return {name: Tally(c[STORED], c[REMOVED]) for name, c in self._counts.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()
