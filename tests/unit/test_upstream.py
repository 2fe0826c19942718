"""The call layer's pure parts (upstream.py): headers, time budgets, failure wording, and a
connection's parser fed bytes by hand, with a stub transport instead of a socket. What the layer
does over real sockets is tests/http/test_upstream.py's and test_hostile_backends.py's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from epd_proxy import upstream
from epd_proxy.upstream import (
    BODY_TOO_LARGE,
    BROKEN,
    FIELD_TOO_LARGE,
    HEAD_TOO_LARGE,
    HEADERS_TIMEOUT,
    IDLE_TIMEOUT,
    NOT_HTTP,
    REFUSED,
    REFUSED_ANSWER,
    RESET,
    SECOND_ANSWER,
    TOO_MANY_HEADERS,
    UNSOLICITED,
    UPGRADE,
    Answer,
    Headers,
    Limits,
    NoAnswer,
    Timeouts,
    _Call,
    _Connection,
)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\nhi"


# -- Headers --------------------------------------------------------------------------------------


def test_headers_are_looked_up_without_regard_to_case_and_repeats_are_joined():
    headers = Headers([("set-cookie", "a=1"), ("content-type", "text/plain"), ("set-cookie", "b=2")])
    assert headers.get("Content-Type") == "text/plain"
    assert headers.get("SET-COOKIE") == "a=1, b=2"
    assert headers.get_all("Set-Cookie") == ["a=1", "b=2"]
    assert headers.get("x-missing") is None and headers.get("x-missing", "d") == "d"
    assert "Content-type" in headers and "x-missing" not in headers and 3 not in headers


def test_headers_items_are_a_copy_in_the_order_sent():
    items = [("b", "1"), ("a", "2")]
    headers = Headers(items)
    listed = headers.items()
    listed.append(("c", "3"))
    assert headers.items() == [("b", "1"), ("a", "2")]


# -- budgets and failures -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(upstream, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


def call_of(timeouts: Timeouts, target=None, count: bool = True) -> _Call:
    target = target or SimpleNamespace(url="http://b", inflight=0)
    return _Call(target, "encode", "Encoder request", timeouts, count)


def test_without_a_total_each_phase_has_its_own_limit(clock):
    call = call_of(Timeouts(connect=3, headers=None))
    assert call.budget(3) == (3, 3)
    assert call.budget(None) == (None, None)


def test_a_phase_gets_what_is_left_of_the_total_and_names_the_total_when_that_is_less(clock):
    call = call_of(Timeouts(connect=3, total=10))
    assert call.budget(3) == (3, 3)
    clock.now += 8
    assert call.budget(3) == (2, 10)
    assert call.budget(None) == (2, 10)
    clock.now += 5
    assert call.budget(3) == (0.0, 10)  # overdue: the phase times out at once


async def test_a_call_counts_in_flight_once_and_gives_its_slot_back_once():
    target = SimpleNamespace(url="http://b", inflight=0)
    call = call_of(Timeouts(), target)
    slot = asyncio.Semaphore(1)
    call.begin()
    await slot.acquire()
    call.slot = slot
    assert target.inflight == 1
    call.end()
    call.end()
    assert target.inflight == 0 and call.slot is None
    await slot.acquire()
    assert slot.locked()  # released once, not twice


def test_a_call_that_does_not_count_leaves_in_flight_alone():
    target = SimpleNamespace(url="http://b", inflight=0)
    call = call_of(Timeouts(), target, count=False)
    call.begin()
    assert target.inflight == 0
    call.end()
    assert target.inflight == 0


def test_a_timeout_is_a_504_that_names_the_phase_and_the_limit():
    failure = call_of(Timeouts()).failure(HEADERS_TIMEOUT, "", 2.5)
    assert (failure.status, failure.stage, failure.backend, failure.timed_out) == (504, "encode", "http://b", True)
    assert failure.message == "Encoder request timed out after 2.5s waiting for the answer"
    assert failure.reason == "headers_timeout within 2.5s"
    assert NoAnswer(IDLE_TIMEOUT, "", what="Decode", stage="decode", backend="b").reason == "idle_timeout"


def test_no_answer_is_a_502_that_says_what_happened():
    failure = call_of(Timeouts()).failure(REFUSED, "ConnectionRefusedError: [Errno 111] refused")
    assert (failure.status, failure.timed_out, failure.kind) == (502, False, REFUSED)
    assert failure.message == "Encoder request failed: ConnectionRefusedError: [Errno 111] refused"
    assert failure.reason == "refused: ConnectionRefusedError: [Errno 111] refused"


# -- one connection, fed by hand ------------------------------------------------------------------


class Transport:
    def __init__(self) -> None:
        self.aborted = False
        self.paused = 0
        self.resumed = 0

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str):
        return None


class Pool:
    """What a connection asks of its pool."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self.refused: list[tuple[str, str]] = []
        self.given_back: list[bool] = []

    def _refused(self, stage: str, reason: str) -> None:
        self.refused.append((stage, reason))

    def _give_back(self, url: str, conn: _Connection, reuse: bool) -> None:
        self.given_back.append(reuse)


def connection(limits: Limits = Limits(), *, stage: str | None = "decode", max_body: int | None = None):
    pool = Pool(limits)
    # No loop: everything here is fed before it is read, so nothing waits.
    conn = _Connection(None, pool)
    conn.connection_made(Transport())
    if stage is not None:
        conn.begin(stage, max_body)
    return conn, pool


def body_of(conn: _Connection) -> bytes:
    return b"".join(conn.take() for _ in range(len(conn.chunks)))


def test_a_complete_keep_alive_answer_leaves_the_connection_reusable():
    conn, pool = connection()
    conn.data_received(OK)
    assert (conn.status, conn.headers_done, conn.complete, conn.keep_alive) == (200, True, True, True)
    assert body_of(conn) == b"hi"
    assert conn.reusable() and pool.refused == [] and not conn.transport.aborted


def test_an_answer_may_arrive_a_byte_at_a_time():
    conn, _ = connection()
    for byte in OK:
        conn.data_received(bytes([byte]))
    assert conn.complete and body_of(conn) == b"hi"


def test_header_names_are_lowercased_and_trailing_whitespace_is_not_part_of_a_value():
    conn, _ = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\nX-Thing: a b \t\r\nContent-Length: 0\r\n\r\n")
    assert conn.headers().items() == [("x-thing", "a b"), ("content-length", "0")]


def test_a_second_answer_after_a_complete_one_closes_the_connection_but_keeps_the_first():
    conn, pool = connection()
    conn.data_received(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")
    assert pool.refused == [("decode", SECOND_ANSWER)]
    assert conn.complete and conn.failure is None and body_of(conn) == b"hi"
    assert conn.transport.aborted and not conn.reusable()


@pytest.mark.parametrize("when", ["before any request", "after the answer was taken"])
def test_bytes_nobody_asked_for_close_the_connection(when):
    conn, pool = connection(stage=None if when == "before any request" else "encode")
    if when != "before any request":
        conn.data_received(OK)
        conn.answer_ended()
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\n")
    assert pool.refused == [("idle", UNSOLICITED)] and conn.transport.aborted and conn.lost


def test_an_interim_answer_is_skipped_for_the_final_one():
    conn, _ = connection()
    conn.data_received(b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n" + OK)
    assert conn.status == 200 and "x-interim" not in conn.headers()


@pytest.mark.parametrize(
    "limits, answer, reason",
    [
        (Limits(head_bytes=64), b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 100, HEAD_TOO_LARGE),
        (Limits(header_count=2), b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n", TOO_MANY_HEADERS),
        (Limits(field_bytes=16), b"HTTP/1.1 200 OK\r\nX-Long: " + b"v" * 20 + b"\r\n\r\n", FIELD_TOO_LARGE),
        (Limits(), b"SSH-2.0-OpenSSH_9.6\r\n", NOT_HTTP),
        (Limits(), b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n", UPGRADE),
    ],
)
def test_an_answer_over_a_limit_or_not_http_fails_the_exchange_and_closes_the_connection(limits, answer, reason):
    conn, pool = connection(limits)
    conn.data_received(answer)
    assert pool.refused == [("decode", reason)]
    assert conn.failure is not None and conn.failure.kind == REFUSED_ANSWER and conn.failure.answered
    assert conn.transport.aborted and not conn.reusable()


def test_a_body_over_the_exchanges_cap_is_refused():
    conn, pool = connection(max_body=4)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123")
    assert conn.failure is None
    conn.data_received(b"4")
    assert pool.refused == [("decode", BODY_TOO_LARGE)] and conn.failure.kind == REFUSED_ANSWER


def test_trailers_are_kept_apart_from_the_headers():
    conn, _ = connection()
    conn.data_received(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
        b"2\r\nhi\r\n0\r\nX-Checksum: abc \r\n\r\n"
    )
    assert conn.complete and body_of(conn) == b"hi"
    assert "x-checksum" not in conn.headers()
    assert conn.trailer_items == [(b"X-Checksum", b"abc ")]


def test_a_body_without_length_ends_where_the_connection_does():
    conn, _ = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\npart")
    assert conn.until_eof and not conn.complete
    conn.connection_lost(None)
    assert conn.complete and conn.failure is None and not conn.reusable()


def test_no_length_on_a_204_means_no_body():
    conn, _ = connection()
    conn.data_received(b"HTTP/1.1 204 No Content\r\n\r\n")
    assert conn.complete and not conn.until_eof and conn.reusable()


@pytest.mark.parametrize("sent, kind", [(b"", RESET), (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", BROKEN)])
def test_a_connection_lost_before_the_end_is_reset_or_broken(sent, kind):
    conn, _ = connection()
    if sent:
        conn.data_received(sent)
    conn.connection_lost(ConnectionResetError("peer reset"))
    assert conn.failure.kind == kind and conn.failure.detail == "ConnectionResetError: peer reset"


def test_connection_close_makes_the_connection_single_use():
    conn, _ = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert conn.complete and not conn.keep_alive and not conn.reusable()


def test_reading_pauses_while_much_waits_unconsumed_and_resumes_once_taken():
    conn, _ = connection()
    size = 3 << 20
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
    piece = b"x" * (512 << 10)
    for _ in range(3):
        conn.data_received(piece)
    assert conn.transport.paused == 1 and conn.transport.resumed == 0
    while conn.chunks:
        conn.take()
    assert conn.transport.resumed == 1


# -- an answer over a connection fed by hand ------------------------------------------------------


def answer_over(data: bytes, **options) -> tuple[Answer, Pool]:
    conn, pool = connection(**options)
    conn.data_received(data)
    return Answer(conn, call_of(Timeouts()), pool), pool


async def test_an_answer_read_to_the_end_goes_back_to_the_pool_with_its_trailers():
    answer, pool = answer_over(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\nX-Done: yes\r\n\r\n"
    )
    assert answer.content_type == "text/event-stream"
    assert await answer.read() == b"hi"
    assert answer.trailers.get("x-done") == "yes" and "x-done" not in answer.headers
    assert pool.given_back == [True]


async def test_an_answer_released_unread_closes_its_connection():
    answer, pool = answer_over(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01")
    answer.release()
    answer.release()
    assert pool.given_back == [False]


async def test_an_answer_without_content_type_is_taken_as_json_and_its_error_keeps_the_body():
    answer, _ = answer_over(b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy")
    await answer.read()
    error = answer.error()
    assert answer.content_type == "application/json"
    assert (error.status, error.raw_body, error.stage, error.backend) == (503, b"busy", "encode", "http://b")


async def test_capping_a_body_already_past_the_cap_refuses_it():
    answer, pool = answer_over(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n012345")
    answer.cap_body(4)
    assert pool.refused == [("decode", BODY_TOO_LARGE)]
    with pytest.raises(NoAnswer) as err:
        await answer.read()
    assert err.value.kind == REFUSED_ANSWER and pool.given_back == [False]
