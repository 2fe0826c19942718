"""The client side of the HTTP server: aiohttp's own server, bounded against slow and greedy clients.

aiohttp has a knob for the idle kept-alive connection (`keepalive_timeout`) and none for the rest,
so this module narrows in where it must:
- `GuardedRequestHandler` (aiohttp's protocol) adds a clock for the request head, from accept or
  from the head's first byte until the head is parsed, and one between two reads of the body (nginx's
  `client_header_timeout` and `client_body_timeout`); it also counts the connection against
  `ConnectionGate` and refuses it at once when the gate is full.
- `GuardedAppRunner` makes aiohttp's server build that protocol.
- `run` replaces `web.run_app`; `start` serves an app in a running loop (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import os
import resource
import signal
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from epd_proxy.config import Config
from epd_proxy.errors import InternalError, ProxyError
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


class PortConnections:
    """The open client connections of a port that several worker processes serve (--workers).

    Each worker counts its own in a slot of an array in shared memory and admits a connection only
    while all the slots together are under the limit. A worker that dies cannot take its count
    back, so the parent does when it reaps it (`release`). The check holds an flock(2), which the
    kernel drops with a process that dies holding it: a multiprocessing lock taken by a killed
    worker would stay taken, and no worker could admit anyone again."""

    def __init__(self, slots: Any, lock_path: str, slot: int = -1) -> None:
        self._slots = slots
        self._lock_path = lock_path
        self._slot = slot
        self._lock_fd: int | None = None

    @classmethod
    def create(cls, ctx: Any, workers: int, lock_path: str) -> PortConnections:
        """The parent's view, over a new array of `workers` slots; `ctx` is a multiprocessing context."""
        return cls(ctx.RawArray("q", workers), lock_path)

    def worker(self, slot: int) -> PortConnections:
        """The view worker `slot` counts through, handed to its process when it starts."""
        return PortConnections(self._slots, self._lock_path, slot)

    def release(self, slot: int) -> None:
        """Stop counting the connections of worker `slot`, which has exited."""
        self._slots[slot] = 0

    @property
    def total(self) -> int:
        return sum(self._slots)

    @contextlib.contextmanager
    def _locked(self):
        if self._lock_fd is None:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def enter(self, limit: int) -> bool:
        with self._locked():
            if limit and sum(self._slots) >= limit:
                return False
            self._slots[self._slot] += 1
            return True

    def leave(self) -> None:
        # Only this worker writes its slot while it lives; a check that reads the old value a
        # moment longer only refuses a connection it could have taken.
        self._slots[self._slot] -= 1


class GateCounters:
    """What the gate counts. Prometheus counters, so that with --workers they live in the shared
    files (see metrics.py): /metrics adds every worker's up, a dead one's included."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.refused = Counter(
            "epd_client_connections_refused",
            "Client connections closed at accept by --max-client-connections",
            registry=registry,
        )
        timeouts = Counter(
            "epd_client_timeouts", "Client connections closed by a client-side timeout", ["kind"], registry=registry
        )
        self.timeouts = {kind: timeouts.labels(kind) for kind in ("header", "body", "keepalive")}


class ConnectionGate:
    """Open client connections against a limit: this process's, or with --workers the port's
    (`PortConnections`), so the limit holds for the port whichever worker the kernel picked."""

    def __init__(self, limit: int, shared: PortConnections | None = None, counters: GateCounters | None = None) -> None:
        self.limit = limit
        self._shared = shared
        self._local = 0
        self.counters = counters or GateCounters(None)

    @property
    def open(self) -> int:
        return self._shared.total if self._shared is not None else self._local

    def enter(self) -> bool:
        if self._shared is not None:
            admitted = self._shared.enter(self.limit)
        elif admitted := not self.limit or self._local < self.limit:
            self._local += 1
        if not admitted:
            self.counters.refused.inc()
        return admitted

    def leave(self) -> None:
        if self._shared is not None:
            self._shared.leave()
        else:
            self._local -= 1

    def timed_out(self, kind: str) -> None:
        self.counters.timeouts[kind].inc()


class GateCollector:
    """The open connections and their limit for /metrics, read at scrape time; the same whichever
    worker is asked."""

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate

    def collect(self):
        gate = self._gate
        yield GaugeMetricFamily(
            "epd_client_connections", "Open client connections (all workers of this port)", value=gate.open
        )
        yield GaugeMetricFamily(
            "epd_client_connections_limit", "--max-client-connections (0 = unlimited)", value=gate.limit
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
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            log.error("request %s: unexpected failure in %s %s", request_id, request.method, request.path, exc_info=exc)
            error = InternalError(request_id, status)
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


class HeapTrimmer:
    """Gives memory glibc holds free back to the system.

    Request bodies are large buffers; once a burst of uploads is gone glibc keeps their memory in
    its heap for reuse (measured: 56 MB kept after 200 uploads of 300 KB), so RSS would stay at
    the peak. malloc_trim(0) returns it in well under a millisecond; it runs only when glibc holds
    more than `threshold` bytes free. The threshold is well below what "given back" is held to
    (within 8 MB of the baseline, tests/http/test_slow_clients.py): at 8 MiB, free memory just
    under it was kept and RSS stayed 9 MB up in a full test run. A no-op without glibc."""

    def __init__(self, interval_s: float = 2.0, threshold: int = 2 << 20) -> None:
        self.interval_s = interval_s
        self.threshold = threshold
        self._trim = self._free = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self._trim = libc.malloc_trim
            self._trim.argtypes = [ctypes.c_size_t]
            mallinfo2 = libc.mallinfo2
            mallinfo2.restype = _MallInfo2
            self._free = lambda: mallinfo2().fordblks
        except (OSError, AttributeError):
            pass

    def trim_if_worth_it(self) -> bool:
        if self._trim is None or (self._free is not None and self._free() < self.threshold):
            return False
        self._trim(0)
        return True

    async def run(self) -> None:
        if self._trim is None:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            self.trim_if_worth_it()


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


def raise_fd_limit(needed: int) -> None:
    """Lift the soft open-files limit toward the hard one, so the connection limit is reached
    before accept() starts failing with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("open-files limit %d is below --max-client-connections plus backend sockets (%d)", target, needed)


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


def run(
    app: web.Application,
    limits: ClientLimits,
    *,
    host: str,
    port: int,
    reuse_port: bool = False,
    shared: PortConnections | None = None,
) -> None:
    """`web.run_app` with the client limits; returns on SIGTERM or SIGINT after a graceful shutdown."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner, site = await start(app, limits, host=host, port=port, reuse_port=reuse_port, shared=shared)
        logging.getLogger("epd_proxy").info("serving on %s", site.name)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    if limits.max_connections:
        raise_fd_limit(limits.max_connections + 1024)
    asyncio.run(main())
