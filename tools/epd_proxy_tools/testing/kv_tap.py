"""A test's subscriber to one engine's KV events, real vLLM or the fake: a ZMQ SUB socket on the
engine's publisher and a DEALER on its replay socket. Frames stay raw bytes; the test decodes them
with whichever classes it means to check against (vLLM's own, or the tooling's)."""

from __future__ import annotations

import time
from typing import NamedTuple

import zmq

from epd_proxy_tools.testing.fake_kv_events import END_SEQ


class Frames(NamedTuple):
    topic: bytes
    seq: int
    payload: bytes


def reachable(endpoint: str, host: str) -> str:
    """The address to connect to for an endpoint an engine bound: `tcp://*:P` is `tcp://host:P`."""
    return endpoint.replace("://*:", f"://{host}:", 1)


class KvTap:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self._ctx = zmq.Context()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def receive(self, timeout_s: float = 5.0) -> Frames | None:
        """The next batch published, or None if none came within `timeout_s`."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return Frames(topic, int.from_bytes(seq, "big"), payload)

    def drain(self, timeout_s: float = 0.2) -> list[Frames]:
        """Every batch that arrives until none has for `timeout_s`."""
        out = []
        while (frames := self.receive(timeout_s)) is not None:
            out.append(frames)
        return out

    def replay(self, start: int, timeout_s: float = 10.0) -> list[list[bytes]]:
        """The replay socket's whole answer to a request from seq `start`, each message's frames
        after the empty delimiter, the end marker (`[b"", END_SEQ, b""]`) last."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            answer: list[list[bytes]] = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not dealer.poll(100):
                    continue
                delimiter, *frames = dealer.recv_multipart()
                assert delimiter == b"", delimiter
                answer.append(frames)
                if frames[1:2] == [END_SEQ]:
                    return answer
            raise AssertionError(f"no end of replay within {timeout_s:g}s: {len(answer)} messages")
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self._ctx.term()
