"""A lean HTTP/1.1 server: an asyncio.Protocol over httptools' request parser and little else (no
limits, timeouts or flow control), for the processes the benchmark hosts next to the proxy.

aiohttp's server costs about 0.15 ms of Python per message; at a few hundred proxied requests per
second, each several messages to the fakes, that would make the harness's core, not the proxy, the
limit of the saturation arm. What this server skips is what only hostile or huge peers need: its
peers are the proxy and the load generator on the same machine.

A handler takes an `Exchange` and answers through it; it may return an awaitable, which then runs
as a task. One connection serves its requests one at a time and in order, as HTTP/1.1 requires.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools

Handler = Callable[["Exchange"], Awaitable[None] | None]

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


def _head(status: int, content_type: str | None, framing: bytes) -> bytes:
    head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    if content_type:
        head += b"Content-Type: " + content_type.encode("latin-1") + b"\r\n"
    return head + framing + b"\r\n"


class Exchange:
    """One request (method, path, lowercase header names, whole body) and the means to answer it:
    `reply` at once, or `start`, `write` and `end` a chunked body. `drop` closes the connection;
    `gone` says whether the caller has gone away."""

    __slots__ = ("method", "path", "headers", "body", "_protocol", "_keep_alive")

    def __init__(self, protocol: _Protocol, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.method, self.path, self.headers, self.body = method, path, headers, body
        self._protocol = protocol
        self._keep_alive = protocol.parser.should_keep_alive()

    @property
    def gone(self) -> bool:
        transport = self._protocol.transport
        return transport is None or transport.is_closing()

    def reply(self, status: int, body: bytes = b"", content_type: str | None = None) -> None:
        self._send(_head(status, content_type, b"Content-Length: %d\r\n" % len(body)) + body)
        self._finish()

    async def start(self, status: int, content_type: str | None = None) -> None:
        self._send(_head(status, content_type, b"Transfer-Encoding: chunked\r\n"))

    async def write(self, data: bytes) -> None:
        # An empty chunk would end the body.
        if data:
            self._send(b"%x\r\n%s\r\n" % (len(data), data))

    async def end(self) -> None:
        self._send(b"0\r\n\r\n")
        self._finish()

    def drop(self) -> None:
        if self._protocol.transport is not None:
            self._protocol.transport.close()

    def _send(self, data: bytes) -> None:
        if self.gone:
            # What aiohttp raises on a write to a closed connection, so a handler sees one failure.
            raise ConnectionResetError("the caller has gone away")
        self._protocol.transport.write(data)

    def _finish(self) -> None:
        if not self._keep_alive:
            self.drop()


class _Protocol(asyncio.Protocol):
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[Exchange] = deque()
        self.busy = False
        self._reset()

    def _reset(self) -> None:
        self.url, self.headers, self.body = b"", {}, []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_head(400, None, b"Content-Length: 0\r\nConnection: close\r\n"))
                self.transport.close()

    # httptools' callbacks; the URL may arrive in pieces.
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        path = self.url.partition(b"?")[0].decode("latin-1")
        method = self.parser.get_method().decode("latin-1")
        self.pending.append(Exchange(self, method, path, self.headers, b"".join(self.body)))
        self._reset()
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while self.pending:
            result = self.handler(self.pending.popleft())
            if result is not None:
                self.busy = True
                asyncio.ensure_future(result).add_done_callback(self._done)
                return

    def _done(self, task: asyncio.Future) -> None:
        self.busy = False
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or exc is not None:
            if exc is not None and not isinstance(exc, ConnectionError):
                asyncio.get_running_loop().call_exception_handler({"message": "handler failed", "exception": exc})
            # The answer may have broken off mid-body: the connection cannot carry another one.
            if self.transport is not None:
                self.transport.close()
            return
        self._next()


async def start_server(handler: Handler, host: str, port: int) -> asyncio.Server:
    """Listen on host:port (0: any free port) and serve each request with `handler`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Protocol(handler), host, port, backlog=1024)
