"""The call layer's pure parts (upstream.py): time budgets, failure wording, and answers over a
connection fed bytes by hand (tests/unit/stub_connection.py). What the layer does over real
sockets is tests/http/test_upstream.py's and test_hostile_backends.py's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from epd_proxy.calls import answer as answer_module
from epd_proxy.calls import upstream
from epd_proxy.calls.answer import Call
from epd_proxy.calls.upstream import (
    BODY_TOO_LARGE,
    HEADERS_TIMEOUT,
    IDLE_TIMEOUT,
    REFUSED,
    REFUSED_ANSWER,
    Answer,
    NoAnswer,
    Timeouts,
)
from tests.unit.stub_connection import Pool, connection

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\nhi"


# -- budgets and failures -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    for module in (upstream, answer_module):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


def call_of(timeouts: Timeouts, target=None, count: bool = True) -> Call:
    target = target or SimpleNamespace(url="http://b", inflight=0)
    return Call(target, "encode", "Encoder request", timeouts, count)


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
