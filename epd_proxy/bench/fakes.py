"""Lean fake vLLM encoder and PD servers with a cost model, all hosted by one process.

Run as `python -m epd_proxy.bench.fakes '<json spec>'`; it prints one JSON line with the bound
ports, serves until SIGTERM or until its parent exits. Spec: {"servers": [{"name", "role":
"encode"|"pd", "per_request_ms", "per_image_ms", "delay_ms"}, ...]}.

Unlike epd_proxy.testing.fake_vllm these do not parse the body: an encoder only scans for the
`"uuid":"` keys the proxy adds to each item, which is all it needs to answer in the real wire
format. Counters are kept per request-id tag (the first character of x-request-id, which the
load generator sets to w/m/c for warm-up, measured and cool-down) so the harness can count
exactly the measured round.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import time
from collections import defaultdict

import orjson

from epd_proxy.bench.http11 import ServerProtocol, header, response

UUID_KEY = b'"uuid":"'
STREAM_KEY = b'"stream":true'
OK_EMPTY = response(200, b"")


def _grid(uuid: bytes) -> list[int]:
    d = hashlib.blake2s(uuid, digest_size=2).digest()
    return [1, 2 * (4 + d[0] % 12), 2 * (4 + d[1] % 12)]


def scan_uuids(body: bytes) -> list[bytes]:
    """Item uuids in item order. The proxy writes each item's uuid after its media, and base64
    never contains a quote, so a byte scan cannot be fooled by image data."""
    found = []
    at = body.find(UUID_KEY)
    while at >= 0:
        start = at + len(UUID_KEY)
        end = body.find(b'"', start)
        if end < 0:
            break
        found.append(body[start:end])
        at = body.find(UUID_KEY, end)
    return found


def _raw_item_keys(body: bytes) -> list[bytes]:
    """--no-rewrite sends items without uuids: the engine then hashes the media itself."""
    parsed = orjson.loads(body)
    keys = []
    for part in parsed["messages"][0]["content"]:
        kind = part.get("type")
        if isinstance(kind, str) and kind.endswith("_url"):
            keys.append(hashlib.sha256(orjson.dumps(part.get(kind), option=orjson.OPT_SORT_KEYS)).hexdigest().encode())
    return keys


class Counters:
    def __init__(self) -> None:
        self.requests: dict[str, int] = defaultdict(int)
        self.images: dict[str, int] = defaultdict(int)
        self.raw_images: dict[str, int] = defaultdict(int)
        self.bytes_in: dict[str, int] = defaultdict(int)

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "images": self.images,
            "raw_images": self.raw_images,
            "bytes_in": self.bytes_in,
        }


def _tag(head: bytes) -> str:
    rid = header(head, b"x-request-id:")
    return rid[:1].decode("ascii", "replace") if rid else "?"


def _route(head: bytes) -> bytes:
    sp = head.find(b" ")
    return head[:sp] + b" " + head[sp + 1 : head.find(b" ", sp + 1)]


class FakeServer:
    def __init__(
        self, name: str, role: str, per_request_ms: float = 0.0, per_image_ms: float = 0.0, delay_ms: float = 0.0
    ) -> None:
        self.name = name
        self.role = role
        self.per_request_s = per_request_ms / 1000
        self.per_image_s = per_image_ms / 1000
        self.delay_s = delay_ms / 1000
        self.counters = Counters()
        # The encoder is a single GPU: requests run back to back. Tracking when it becomes free
        # on an exact clock (instead of lock + sleep) keeps timer rounding (1 ms in the event
        # loop) from adding up across queued requests.
        self.busy_until = 0.0
        self.completions = 0

    def handle(self, head: bytes, body: bytes):
        route = _route(head)
        if route == b"POST /v1/chat/completions":
            return self.encode(head, body) if self.role == "encode" else self.consume(head, body)
        if route == b"GET /stats":
            return response(200, orjson.dumps({"name": self.name, "role": self.role, **self.counters.as_dict()}))
        if route == b"GET /health":
            return OK_EMPTY
        if route == b"GET /v1/models":
            return response(200, b'{"object":"list","data":[{"id":"bench-vlm","object":"model"}]}')
        if route in (b"POST /start_profile", b"POST /stop_profile"):
            return OK_EMPTY
        return response(404, b'{"error":"not found"}')

    def _later(self, delay: float, payload: bytes):
        if delay <= 0:
            return payload
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_later(delay, fut.set_result, payload)
        return fut

    def encode(self, head: bytes, body: bytes):
        tag = _tag(head)
        keys = scan_uuids(body)
        if not keys:
            keys = _raw_item_keys(body)
        c = self.counters
        c.requests[tag] += 1
        c.images[tag] += len(keys)
        c.bytes_in[tag] += len(body)
        params: dict[str, dict] = {}
        for position, key in enumerate(keys):
            k = key.decode()
            entry = params.get(k)
            if entry is None:
                entry = params[k] = {"metadata": {"image_grid_thw": [_grid(key)]}, "item_indices": []}
            entry["item_indices"].append(position)
        self.completions += 1
        payload = response(
            200,
            orjson.dumps(
                {
                    "id": f"chatcmpl-enc-{self.completions}",
                    "object": "chat.completion",
                    "model": "bench-vlm",
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
                    "ec_transfer_params": params or None,
                }
            ),
        )
        cost = self.per_request_s + self.per_image_s * len(keys)
        if cost <= 0:
            return payload
        now = time.monotonic()
        self.busy_until = max(now, self.busy_until) + cost
        return self._later(self.busy_until - now, payload)

    def consume(self, head: bytes, body: bytes):
        tag = _tag(head)
        c = self.counters
        c.requests[tag] += 1
        c.images[tag] += body.count(b'"image_embeds"')
        c.raw_images[tag] += body.count(b'"image_url"')
        c.bytes_in[tag] += len(body)
        self.completions += 1
        if STREAM_KEY in body:
            return self._stream()
        payload = response(
            200,
            b'{"id":"chatcmpl-pd-%d","object":"chat.completion","model":"bench-vlm",'
            b'"choices":[{"index":0,"message":{"role":"assistant","content":"fine"},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":64,"completion_tokens":1,'
            b'"total_tokens":65}}' % self.completions,
        )
        return self._later(self.delay_s, payload)

    def _stream(self):
        """A long stream: the role event and the first token at once, the rest after the delay
        (an answer being generated), so a proxy holds each streamed request that long."""
        n = self.completions
        head = b'data: {"id":"chatcmpl-pd-%d","object":"chat.completion.chunk","model":"bench-vlm","choices":' % n
        first = (
            head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
            b"" + head + b'[{"index":0,"delta":{"content":"fi"},"finish_reason":null}]}\n\n'
        )
        rest = head + b'[{"index":0,"delta":{"content":"ne"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        whole = response(200, first + rest, b"text/event-stream")
        split = len(whole) - len(rest)
        return whole[:split], self._later(self.delay_s, whole[split:])


async def serve(spec: dict) -> None:
    loop = asyncio.get_running_loop()
    ports = {}
    servers = []
    for entry in spec["servers"]:
        fake = FakeServer(
            entry["name"],
            entry["role"],
            entry.get("per_request_ms", 0.0),
            entry.get("per_image_ms", 0.0),
            entry.get("delay_ms", 0.0),
        )
        server = await loop.create_server(
            lambda f=fake: ServerProtocol(f.handle), "127.0.0.1", entry.get("port", 0), backlog=1024
        )
        servers.append(server)
        ports[entry["name"]] = server.sockets[0].getsockname()[1]
    sys.stdout.write(orjson.dumps({"ports": ports}).decode() + "\n")
    sys.stdout.flush()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, lambda: stop.done() or stop.set_result(None))
    loop.add_signal_handler(signal.SIGINT, lambda: stop.done() or stop.set_result(None))
    parent = os.getppid()
    # An orphaned fake would hold its ports forever: leave when the harness is gone.
    while not stop.done() and os.getppid() == parent:
        await asyncio.wait([stop], timeout=1.0)
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = orjson.loads(argv[0])
    try:
        import uvloop

        uvloop.run(serve(spec))
    except ImportError:
        asyncio.run(serve(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
