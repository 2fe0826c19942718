"""The one backend-call layer: every stage, the prober and the admin endpoints call backends here.

It owns what each caller used to do on its own: the connection pool (keep-alive shorter than the
backends' idle timeout, an optional cap per backend), the connect / pool-wait / headers / per-chunk
idle timeouts, in-flight counting, cancellation (a cancelled call closes its connection), streaming
the answer chunk by chunk, and one classification of what happened. A caller gets either an
`Answer` (the backend answered with some status) or a `NoAnswer` that says which kind of
"no answer" it was; it never handles a timeout or a client-library exception itself.

A second pool (health probes on their own small connector, never limited by
`--max-connections-per-backend`) is just another `Upstream`.

The answers and the call's bookkeeping are answer.py's; this module is the pool. Underneath is a lean HTTP/1.1 client (connection.py: an asyncio.Protocol per connection feeding
httptools' parser, the C parser uvicorn uses), chosen by measurement over aiohttp's client, which
cost the proxy about as much CPU per request as everything else it does (see docs/benchmark.md).
Answers are handed on as the chunks the socket gave, and nothing is decompressed, so relayed bytes
are exactly what the backend wrote.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from epd_proxy.calls.answer import (
    BEFORE_SENDING,
    BROKEN,
    CONNECT_TIMEOUT,
    HEADERS_TIMEOUT,
    IDLE_TIMEOUT,
    POOL_TIMEOUT,
    REFUSED,
    REFUSED_ANSWER,
    RESET,
    TIMEOUTS,
    Answer,
    Call,
    NoAnswer,
    Payload,
    Target,
    Timeouts,
    kind_of,
)
from epd_proxy.calls.connection import BODY_TOO_LARGE, Closed, Connection, Limits

# Headers every call made in this context carries on top of its own: the open tracing span's
# `traceparent` (ops/tracing.py), so the engines' spans join the request's trace.
CONTEXT_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar("context_headers", default=None)

# The layer's whole vocabulary, so a caller imports the backend calls from one place.
__all__ = [
    "BEFORE_SENDING",
    "BODY_TOO_LARGE",
    "BROKEN",
    "CONNECT_TIMEOUT",
    "HEADERS_TIMEOUT",
    "IDLE_TIMEOUT",
    "POOL_TIMEOUT",
    "REFUSED",
    "REFUSED_ANSWER",
    "RESET",
    "TIMEOUTS",
    "Answer",
    "Limits",
    "NoAnswer",
    "Payload",
    "Target",
    "Timeouts",
    "Upstream",
    "bearer",
]


class _Origin:
    """Where a base URL's connections go, and the request head lines that never change for it."""

    __slots__ = ("host", "port", "ssl", "host_line", "idle")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if secure else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if secure else None
        self.host_line = f"Host: {parts.netloc}\r\n".encode("latin-1")
        # Most recently used last: reusing the freshest connection is least likely to hit one the
        # backend is just closing.
        self.idle: list[Connection] = []


class Upstream:
    """A connection pool to the backends and the only way to call them."""

    def __init__(
        self,
        *,
        keep_alive_s: float | None = 2.5,
        max_connections_per_backend: int = 0,
        headers: Mapping[str, str] | None = None,
        count_inflight: bool = True,
        limits: Limits = Limits(),
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        # Idle connections retire before the backend (uvicorn, 5 s) drops them, so a reused
        # connection is almost never one the server already closed, and one that is readable or
        # at EOF is never taken (see Connection.looks_idle).
        self.keep_alive_s = keep_alive_s
        self.limits = limits
        # Told (stage, reason) of every answer refused; the metrics count them.
        self._on_refused = on_refused
        self.max_connections_per_backend = max_connections_per_backend
        self.count_inflight = count_inflight
        self._fixed = dict(headers or {})
        self._fixed_names = {name.lower() for name in self._fixed}
        self._fixed_headers = _header_lines(self._fixed)
        self._origins: dict[str, _Origin] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._in_use = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    def connections_in_use(self) -> int:
        return self._in_use

    def _refused(self, stage: str, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(stage, reason)

    # -- membership events (a registry watcher): an instance that left keeps no pool state ----------
    def joined(self, inst: Target) -> None:
        pass

    def rejoined(self, inst: Target) -> None:
        pass

    def left(self, inst: Target) -> None:
        origin = self._origins.pop(inst.url, None)
        self._slots.pop(inst.url, None)  # calls under way hold their own reference to it
        if origin is not None:
            for conn in list(origin.idle):
                conn.parked_in = None
                conn.abort()
            origin.idle.clear()

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for origin in self._origins.values():
            for conn in list(origin.idle):
                conn.parked_in = None
                conn.abort()
            origin.idle.clear()

    async def call(self, target: Target, method: str, path: str, **options: Any) -> Answer:
        """Send and read the whole answer, whatever its status; the options are `open`'s. The body
        is capped (`max_body`, by default the pool's `Limits.buffered_body_bytes`)."""
        options.setdefault("max_body", self.limits.buffered_body_bytes)
        answer = await self.open(target, method, path, **options)
        try:
            await answer.read()
        finally:
            answer.release()
        return answer

    async def open(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        body: Payload | None = None,
        headers: Mapping[str, str] | None = None,
        timeouts: Timeouts,
        stage: str,
        what: str,
        count_inflight: bool | None = None,
        idempotent: bool | None = None,
        max_body: int | None = None,
    ) -> Answer:
        """Send and wait for the status line and headers; the body is left to stream. The caller
        must `release()` the answer (or use it as an async context manager). `body` may be a
        list of byte strings, written back to back without joining them.

        Exactly once: a request of which any byte was written is never sent again here unless it
        is `idempotent` (GET by default; an encoder sub-request says so, since the same uuid gives
        the same embedding). A generation is resent only by the pipeline's own, counted retries.
        """
        if method == "HEAD":
            raise ValueError("HEAD is not supported: its answer has no body whatever its framing says")
        if (extra := CONTEXT_HEADERS.get()) is not None:
            headers = {**headers, **extra} if headers else extra
        call = Call(target, stage, what, timeouts, self.count_inflight if count_inflight is None else count_inflight)
        call.begin()
        if idempotent is None:
            idempotent = method == "GET"
        try:
            await self._acquire_slot(call)
            conn = await self._exchange(call, method, path, body, headers, idempotent, max_body)
        except BaseException:
            call.end()
            raise
        return Answer(conn, call, self)

    async def _acquire_slot(self, call: Call) -> None:
        cap = self.max_connections_per_backend
        if cap <= 0:
            return
        slot = self._slots.get(call.target.url)
        if slot is None:
            slot = self._slots[call.target.url] = asyncio.Semaphore(cap)
        if slot.locked():
            limit, reported = call.budget(call.timeouts.pool)
            try:
                async with asyncio.timeout(limit):
                    await slot.acquire()
            except TimeoutError:
                raise call.failure(POOL_TIMEOUT, "", reported) from None
        else:
            await slot.acquire()  # free: returns without suspending
        call.slot = slot

    async def _exchange(
        self, call: Call, method: str, path: str, body, headers, idempotent: bool, max_body: int | None
    ) -> Connection:
        url = call.target.url
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(url)
        parts = body if isinstance(body, list) else [body] if body else []
        size = sum(len(part) for part in parts)
        head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), origin.host_line]
        if not headers:
            head.append(self._fixed_headers)
        elif self._fixed_names.isdisjoint(name.lower() for name in headers):
            head += (self._fixed_headers, _header_lines(headers))
        else:  # the call's own value of a pool-wide header (a different Authorization) wins
            overridden = {name.lower() for name in headers}
            kept = {name: value for name, value in self._fixed.items() if name.lower() not in overridden}
            head.append(_header_lines({**kept, **headers}))
        if size or method != "GET":
            head.append(b"Content-Length: %d\r\n" % size)
        head.append(b"\r\n")
        request = [b"".join(head), *parts]
        fresh = False
        # Whether any try wrote a byte: a request resent on a fresh connection may already have
        # been read on the one that closed.
        sent = False
        while True:
            conn = await self._connection(call, origin, fresh, sent)
            self._in_use += 1
            limit, reported = call.budget(call.timeouts.headers)
            try:
                conn.begin(call.stage, max_body)
                # One limit for writing the request and the whole head, however slowly either goes.
                async with asyncio.timeout(limit):
                    try:
                        await conn.send(request, size)
                    except (RuntimeError, OSError) as exc:  # closed under us since it was parked
                        raise Closed(_describe(exc), False) from None
                    while not conn.headers_done:
                        if conn.failure is not None:
                            raise conn.failure
                        await conn.wait(None)
                return conn
            except Closed as closed:
                self.give_back(url, conn, False)
                sent = sent or conn.wrote
                if conn.reused and not closed.answered and not fresh and (idempotent or not conn.wrote):
                    fresh = True  # the backend dropped an idle connection just as we took it
                    continue
                raise call.failure(kind_of(closed), closed.detail, sent=sent) from None
            except TimeoutError:
                self.give_back(url, conn, False)
                raise call.failure(HEADERS_TIMEOUT, "", reported, sent=sent or conn.wrote) from None
            except BaseException:
                self.give_back(url, conn, False)
                raise

    async def _connection(self, call: Call, origin: _Origin, fresh: bool, sent: bool) -> Connection:
        """A pooled connection unless `fresh`, else a new one; `sent`: an earlier try of this call
        already wrote its request, which a failure to connect now does not undo."""
        idle = origin.idle
        if idle and not fresh:
            oldest_allowed = time.monotonic() - (self.keep_alive_s or 0)
            while idle:
                conn = idle.pop()
                conn.parked_in = None
                if conn.idle_since < oldest_allowed or not conn.looks_idle():
                    conn.abort()
                    continue
                conn.reused = True
                return conn
        loop = asyncio.get_running_loop()
        limit, reported = call.budget(call.timeouts.connect)
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop, self.limits, self._refused),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl else None,
                )
        except TimeoutError:
            raise call.failure(CONNECT_TIMEOUT, "", reported, sent=sent) from None
        except OSError as exc:
            raise call.failure(REFUSED, _describe(exc), sent=sent) from None
        return conn

    def give_back(self, url: str, conn: Connection, reuse: bool) -> None:
        self._in_use -= 1
        origin = self._origins.get(url)
        if not reuse or self.keep_alive_s is None or self._closed or origin is None:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        conn.parked_in = origin.idle
        origin.idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keep_alive_s, self._close_expired)

    def _close_expired(self) -> None:
        """Close connections idle for longer than keep-alive, so none outlives the backend's patience
        and an idle proxy holds no sockets."""
        self._sweep = None
        keep_alive_s = self.keep_alive_s
        if keep_alive_s is None:  # nothing was parked: give_back closes every connection
            return
        oldest_allowed = time.monotonic() - keep_alive_s
        remaining = False
        for origin in self._origins.values():
            keep = []
            for conn in origin.idle:
                if conn.idle_since < oldest_allowed or conn.lost:
                    conn.parked_in = None
                    conn.abort()
                else:
                    keep.append(conn)
            origin.idle[:] = keep
            for conn in keep:
                conn.parked_in = origin.idle
            remaining = remaining or bool(keep)
        if remaining:
            self._sweep = asyncio.get_running_loop().call_later(keep_alive_s / 2, self._close_expired)


def _header_lines(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    # As aiohttp's server decoded them, so a client's request id goes on byte for byte.
    return "".join(lines).encode("utf-8", "surrogateescape")


def _describe(exc: BaseException) -> str:
    """`ConnectionRefusedError: [Errno 111] ...` rather than a repr full of internals."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bearer(key: str) -> dict[str, str]:
    """The header that carries `key` to a backend (vLLM's `--api-key`); none without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}
