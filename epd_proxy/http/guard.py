"""Each client connection's guard: an asyncio protocol in front of aiohttp's own, holding the
clocks and refusals aiohttp's public API has no knob for.

aiohttp's server is a protocol factory (`web.Server`); the guard is the protocol the event loop
talks to, and it hands every event on, bytes unchanged and uncopied, to the aiohttp protocol it
made. It reads the same bytes with its own httptools parser, which says where each request's head
begins and ends, and so:
- counts the connection against `ConnectionGate` (limits.py) at accept, and refuses it with a 503
  before aiohttp ever sees it;
- times the request head from accept, or on a kept-alive connection from the head's first byte,
  to its end: more header lines do not restart the clock (slowloris); a partial head gets a 408;
- closes a connection idle for the keep-alive timeout (aiohttp's own clock is set later, as a
  backstop), so that it is counted;
- refuses a head its parser refuses, or one beyond aiohttp's size limits (the same numbers), with
  a JSON 400 before aiohttp answers it in plain text.
The body clock runs in the reader (`read_chunks`): it only waits while the proxy wants bytes, so
time the proxy spends not reading never counts. `middleware` links each request to its guard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import httptools
from aiohttp import web

from epd_proxy.config import Config
from epd_proxy.errors import InternalError, ProxyError
from epd_proxy.http.limits import ConnectionGate
from epd_proxy.http.request_id import request_id

log = logging.getLogger("epd_proxy.server")


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Seconds; a header or body timeout of None disables that clock. The head's sizes are
    aiohttp's defaults, given to aiohttp too."""

    header_timeout_s: float | None = 60.0
    body_timeout_s: float | None = 60.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 0
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 128

    @classmethod
    def from_config(cls, config: Config) -> ClientLimits:
        return cls(
            header_timeout_s=config.client_header_timeout_s or None,
            body_timeout_s=config.client_body_timeout_s or None,
            keepalive_timeout_s=config.client_keepalive_timeout_s,
            max_connections=config.max_client_connections,
        )


class ClientTimeout(ProxyError):
    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(
            408, f"{what} within {seconds:g} s; closing the connection", stage="request", error_type="timeout"
        )


class _Refused(Exception):
    """A head beyond a size limit, raised out of a parser callback."""


def _raw_response(status: int, reason: str, error: ProxyError, extra: str = "") -> bytes:
    body = error.body()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + body


class ConnectionGuard(asyncio.Protocol):
    """One client connection: the gate, the head and idle clocks, then aiohttp's protocol."""

    def __init__(
        self,
        make_inner: Callable[[], asyncio.Protocol],
        limits: ClientLimits,
        gate: ConnectionGate,
        guards: set[ConnectionGuard],
    ) -> None:
        self._make_inner = make_inner
        self.limits = limits
        self._gate = gate
        self._guards = guards
        self._loop = asyncio.get_running_loop()
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        # Handlers of this connection inside the app (middleware): an answer is in the making.
        self.busy = 0
        self._in_head = False  # a head has begun and not ended
        self._in_message = False
        self._url_size = 0
        self._headers = 0
        self._refused: str | None = None
        self._clock: asyncio.TimerHandle | None = None
        self._clock_kind = ""

    # -- the event loop's side ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A listening server's connection: a stream transport, which writes.
        self._transport = stream = cast(asyncio.Transport, transport)
        if not self._gate.enter():
            # Answer without reading: the request may not even have arrived yet.
            refusal = ProxyError(
                503,
                f"the proxy is at its limit of {self._gate.limit} client connections; retry shortly",
                stage="admission",
                error_type="overloaded",
            )
            stream.write(_raw_response(503, "Service Unavailable", refusal, "Retry-After: 1\r\n"))
            stream.close()
            return
        self._guards.add(self)
        self._inner = self._make_inner()
        self._inner.connection_made(transport)
        # A fresh connection is on the header clock from accept (as in nginx), not the idle one.
        if self.limits.header_timeout_s is not None:
            self._arm("header", self.limits.header_timeout_s)
        else:
            self._arm("keepalive", self.limits.keepalive_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        inner, self._inner = self._inner, None
        self._transport = None
        if inner is None:
            return
        self._gate.leave()
        self._guards.discard(self)
        self._disarm()
        inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._refused is not None:
            return
        try:
            self._parse(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._refuse(str(cause) if isinstance(cause, _Refused) else f"malformed HTTP request: {exc}")
            return
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def _parse(self, data: bytes) -> None:
        while data:
            try:
                self._parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                # The app takes no upgrade; aiohttp reads on after one, and so does this parser.
                data = data[upgrade.args[0] :]

    # -- httptools callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = self._in_message = True
        self._url_size = self._headers = 0
        if self._clock_kind != "header":
            # The first byte of a kept-alive request ends the idle wait; now its head must arrive in time.
            if self.limits.header_timeout_s is not None:
                self._arm("header", self.limits.header_timeout_s)
            else:
                self._disarm()

    def on_url(self, url: bytes) -> None:
        self._url_size += len(url)
        if self._url_size > self.limits.max_line_size:
            raise _Refused(f"request target longer than {self.limits.max_line_size} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer
        self._headers += 1
        if self._headers > self.limits.max_headers:
            raise _Refused(f"more than {self.limits.max_headers} header fields")
        if max(len(name), len(value)) > self.limits.max_field_size:
            raise _Refused(f"a header field longer than {self.limits.max_field_size} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()

    def on_message_complete(self) -> None:
        self._in_message = False
        if not self.busy:
            self._arm("keepalive", self.limits.keepalive_timeout_s)

    # -- the app's side (middleware) -----------------------------------------------------------------

    def enter(self) -> None:
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1
        if not self.busy and not self._in_head:
            self._arm("keepalive", self.limits.keepalive_timeout_s)

    def body_timed_out(self) -> ClientTimeout:
        self._gate.timed_out("body")
        return ClientTimeout("no request body data received", self.limits.body_timeout_s or 0.0)

    def close(self) -> None:
        """Close once what is written is sent."""
        if self._transport is not None:
            self._transport.close()

    # -- clocks and refusals -------------------------------------------------------------------------

    def _arm(self, kind: str, seconds: float) -> None:
        if self._clock is not None:
            self._clock.cancel()
        self._clock = self._loop.call_later(seconds, self._expired)
        self._clock_kind = kind

    def _disarm(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None
        self._clock_kind = ""

    def _quiet(self) -> bool:
        """No answer in the making: the guard may write to the socket itself."""
        return not self.busy and self._transport is not None and not self._transport.get_write_buffer_size()

    def _expired(self) -> None:
        kind, self._clock = self._clock_kind, None
        transport = self._transport
        if transport is None:
            return
        if kind == "header":
            if not self._quiet():
                # A pipelined head behind a request still being answered: its clock starts over.
                self._arm(kind, self.limits.header_timeout_s or 0.0)
                return
            self._gate.timed_out("header")
            if self._in_head:
                timeout = ClientTimeout("request head not received", self.limits.header_timeout_s or 0.0)
                transport.write(_raw_response(408, "Request Timeout", timeout))
            # A connection that never sent a byte has nobody to answer; it is just closed.
            transport.close()
            return
        if not self._quiet() or self._in_message:
            # Not idle: a request is being answered, or a body aiohttp still reads.
            self._arm(kind, self.limits.keepalive_timeout_s)
            return
        self._gate.timed_out("keepalive")
        transport.close()

    def _refuse(self, message: str) -> None:
        """A head the server will not read: a JSON 400 once any answer before it is sent, then close."""
        self._refused = message
        self._disarm()
        if self._transport is None:
            return
        if not self._quiet():
            self._loop.call_later(0.05, self._refuse, message)
            return
        error = ProxyError(400, message, stage="request")
        self._transport.write(_raw_response(400, "Bad Request", error))
        self._transport.close()


# The guard of a request's connection, for the reader's body clock; and whether that clock ran out.
GUARD = web.RequestKey("epd_connection_guard", ConnectionGuard)
_TIMED_OUT = web.RequestKey("epd_body_timed_out", bool)


@web.middleware
async def middleware(request: web.Request, handler) -> web.StreamResponse:
    """The outermost middleware: links the request to its connection's guard, closes the
    connection after a body timeout's 408, and answers what escapes the app in JSON."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    if not isinstance(guard, ConnectionGuard):
        return await handler(request)
    request[GUARD] = guard
    guard.enter()
    try:
        try:
            response = await handler(request)
        except ClientTimeout as exc:
            response = _json(exc)
        except web.HTTPException:
            raise
        except Exception as exc:
            if request.writer.output_size > 0:
                raise  # the answer has begun: aiohttp closes the connection, nothing else can be said
            rid = request_id(request.headers)
            log.error("request %s: unexpected failure in %s %s", rid, request.method, request.path, exc_info=exc)
            response = _json(InternalError(rid.value))
        if request.get(_TIMED_OUT):
            # Nothing more will be read: answer, then close at once (no lingering read of the rest).
            if not response.prepared:
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
            guard.close()
        return response
    finally:
        guard.leave()


def _json(error: ProxyError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), content_type="application/json")


class _BodyClock:
    """At most `timeout_s` of waiting for one read, for the task that reads. One timer for the
    whole body, moved on lazily: a clock per read cost more than the guard itself."""

    __slots__ = ("_loop", "_task", "_timeout_s", "_handle", "since", "waiting", "fired")

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._timeout_s = timeout_s
        self.since = self._loop.time()
        self.waiting = self.fired = False
        self._handle = self._loop.call_at(self.since + timeout_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if not self.waiting:
            self._handle = self._loop.call_at(now + self._timeout_s, self._check)
        elif now < self.since + self._timeout_s:
            self._handle = self._loop.call_at(self.since + self._timeout_s, self._check)
        elif self._task is not None:
            self.fired = True
            self._task.cancel()

    def ran_out(self) -> bool:
        """After a cancellation: whether it was this clock's (and no one else's)."""
        return self.fired and self._task is not None and self._task.uncancel() == 0

    def stop(self) -> None:
        self._handle.cancel()


async def read_chunks(request: web.Request) -> AsyncIterator[bytes]:
    """The request body as it arrives, with the body clock (nginx's `client_body_timeout`):
    at most that long between two reads. The clock only runs while the reader waits for bytes."""
    guard = request.get(GUARD)
    timeout = guard.limits.body_timeout_s if guard is not None else None
    content = request.content
    chunk: bytes | None
    if guard is None or timeout is None:
        async for chunk in content.iter_any():
            yield chunk
        return
    loop = asyncio.get_running_loop()
    clock = _BodyClock(timeout)
    try:
        while True:
            clock.since, clock.waiting = loop.time(), True
            try:
                chunk = await content.readany()
            except asyncio.CancelledError:
                if not clock.ran_out():
                    raise
                chunk = None
            clock.waiting = False
            if chunk is None:
                # Raised outside the handler above, so the error keeps no context holding this frame.
                request[_TIMED_OUT] = True
                raise guard.body_timed_out()
            if not chunk:
                return
            yield chunk
    finally:
        clock.stop()
