"""The client side of the HTTP server: aiohttp's own server, through its public API only, with
each connection behind a guard (guard.py) for what aiohttp has no knob for.

Why this shape: the slow-client defences need to know where a request head begins and ends and
whether an answer is in the making. Subclassing aiohttp's protocol gave that from its private
state, which changes between patch releases, so every aiohttp release (security fixes included)
needed a review. Owning the whole HTTP/1.1 server would drop aiohttp's handling of untrusted
clients (chunked bodies, Expect, pipelining, lingering close, graceful shutdown) and its web
objects, which the routes are written against. Putting a protocol of our own in front of
aiohttp's keeps both: the guard reads the bytes with httptools, which the backend-call layer
already uses, and hands them on unchanged. Nothing here uses a private name of aiohttp.

- `GuardedAppRunner` is aiohttp's AppRunner, listening with the event loop's own server and a
  `ConnectionGuard` around each protocol its `web.Server` makes.
- `run` replaces `web.run_app`; `start` serves an app in a running loop (tests).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from epd_proxy.http.guard import ClientLimits, ConnectionGuard, middleware
from epd_proxy.http.heap import HeapTrimmer
from epd_proxy.http.limits import ConnectionGate, GateCollector, GateCounters, PortConnections, raise_fd_limit
from epd_proxy.proxy import STATE

__all__ = ["ClientLimits", "ConnectionGate", "GuardedAppRunner", "run", "start"]

# aiohttp's idle clock only backs the guard's up: the guard closes (and counts) first.
KEEPALIVE_BACKSTOP_S = 60.0
# The listen backlog aiohttp's sites use.
BACKLOG = 128


class GuardedAppRunner(web.AppRunner):
    """aiohttp's AppRunner whose connections are guarded; `listen` opens the port."""

    def __init__(self, app: web.Application, *, limits: ClientLimits, gate: ConnectionGate, **kwargs: Any) -> None:
        app.middlewares.insert(0, middleware)
        super().__init__(
            app,
            keepalive_timeout=limits.keepalive_timeout_s + KEEPALIVE_BACKSTOP_S,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
            **kwargs,
        )
        self.limits = limits
        self.gate = gate
        # The open connections' guards.
        self.guards: set[ConnectionGuard] = set()
        self.listener: asyncio.Server | None = None
        self._trimmer: asyncio.Task | None = None

    async def setup(self) -> None:
        await super().setup()
        self._trimmer = asyncio.create_task(HeapTrimmer().run())

    async def listen(self, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
        protocols = self.server
        assert protocols is not None, "setup() builds aiohttp's server before a site listens"

        def guarded() -> ConnectionGuard:
            return ConnectionGuard(protocols, self.limits, self.gate, self.guards)

        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(guarded, host, port, backlog=BACKLOG, reuse_port=reuse_port or None)
        return self.listener

    async def cleanup(self) -> None:
        # No new connections first; then aiohttp's graceful shutdown of the open ones.
        if self.listener is not None:
            self.listener.close()
        if self._trimmer is not None:
            self._trimmer.cancel()
            await asyncio.gather(self._trimmer, return_exceptions=True)
        await super().cleanup()


class Listening:
    """Where `start` listens."""

    def __init__(self, listener: asyncio.Server) -> None:
        sockname = listener.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]
        self.name = f"http://{self.host}:{self.port}"


async def start(
    app: web.Application,
    limits: ClientLimits,
    *,
    host: str,
    port: int,
    reuse_port: bool = False,
    shared: PortConnections | None = None,
) -> tuple[GuardedAppRunner, Listening]:
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
    return runner, Listening(await runner.listen(host, port, reuse_port))


def run(
    app: web.Application, limits: ClientLimits, signals_ready: Callable[[], None] | None = None, **where: Any
) -> None:
    """`web.run_app` with the client limits, listening where `start`'s keywords say (host, port,
    reuse_port, shared); returns on SIGTERM or SIGINT after a graceful shutdown. With a tenants
    file, SIGHUP reads it again; `signals_ready` is called once the handlers are in place."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        state = app.get(STATE)
        if state is not None and state.tenants is not None:
            loop.add_signal_handler(signal.SIGHUP, state.reload_tenants)
        if signals_ready is not None:
            signals_ready()
        runner, site = await start(app, limits, **where)
        logging.getLogger("epd_proxy").info("serving on %s", site.name)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    if limits.max_connections:
        raise_fd_limit(limits.max_connections + 1024)
    asyncio.run(main())
