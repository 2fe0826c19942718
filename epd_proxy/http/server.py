"""The client side of the HTTP server: aiohttp's own server, bounded against slow and greedy clients.

aiohttp has a knob for the idle kept-alive connection (`keepalive_timeout`) and none for the rest,
so this module narrows in where it must:
- `GuardedRequestHandler` (aiohttp's protocol) adds a clock for the request head, from accept or
  from the head's first byte until the head is parsed, and one between two reads of the body (nginx's
  `client_header_timeout` and `client_body_timeout`); it also counts the connection against
  `ConnectionGate` (limits.py) and refuses it at once when the gate is full.
- `GuardedAppRunner` makes aiohttp's server build that protocol.
- `run` replaces `web.run_app`; `start` serves an app in a running loop (tests).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from epd_proxy.config import Config
from epd_proxy.errors import InternalError, ProxyError
from epd_proxy.http.heap import HeapTrimmer
from epd_proxy.http.limits import ConnectionGate, GateCollector, GateCounters, PortConnections, raise_fd_limit
from epd_proxy.http.request_id import request_id
from epd_proxy.proxy import STATE

log = logging.getLogger("epd_proxy.server")


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Seconds; a header or body timeout of None disables that clock."""

    header_timeout_s: float | None = 60.0
    body_timeout_s: float | None = 60.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 0

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


def _raw_response(status: int, reason: str, error: ProxyError, extra: str = "") -> bytes:
    body = error.body()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + body


class GuardedRequestHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol with a head clock, a body clock and the connection gate."""

    def __init__(self, manager: Server, *, limits: ClientLimits, gate: ConnectionGate, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._gate = gate
        self._counted = False
        self._head_handle: asyncio.TimerHandle | None = None
        self._head_started = False
        self._body: Any = None
        self._body_last_read = 0.0
        self._body_handle: asyncio.TimerHandle | None = None
        self._body_timeout: ClientTimeout | None = None

    # -- connection life ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._gate.enter():
            # Answer without reading: the request may not even have arrived yet.
            refusal = ProxyError(
                503,
                f"the proxy is at its limit of {self._gate.limit} client connections; retry shortly",
                stage="admission",
                error_type="overloaded",
            )
            transport.write(_raw_response(503, "Service Unavailable", refusal, "Retry-After: 1\r\n"))
            transport.close()
            return
        self._counted = True
        super().connection_made(transport)
        if self._limits.header_timeout_s is not None:
            # A fresh connection is on the header clock from accept (as in nginx), not the idle one.
            self._stop_keepalive_clock()
            self._start_head_clock()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._gate.leave()
        self._cancel_clocks()
        self._body = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._force_close or self._close or self._upgraded or self._payload_parser is not None:
            super().data_received(data)
            return
        body = self._body
        if body is not None:
            self._body_last_read = self._loop.time()
        elif data and self._head_handle is None and self._limits.header_timeout_s is not None:
            # The first byte of a new request ends the idle wait; now its head must arrive in time.
            self._stop_keepalive_clock()
            self._start_head_clock()
        if data and body is None:
            self._head_started = True
        requests_before = self._request_count
        super().data_received(data)
        if self._request_count != requests_before:
            self._stop_head_clock()
            payload = self._messages[-1][1] if self._messages else None
            if payload is not None and not payload.is_eof() and self._limits.body_timeout_s is not None:
                self._body = payload
                self._body_last_read = self._loop.time()
                if self._body_handle is None:
                    self._body_handle = self._loop.call_at(
                        self._body_last_read + self._limits.body_timeout_s, self._body_clock
                    )
            else:
                self._body = None
        elif body is not None and body.is_eof():
            self._body = None

    # -- the clocks ----------------------------------------------------------------------------

    def _stop_keepalive_clock(self) -> None:
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None

    def _start_head_clock(self) -> None:
        self._head_handle = self._loop.call_later(self._limits.header_timeout_s, self._head_clock)

    def _stop_head_clock(self) -> None:
        if self._head_handle is not None:
            self._head_handle.cancel()
            self._head_handle = None
        self._head_started = False

    def _cancel_clocks(self) -> None:
        self._stop_head_clock()
        if self._body_handle is not None:
            self._body_handle.cancel()
            self._body_handle = None

    def _head_clock(self) -> None:
        self._head_handle = None
        if self.transport is None or self._force_close:
            return
        if self._request_in_progress or self._messages:
            # A pipelined head behind a request still being answered: its clock starts over.
            self._start_head_clock()
            return
        self._gate.timed_out("header")
        if self._head_started:
            timeout = ClientTimeout("request head not received", self._limits.header_timeout_s)
            self.transport.write(_raw_response(408, "Request Timeout", timeout))
        # A connection that never sent a byte has nobody to answer; it is just closed.
        self.force_close()

    def _body_clock(self) -> None:
        self._body_handle = None
        body = self._body
        if body is None or body.is_eof() or self.transport is None or not self._request_in_progress:
            # Answered already: aiohttp's lingering read (bounded by lingering_time) owns the rest.
            self._body = None
            return
        now = self._loop.time()
        timeout = self._limits.body_timeout_s
        if self._reading_paused or self._buffer_paused:
            # The proxy stopped reading (its buffer is full): the client is not the one stalling.
            self._body_last_read = now
        deadline = self._body_last_read + timeout
        if now < deadline:
            self._body_handle = self._loop.call_at(deadline, self._body_clock)
            return
        self._gate.timed_out("body")
        self._body = None
        # Nothing more will be read: no lingering for the rest of the body after the answer.
        self._lingering_time = 0.0
        self._body_timeout = ClientTimeout("no request body data received", timeout)
        body.set_exception(self._body_timeout)

    def _process_keepalive(self) -> None:
        was_open = not self._force_close
        super()._process_keepalive()
        if was_open and self._force_close:
            self._gate.timed_out("keepalive")

    # -- answers -------------------------------------------------------------------------------

    async def finish_response(self, request, resp, start_time):
        if self._body_timeout is None:
            return await super().finish_response(request, resp, start_time)
        resp.force_close()
        # Raised out of a future, the exception and the reader's frames form a cycle that holds the
        # half-read body until the next cyclic collection (rare: the worker raises gen0's threshold).
        self._body_timeout.__traceback__ = None
        return await super().finish_response(request, resp, start_time)

    def handle_error(self, request, status=500, exc=None, message=None):
        """aiohttp's answer for what never reached the app's middleware (a request its parser
        refused) or escaped it, in the proxy's JSON shape; a 5xx says nothing of the cause."""
        if isinstance(exc, ClientTimeout):
            # The body timeout let out of a handler (a plain `await request.read()`) by an app
            # without the proxy's middleware.
            error = exc
        elif status < 500 or request.writer.output_size > 0:
            # aiohttp's own logging, and its refusal once an answer has begun.
            super().handle_error(request, status, exc, message)
            error = ProxyError(status, message or HTTPStatus(status).phrase, stage="request")
        else:
            rid = request_id(request.headers)
            log.error("request %s: unexpected failure in %s %s", rid, request.method, request.path, exc_info=exc)
            error = InternalError(rid.value, status)
        resp = web.Response(status=error.status, body=error.body(), content_type="application/json")
        resp.force_close()
        return resp


class GuardedServer(Server):
    def __init__(self, handler, *, limits: ClientLimits, gate: ConnectionGate, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.gate = gate

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, limits=self.limits, gate=self.gate, **self._kwargs)


# The aiohttp releases the server has been tested with (pyproject.toml pins the same range): the
# classes above reach into aiohttp's private server internals, which change even between patch
# releases (_buffer_paused first appears in 3.14.4; 3.9 lacks three of the names below).
AIOHTTP_RANGE = ">=3.14.4,<3.15"
_SERVER_INTERNALS = ("_kwargs", "_loop", "request_handler", "request_factory", "handler_cancellation")
_HANDLER_INTERNALS = (
    "_buffer_paused",
    "_close",
    "_force_close",
    "_keepalive_handle",
    "_lingering_time",
    "_loop",
    "_messages",
    "_payload_parser",
    "_process_keepalive",
    "_reading_paused",
    "_request_count",
    "_request_in_progress",
    "_upgraded",
)


def check_aiohttp(plain: Server) -> None:
    """Refuse to serve, naming what is missing, on an aiohttp without the internals the guarded
    protocol uses; otherwise every request would fail with an AttributeError."""
    missing = [f"Server.{name}" for name in _SERVER_INTERNALS if not hasattr(plain, name)]
    if not missing:
        # A protocol instance, never connected: the names are set in its __init__.
        handler = plain()
        missing = [f"RequestHandler.{name}" for name in _HANDLER_INTERNALS if not hasattr(handler, name)]
    if missing:
        raise RuntimeError(
            f"aiohttp {aiohttp.__version__} lacks what epd-proxy's server uses ({', '.join(missing)}); "
            f"install aiohttp{AIOHTTP_RANGE}"
        )


class GuardedAppRunner(web.AppRunner):
    """aiohttp's AppRunner, whose server builds GuardedRequestHandler protocols."""

    def __init__(self, app: web.Application, *, limits: ClientLimits, gate: ConnectionGate, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout_s, **kwargs)
        self.limits = limits
        self.gate = gate
        self._trimmer: asyncio.Task | None = None

    async def setup(self) -> None:
        await super().setup()
        self._trimmer = asyncio.create_task(HeapTrimmer().run())

    async def cleanup(self) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
            await asyncio.gather(self._trimmer, return_exceptions=True)
        await super().cleanup()

    async def _make_server(self) -> Server:
        plain = await super()._make_server()
        check_aiohttp(plain)
        # Same handler, request factory and protocol options as aiohttp's own server.
        return GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            limits=self.limits,
            gate=self.gate,
            **plain._kwargs,
        )


async def start(
    app: web.Application,
    limits: ClientLimits,
    *,
    host: str,
    port: int,
    reuse_port: bool = False,
    shared: PortConnections | None = None,
) -> tuple[GuardedAppRunner, web.TCPSite]:
    """Serve `app` with `limits` in the running loop; the caller cleans up with
    `await runner.cleanup()`."""
    metrics = app[STATE].metrics if STATE in app else None
    if shared is not None:
        shared.claim()
    gate = ConnectionGate(limits.max_connections, shared, GateCounters(metrics.registry if metrics else None))
    if metrics is not None:
        metrics.read_at_scrape(GateCollector(gate))
    runner = GuardedAppRunner(
        app,
        limits=limits,
        gate=gate,
        access_log=None,
        # A client that disconnects cancels its handler, which cancels every backend call it made.
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    return runner, site


def run(app: web.Application, limits: ClientLimits, **where: Any) -> None:
    """`web.run_app` with the client limits, listening where `start`'s keywords say (host, port,
    reuse_port, shared); returns on SIGTERM or SIGINT after a graceful shutdown."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner, site = await start(app, limits, **where)
        logging.getLogger("epd_proxy").info("serving on %s", site.name)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    if limits.max_connections:
        raise_fd_limit(limits.max_connections + 1024)
    asyncio.run(main())
