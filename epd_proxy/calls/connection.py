"""One keep-alive HTTP/1.1 connection to a backend: an asyncio.Protocol over httptools' parser
(the C parser uvicorn uses), holding one exchange at a time, and the rules for what a backend may
send on it. The pool and the classification of failures are upstream.py's.

Bytes are parsed only while an exchange waits for its answer, and only one answer per exchange:
anything else closes the connection, so nothing a backend sends out of turn reaches a caller.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import cast, overload

import httptools

# Reading stops while this much of an answer waits unconsumed, so a slow client cannot make the
# proxy buffer a fast backend's whole stream.
_PAUSE_ABOVE = 1 << 20
_RESUME_BELOW = 1 << 18
# A request larger than this is written a piece at a time, each after the socket drained, so a
# backend that reads slowly never makes the proxy hold a second copy of a large body.
_WRITE_PIECE = 1 << 18
_WRITE_WHOLE_UP_TO = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """What one backend may send in one answer. The head limits are Envoy's defaults (100 headers,
    60 KiB) with aiohttp's field size; the body cap applies to answers that are read whole (`call`),
    a streamed answer is bounded by its reader instead (read pauses, SSE event cap)."""

    head_bytes: int = 60 * 1024
    header_count: int = 100
    field_bytes: int = 8190
    buffered_body_bytes: int = 8 << 20


# Why an answer was refused, for the error message and epd_backend_answers_refused_total:
HEAD_TOO_LARGE = "head_too_large"
TOO_MANY_HEADERS = "too_many_headers"
FIELD_TOO_LARGE = "field_too_large"
BODY_TOO_LARGE = "body_too_large"
SECOND_ANSWER = "second_answer"  # a message began after this exchange's answer was complete
UNSOLICITED = "unsolicited"  # bytes on a connection with no exchange waiting for them
NOT_HTTP = "not_http"
UPGRADE = "upgrade"


class Headers:
    """An answer's headers as sent, duplicates kept, looked up without regard to case."""

    __slots__ = ("_items",)

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        """One value; repeated fields joined with ", " as RFC 9110 §5.3 allows."""
        values = self.get_all(name)
        if not values:
            return default
        return values[0] if len(values) == 1 else ", ".join(values)

    def get_all(self, name: str) -> list[str]:
        name = name.lower()
        return [value for key, value in self._items if key == name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and any(key == name.lower() for key, _ in self._items)

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)


def decoded(items: list[tuple[bytes, bytes]]) -> Headers:
    # llhttp keeps a value's trailing whitespace, which RFC 9110 §5.5 says is not part of it.
    return Headers([(name.decode("latin-1").lower(), value.decode("latin-1").rstrip(" \t")) for name, value in items])


class Closed(Exception):
    """The exchange ended without a (complete) answer. `answered`: whether any byte of the answer
    had arrived; `refused`: whether this side closed it for what the backend sent."""

    def __init__(self, detail: str, answered: bool, refused: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.answered = answered
        self.refused = refused


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing what a backend must not have sent."""


class State(Enum):
    """Where a connection is in its life, one exchange at a time. An exchange runs from `begin` to
    `answer_ended`; the three closed states differ in what is left for its caller to read."""

    IDLE = "idle"  # open, no exchange: any byte that arrives is out of turn
    WAITING = "waiting"  # a request is going or gone out; its answer's head is not complete yet
    READING = "reading"  # the head is in, the body is arriving
    ANSWERED = "answered"  # the whole answer is in, the connection still open
    ANSWERED_CLOSED = "answered_closed"  # the whole answer is in, the connection closed after it
    FAILED = "failed"  # the exchange ended without its whole answer (`failure` says why); closed
    CLOSED = "closed"  # no exchange, closed for good

    def __init__(self, _: str) -> None:
        self.moves: tuple[State, ...] = ()  # filled in below, once every state exists


# The states by module name (in definition order): in Python 3.11 `State.X` goes through the enum's
# machinery, some twenty times a global's cost, and the hot path asks the state often.
IDLE, WAITING, READING, ANSWERED, ANSWERED_CLOSED, FAILED, CLOSED = State

# Every move a connection may make; any other is a bug and raises IllegalTransition. Tuples, not
# sets, throughout: an Enum hashes in Python, a tuple finds a member by identity.
IDLE.moves = (WAITING, CLOSED)
WAITING.moves = (READING, FAILED)
READING.moves = (ANSWERED, ANSWERED_CLOSED, FAILED)
ANSWERED.moves = (IDLE, ANSWERED_CLOSED)
ANSWERED_CLOSED.moves = (CLOSED,)
FAILED.moves = (CLOSED,)
# States whose bytes go to the parser: the exchange's answer, or (after it) a second one to refuse.
_PARSING = (WAITING, READING, ANSWERED)
_GONE = (ANSWERED_CLOSED, FAILED, CLOSED)
_DONE = (ANSWERED, ANSWERED_CLOSED)


class IllegalTransition(RuntimeError):
    """A caller used a connection out of turn (a second `begin`, an `answer_ended` with no exchange)."""


class Connection(asyncio.Protocol):
    """One keep-alive connection, one exchange at a time, its life one `State` (the module's
    docstring has the rules). Per-message data is reset when a message begins, not on reuse."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: Limits, on_refused: Callable[[str, str], None]) -> None:
        self.loop = loop
        self.limits = limits
        self._on_refused = on_refused
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.state = IDLE
        self.failure: Closed | None = None  # set when the state becomes FAILED
        # The pool's: whether this connection served an earlier exchange, and where it is parked.
        self.reused = False
        self.idle_since = 0.0
        self.parked_in: list[Connection] | None = None
        # Flow control, apart from the state: the transport asked us to stop writing.
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.waiter: asyncio.Future[None] | None = None
        # The exchange's: for the error message and whether it may be sent again.
        self.stage = "idle"
        self.max_body: int | None = None
        self.wrote = False  # any byte of the request handed to the transport
        self.answered = False  # any byte of the answer arrived
        self.head_bytes = 0
        self._new_message()

    def _to(self, state: State) -> None:
        if state not in self.state.moves:
            raise IllegalTransition(f"a connection cannot go from {self.state.name} to {state.name}")
        self.state = state

    def _close(self, failure: Closed) -> bool:
        """The connection closes: an exchange under way fails with `failure`, a complete answer
        stays readable. False if it was closed already."""
        state = self.state
        if state is WAITING or state is READING:
            self._to(FAILED)
            self.failure = failure
        elif state is ANSWERED or state is IDLE:
            self._to(ANSWERED_CLOSED if state is ANSWERED else CLOSED)
        else:
            return False
        self._wake()
        return True

    @property
    def lost(self) -> bool:
        """Closed (by either side): it carries no further request."""
        return self.state in _GONE

    @property
    def complete(self) -> bool:
        """The exchange's whole answer is in."""
        return self.state in _DONE

    @property
    def headers_done(self) -> bool:
        """The exchange's final head is in (its body may have failed since)."""
        return self.status != 0

    def begin(self, stage: str, max_body: int | None) -> None:
        """A request is about to go out on this connection: its answer is the next message.
        Closed (the exchange fails at once) if the connection closed before the request went out."""
        self.stage = stage
        self.max_body = max_body
        self.wrote = False
        self.answered = False
        self.head_bytes = 0
        self.failure = None
        self._new_message()
        if self.state is CLOSED:
            raise Closed("the connection closed before the request went out", False)
        self._to(WAITING)

    def _new_message(self) -> None:
        self.status = 0
        self.header_items: list[tuple[bytes, bytes]] = []
        self.trailer_items: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.until_eof = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.body_bytes = 0
        self.paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection's: a stream transport

    def data_received(self, data: bytes) -> None:
        if self.state not in _PARSING:
            self._refuse(UNSOLICITED, f"{len(data)} bytes arrived with no request waiting for them")
            return
        self.answered = True
        if self.state is WAITING:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except _Stop:
            pass
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Stop):
                raise
        except httptools.HttpParserUpgrade:
            self._refuse(UPGRADE, "the backend switched protocols")
        except httptools.HttpParserError as exc:
            self._refuse(NOT_HTTP, f"not a valid HTTP answer: {exc}")
        else:
            if self.state is WAITING and self.head_bytes > self.limits.head_bytes:
                self._refuse(HEAD_TOO_LARGE, f"response head over {self.limits.head_bytes} bytes")

    def eof_received(self) -> bool:
        self._closed_by_backend(None)  # whatever follows, this connection takes no further request
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed_by_backend(exc)
        self._wake_writer()
        if self.parked_in is not None:
            try:
                self.parked_in.remove(self)
            except ValueError:
                pass
            self.parked_in = None

    def _closed_by_backend(self, exc: Exception | None) -> None:
        if self.state is READING and self.until_eof:
            self._to(ANSWERED_CLOSED)  # a body without length ends where the connection does
            self._wake()
        elif not self.lost:
            detail = f"{type(exc).__name__}: {exc}" if exc else "the backend closed the connection"
            self._close(Closed(detail, self.answered))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # -- httptools callbacks -------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.state is ANSWERED:
            self._refuse(SECOND_ANSWER, "a second answer followed a complete one")
            raise _Stop
        self._new_message()

    def on_header(self, name: bytes, value: bytes) -> None:
        items = self.trailer_items if self.state is READING else self.header_items
        if len(name) + len(value) > self.limits.field_bytes:
            self._refuse(FIELD_TOO_LARGE, f"a header field over {self.limits.field_bytes} bytes")
            raise _Stop
        if len(items) >= self.limits.header_count:
            self._refuse(TOO_MANY_HEADERS, f"more than {self.limits.header_count} header fields")
            raise _Stop
        items.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self.header_items = []  # an interim answer (100 Continue): the real one follows
            return
        self.status = status
        framed = False
        for name, _ in self.header_items:
            lowered = name.lower()
            if lowered == b"content-length" or lowered == b"transfer-encoding":
                framed = True
                break
        self.until_eof = not framed and status not in (204, 304)
        self._to(READING)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.max_body is not None and self.body_bytes > self.max_body:
            self._refuse(BODY_TOO_LARGE, f"an answer over {self.max_body} bytes")
            raise _Stop
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_ABOVE and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.state is READING:  # not an interim answer's end
            # Asked now: once the parser has moved past the message it no longer knows.
            self.keep_alive = self.parser.should_keep_alive()
            self._to(ANSWERED)
            self._wake()

    # -- refusing what a backend must not send -------------------------------------------------------
    def _refuse(self, reason: str, detail: str) -> None:
        """Close the connection for good. Unless the exchange already has its whole answer, that
        exchange fails; nothing parsed from here on reaches anyone."""
        self._on_refused("idle" if self.state is IDLE or self.state is CLOSED else self.stage, reason)
        self._close(Closed(f"answer refused: {detail}", True, refused=True))
        if self.transport is not None:
            self.transport.abort()

    # -- for the caller ------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_writer(self) -> None:
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, limit: float | None) -> None:
        """Until something happens (headers, a chunk, the end, a failure); TimeoutError after `limit`."""
        self.waiter = waiter = self.loop.create_future()
        try:
            if limit is None:
                await waiter
            else:
                async with asyncio.timeout(limit):
                    await waiter
        finally:
            self.waiter = None

    async def send(self, request: list[bytes | bytearray | memoryview], body_size: int) -> None:
        """Write the request (its head, then a body of `body_size` bytes), waiting for the socket to
        drain between pieces of a large one. An answer may start before the request is fully
        written (an early error): writing stops only when the connection does."""
        transport = self.transport
        assert transport is not None, "send before connection_made"
        if body_size <= _WRITE_WHOLE_UP_TO:
            transport.writelines(request)
            self.wrote = True
            return
        for part in request:
            view = memoryview(part).cast("B")
            for offset in range(0, len(view), _WRITE_PIECE):
                if self.lost:
                    return
                transport.write(view[offset : offset + _WRITE_PIECE])
                self.wrote = True
                while self.write_paused and not self.lost:
                    self.drain_waiter = self.loop.create_future()
                    try:
                        await self.drain_waiter
                    finally:
                        self.drain_waiter = None

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < _RESUME_BELOW and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def headers(self) -> Headers:
        return decoded(self.header_items)

    def answer_ended(self) -> None:
        """The caller is done with this exchange: from now on any byte is out of turn. An answer
        abandoned before its end closes the connection, so the rest of it reaches no one."""
        state = self.state
        if state is IDLE or state is CLOSED:
            raise IllegalTransition(f"no exchange to end on a {state.name} connection")
        if state is WAITING or state is READING:
            self.abort()
        self._to(IDLE if self.state is ANSWERED else CLOSED)

    def reusable(self) -> bool:
        return self.state is ANSWERED and self.keep_alive and not self.until_eof and not self.chunks

    def looks_idle(self) -> bool:
        """httpcore's check before reuse: a parked connection that is readable has either data
        nobody asked for or the backend's EOF, and either way must not carry a request."""
        if self.state is not IDLE or self.transport is None or self.transport.is_closing():
            return False
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return True
        # poll, not select: a busy proxy's backend sockets sit above select()'s descriptor limit.
        poller = select.poll()
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def abort(self) -> None:
        """This side closes: an exchange under way fails, a complete answer stays readable."""
        if self._close(Closed("the proxy closed the connection", self.answered)) and self.transport is not None:
            self.transport.abort()
