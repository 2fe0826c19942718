"""What one backend call comes back with: an `Answer` (some status, the body read whole or still
streaming) or a `NoAnswer` naming which kind of "no answer" it was, and the bookkeeping of the call
in between (its timeouts, its slot under the per-backend cap, its in-flight count). The pool that
makes the calls is upstream.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from epd_proxy.calls.connection import BODY_TOO_LARGE, Closed, Connection, Headers, decoded
from epd_proxy.errors import BackendUnreachable, ErrorAnswer

# What went wrong when there was no (complete) answer. Transport failures:
REFUSED = "refused"  # the connection could not be made (refused, unreachable, DNS)
RESET = "reset"  # the connection was reset or closed before any byte of the answer
BROKEN = "broken"  # the answer started and was cut off
REFUSED_ANSWER = "refused_answer"  # the backend sent what no client may accept (see Limits)
# Timeouts, by the phase that ran out of time:
POOL_TIMEOUT = "pool_timeout"  # waiting for a free connection under the per-backend cap
CONNECT_TIMEOUT = "connect_timeout"  # opening the connection
HEADERS_TIMEOUT = "headers_timeout"  # waiting for the status line and headers
IDLE_TIMEOUT = "idle_timeout"  # waiting for the next chunk of the body
TIMEOUTS = frozenset({POOL_TIMEOUT, CONNECT_TIMEOUT, HEADERS_TIMEOUT, IDLE_TIMEOUT})
# Kinds that end a call before any byte of its request could be written.
BEFORE_SENDING = frozenset({REFUSED, POOL_TIMEOUT, CONNECT_TIMEOUT})

_WAITING_FOR = {
    POOL_TIMEOUT: "waiting for a free connection",
    CONNECT_TIMEOUT: "while connecting",
    HEADERS_TIMEOUT: "waiting for the answer",
    IDLE_TIMEOUT: "waiting for the next chunk of the answer",
}


class NoAnswer(BackendUnreachable):
    """No complete answer from a backend: 504 for a timeout, 502 otherwise, naming the stage.

    `sent`: whether any byte of the request was written, so the backend may have read it all. A
    request never sent is safe to send anywhere else (as aiohttp and httpcore retry only those);
    one that was sent may be what broke the backend. Unless told, it follows from the kind, and a
    reset counts as sent."""

    def __init__(
        self,
        kind: str,
        detail: str,
        *,
        what: str,
        stage: str,
        backend: str,
        limit_s: float | None = None,
        sent: bool | None = None,
    ):
        self.kind = kind
        self.detail = detail
        self.limit_s = limit_s
        self.sent = kind not in BEFORE_SENDING if sent is None else sent
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


# A request body: one buffer, or several written back to back (see `splice`).
Payload = bytes | bytearray | memoryview | list[bytes | memoryview]


class Target(Protocol):
    """What the layer needs of a backend: its base URL and an in-flight counter."""

    url: str
    inflight: int


class Pool(Protocol):
    """Where an answer's connection goes when the answer ends (upstream.py's pool): declared here
    so that answers need nothing of the pool but this."""

    def give_back(self, url: str, conn: Connection, reuse: bool) -> None: ...


class Answer:
    """A backend's answer: status and headers, and the body read whole (`call`) or still to be
    streamed (`open`). An open answer holds its connection until `release()`."""

    __slots__ = ("status", "headers", "body", "trailers", "_conn", "_call", "_pool", "_done", "_read")

    def __init__(self, conn: Connection, call: Call, pool: Pool) -> None:
        self.status = conn.status
        self.headers = conn.headers()
        # The whole body once `read` (as after `call`); empty before.
        self.body = b""
        self._read = False
        # A chunked answer's trailer fields, once the body was read to the end; never merged into
        # the headers, which were final when the body began.
        self.trailers = Headers([])
        self._conn = conn
        self._call = call
        self._pool = pool
        self._done = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    def error(self) -> ErrorAnswer:
        """This answer as the error the client gets: the backend's own status and body."""
        return ErrorAnswer(
            self.status, self.body, self.content_type, stage=self._call.stage, backend=self._call.target.url
        )

    async def read(self, idle_timeout: float | None = None) -> bytes:
        """The rest of the body in one piece."""
        if not self._read:
            self.body = b"".join([chunk async for chunk in self.chunks(idle_timeout)])
            self._read = True
        return self.body

    async def chunks(self, idle_timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body as the backend wrote it, never re-split; an NoAnswer (IDLE_TIMEOUT or
        BROKEN) when it stalls for `idle_timeout` seconds between two chunks or breaks off."""
        conn, call = self._conn, self._call
        idle = smaller(idle_timeout, call.timeouts.idle)
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                if conn.trailer_items:
                    self.trailers = decoded(conn.trailer_items)
                self.release()
                return
            if conn.failure is not None:
                self._end(reuse=False)
                raise call.failure(kind_of(conn.failure), conn.failure.detail) from None
            limit, reported = call.budget(idle)
            try:
                await conn.wait(limit)
            except TimeoutError:
                self._end(reuse=False)
                raise call.failure(IDLE_TIMEOUT, "", reported) from None
            except BaseException:
                self._end(reuse=False)
                raise

    def cap_body(self, max_bytes: int) -> None:
        """Refuse the answer (REFUSED_ANSWER) once its body passes `max_bytes`, for a caller that
        learns from the headers that it will read the body whole."""
        conn = self._conn
        conn.max_body = max_bytes
        if conn.body_bytes > max_bytes and not conn.complete:
            conn._refuse(BODY_TOO_LARGE, f"an answer over {max_bytes} bytes")

    def release(self) -> None:
        """Give the connection back (or close it, if the body was not read to the end)."""
        if not self._done:
            self._end(reuse=self._conn.reusable())

    def _end(self, *, reuse: bool) -> None:
        if self._done:
            return
        self._done = True
        self._conn.answer_ended()
        self._pool.give_back(self._call.target.url, self._conn, reuse)
        self._call.end()

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Call:
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

    def failure(self, kind: str, detail: str, limit_s: float | None = None, *, sent: bool | None = None) -> NoAnswer:
        return NoAnswer(
            kind, detail, what=self.what, stage=self.stage, backend=self.target.url, limit_s=limit_s, sent=sent
        )


def smaller(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a < b else b


def kind_of(closed: Closed) -> str:
    if closed.refused:
        return REFUSED_ANSWER
    return BROKEN if closed.answered else RESET
