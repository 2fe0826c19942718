"""The one backend-call layer: every stage, the prober and the admin endpoints call backends here.

It owns what each caller used to do on its own: the connection pool (keep-alive shorter than the
backends' idle timeout, an optional cap per backend), the connect / pool-wait / headers / per-chunk
idle timeouts, in-flight counting, cancellation (a cancelled call closes its connection), streaming
the answer chunk by chunk, and one classification of what happened. A caller gets either an
`Answer` (the backend answered with some status) or an `UpstreamFailure` that says which kind of
"no answer" it was; it never handles a timeout or a client-library exception itself.

A second pool (health probes on their own small connector, never limited by
`--max-connections-per-backend`) is just another `Upstream`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from multidict import CIMultiDictProxy

from epd_proxy.errors import BackendUnreachable, UpstreamError

# What went wrong when there was no (complete) answer. Transport failures:
REFUSED = "refused"  # the connection could not be made (refused, unreachable, DNS)
RESET = "reset"  # the connection was reset or closed before any byte of the answer
BROKEN = "broken"  # the answer started and was cut off (or was not valid HTTP)
# Timeouts, by the phase that ran out of time:
POOL_TIMEOUT = "pool_timeout"  # waiting for a free connection under the per-backend cap
CONNECT_TIMEOUT = "connect_timeout"  # opening the connection
HEADERS_TIMEOUT = "headers_timeout"  # waiting for the status line and headers
IDLE_TIMEOUT = "idle_timeout"  # waiting for the next chunk of the body
TIMEOUTS = frozenset({POOL_TIMEOUT, CONNECT_TIMEOUT, HEADERS_TIMEOUT, IDLE_TIMEOUT})

_WAITING_FOR = {
    POOL_TIMEOUT: "waiting for a free connection",
    CONNECT_TIMEOUT: "while connecting",
    HEADERS_TIMEOUT: "waiting for the answer",
    IDLE_TIMEOUT: "waiting for the next chunk of the answer",
}


class UpstreamFailure(BackendUnreachable):
    """No complete answer from a backend: 504 for a timeout, 502 otherwise, naming the stage."""

    def __init__(self, kind: str, detail: str, *, what: str, stage: str, backend: str, limit_s: float | None = None):
        self.kind = kind
        self.detail = detail
        self.limit_s = limit_s
        timed_out = kind in TIMEOUTS
        if timed_out:
            after = f"after {limit_s:g}s " if limit_s is not None else ""
            message = f"{what} timed out {after}{_WAITING_FOR[kind]}"
        else:
            message = f"{what} failed: {detail}"
        super().__init__(message, stage=stage, backend=backend, timed_out=timed_out)

    @property
    def timed_out(self) -> bool:
        return self.kind in TIMEOUTS

    @property
    def reason(self) -> str:
        """Short enough for a health record: `refused: ...`, `no answer within 2s`."""
        if self.timed_out:
            after = f" within {self.limit_s:g}s" if self.limit_s is not None else ""
            return f"{self.kind}{after}"
        return f"{self.kind}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; None means no limit. `total` bounds the whole exchange (pool wait to last byte)
    and is what buffered calls use; each phase gets the smaller of its own limit and what is left
    of `total`, and a timeout is classified by the phase that ran out of time either way."""

    connect: float | None = 10.0
    pool: float | None = None
    headers: float | None = None
    idle: float | None = None
    total: float | None = None


class Target(Protocol):
    """What the layer needs of a backend: its base URL and an in-flight counter."""

    url: str
    inflight: int


class Answer:
    """A backend's answer: status and headers, and the body read whole (`call`) or still to be
    streamed (`open`). An open answer holds its connection until `release()`."""

    __slots__ = ("status", "headers", "body", "_resp", "_call", "_done")

    def __init__(self, resp: aiohttp.ClientResponse, call: _Call) -> None:
        self.status = resp.status
        self.headers: CIMultiDictProxy[str] = resp.headers
        self.body: bytes | None = None
        self._resp = resp
        self._call = call
        self._done = False

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "application/json")

    def error(self) -> UpstreamError:
        """This answer as the error the client gets: the backend's own status and body."""
        return UpstreamError(
            self.status,
            self.body or b"",
            self.content_type,
            stage=self._call.stage,
            backend=self._call.target.url,
        )

    async def read(self, idle_timeout: float | None = None) -> bytes:
        """The rest of the body in one piece."""
        if self.body is None:
            self.body = b"".join([chunk async for chunk in self.chunks(idle_timeout)])
        return self.body

    async def chunks(self, idle_timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body as the backend wrote it, never re-split; an UpstreamFailure (IDLE_TIMEOUT or
        BROKEN) when it stalls for `idle_timeout` seconds between two chunks or breaks off."""
        call = self._call
        content = self._resp.content
        idle = _smaller(idle_timeout, call.timeouts.idle)
        while True:
            limit, reported = call.budget(idle)
            try:
                async with asyncio.timeout(limit):
                    chunk = await content.readany()
            except TimeoutError:
                self._abandon()
                raise call.failure(IDLE_TIMEOUT, "", reported) from None
            except aiohttp.ClientError as exc:
                self._abandon()
                raise call.failure(BROKEN, _describe(exc)) from None
            if not chunk:
                self._finish()
                return
            yield chunk

    def release(self) -> None:
        """Give the connection back (or close it, if the body was not read to the end)."""
        if self._done:
            return
        if self._resp.content.at_eof():
            self._finish()
        else:
            self._abandon()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._resp.release()
            self._call.end()

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._resp.close()
            self._call.end()

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class _Call:
    """One exchange's bookkeeping: its slot under the per-backend cap and the in-flight count."""

    __slots__ = ("target", "stage", "what", "timeouts", "count", "deadline", "slot", "_ended")

    def __init__(self, target: Target, stage: str, what: str, timeouts: Timeouts, count: bool):
        self.target = target
        self.stage = stage
        self.what = what
        self.timeouts = timeouts
        self.count = count
        self.deadline = None if timeouts.total is None else time.monotonic() + timeouts.total
        self.slot: asyncio.Semaphore | None = None
        self._ended = False

    def budget(self, phase_limit: float | None) -> tuple[float | None, float | None]:
        """Seconds this phase may take, and the limit to name if it runs out: the phase's own,
        or the whole exchange's when less than that is left of it."""
        if self.deadline is None:
            return phase_limit, phase_limit
        left = max(0.0, self.deadline - time.monotonic())
        if phase_limit is not None and phase_limit <= left:
            return phase_limit, phase_limit
        return left, self.timeouts.total

    def begin(self) -> None:
        if self.count:
            self.target.inflight += 1

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.count:
            self.target.inflight -= 1
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    def failure(self, kind: str, detail: str, limit_s: float | None = None) -> UpstreamFailure:
        return UpstreamFailure(kind, detail, what=self.what, stage=self.stage, backend=self.target.url, limit_s=limit_s)


class Upstream:
    """A connection pool to the backends and the only way to call them."""

    def __init__(
        self,
        *,
        keep_alive_s: float | None = 2.5,
        max_connections_per_backend: int = 0,
        headers: Mapping[str, str] | None = None,
        count_inflight: bool = True,
    ) -> None:
        self.max_connections_per_backend = max_connections_per_backend
        self.count_inflight = count_inflight
        self._slots: dict[str, asyncio.Semaphore] = {}
        # Idle connections retire before the backend (uvicorn) drops them, so a reused connection
        # is almost never one the server already closed; the cap is ours (see _acquire_slot).
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            keepalive_timeout=keep_alive_s if keep_alive_s is not None else 0,
            force_close=keep_alive_s is None,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            headers=dict(headers) if headers else None,
            # Relayed bytes must arrive as the backend wrote them: ask for no compression at all.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}

    def connections_in_use(self) -> int:
        return len(self._session.connector._acquired)  # noqa: SLF001 - aiohttp exposes it nowhere else

    async def close(self) -> None:
        await self._session.close()

    async def call(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        body: bytes | Iterable[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        timeouts: Timeouts,
        stage: str,
        what: str,
        count_inflight: bool | None = None,
    ) -> Answer:
        """Send and read the whole answer, whatever its status."""
        answer = await self.open(
            target,
            method,
            path,
            body=body,
            headers=headers,
            timeouts=timeouts,
            stage=stage,
            what=what,
            count_inflight=count_inflight,
        )
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
        body: bytes | Iterable[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        timeouts: Timeouts,
        stage: str,
        what: str,
        count_inflight: bool | None = None,
    ) -> Answer:
        """Send and wait for the status line and headers; the body is left to stream. The caller
        must `release()` the answer (or use it as an async context manager)."""
        call = _Call(target, stage, what, timeouts, self.count_inflight if count_inflight is None else count_inflight)
        call.begin()
        try:
            await self._acquire_slot(call)
            resp = await self._send(call, method, path, body, headers)
        except BaseException:
            call.end()
            raise
        return Answer(resp, call)

    async def _acquire_slot(self, call: _Call) -> None:
        cap = self.max_connections_per_backend
        if cap <= 0:
            return
        slot = self._slots.get(call.target.url)
        if slot is None:
            slot = self._slots[call.target.url] = asyncio.Semaphore(cap)
        if not slot.locked():
            slot._value -= 1  # noqa: SLF001 - the uncontended path without a coroutine switch
            call.slot = slot
            return
        limit, reported = call.budget(call.timeouts.pool)
        try:
            async with asyncio.timeout(limit):
                await slot.acquire()
        except TimeoutError:
            raise call.failure(POOL_TIMEOUT, "", reported) from None
        call.slot = slot

    async def _send(self, call: _Call, method, path, body, headers):
        connect, connect_reported = call.budget(call.timeouts.connect)
        client_timeout = self._timeouts.get(connect)
        if client_timeout is None:
            client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect)
            if len(self._timeouts) < 64:  # remaining budgets vary; only the fixed ones are worth keeping
                self._timeouts[connect] = client_timeout
        limit, reported = call.budget(call.timeouts.headers)
        data = body if body is None or isinstance(body, bytes | bytearray) else b"".join(body)
        try:
            async with asyncio.timeout(limit):
                return await self._session.request(
                    method, call.target.url + path, data=data, headers=headers, timeout=client_timeout
                )
        except aiohttp.ConnectionTimeoutError:
            raise call.failure(CONNECT_TIMEOUT, "", connect_reported) from None
        except TimeoutError:
            raise call.failure(HEADERS_TIMEOUT, "", reported) from None
        except aiohttp.ClientConnectorError as exc:
            raise call.failure(REFUSED, _describe(exc)) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise call.failure(RESET, _describe(exc)) from None
        except aiohttp.ClientError as exc:
            raise call.failure(BROKEN, _describe(exc)) from None


def _smaller(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a < b else b


def _describe(exc: BaseException) -> str:
    """`ClientConnectorError: Cannot connect to host ...` rather than a repr full of internals."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
