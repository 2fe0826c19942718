"""A connection's life as one state (connection.py's `State`): the moves each event makes, the
calls a caller may not make out of turn, and that nothing a backend does can break the rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.calls.connection import SECOND_ANSWER, UNSOLICITED, Closed, IllegalTransition, State
from tests.unit.stub_connection import body_of, connection

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n"
UNTIL_EOF = b"HTTP/1.1 200 OK\r\n\r\n"


def test_an_exchange_goes_idle_waiting_reading_answered_and_back_to_idle():
    conn, _ = connection(stage=None)
    seen = [conn.state]
    conn.begin("decode", None)
    seen.append(conn.state)
    conn.data_received(HEAD)
    seen.append(conn.state)
    conn.data_received(b"body")
    seen.append(conn.state)
    assert body_of(conn) == b"body" and conn.reusable()
    conn.answer_ended()
    seen.append(conn.state)
    assert seen == [State.IDLE, State.WAITING, State.READING, State.ANSWERED, State.IDLE]
    conn.begin("decode", None)  # and it carries the next one
    conn.data_received(OK)
    assert conn.state is State.ANSWERED and body_of(conn) == b"hi"


@pytest.mark.parametrize("fed", [b"", HEAD, OK], ids=["waiting", "reading", "answered"])
def test_a_second_request_while_an_exchange_is_under_way_raises(fed):
    conn, _ = connection()
    if fed:
        conn.data_received(fed)
    with pytest.raises(IllegalTransition):
        conn.begin("decode", None)


def test_ending_an_exchange_that_is_not_there_raises():
    conn, _ = connection(stage=None)
    with pytest.raises(IllegalTransition):
        conn.answer_ended()
    conn.begin("decode", None)
    conn.data_received(OK)
    conn.answer_ended()
    with pytest.raises(IllegalTransition):
        conn.answer_ended()


def test_a_request_on_a_connection_that_closed_before_it_went_out_fails_at_once():
    """Bytes before any request close the connection; a request begun on it must fail, not wait
    for a head that can never come."""
    conn, pool = connection(stage=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\n")
    assert pool.refused == [("idle", UNSOLICITED)] and conn.state is State.CLOSED
    with pytest.raises(Closed) as raised:
        conn.begin("decode", None)
    assert not raised.value.answered and not conn.wrote and conn.state is State.CLOSED


@pytest.mark.parametrize("fed, answered", [(b"", False), (HEAD + b"bo", True)])
def test_the_backends_eof_mid_answer_fails_the_exchange(fed, answered):
    conn, _ = connection()
    if fed:
        conn.data_received(fed)
    conn.eof_received()
    assert conn.state is State.FAILED and conn.lost and not conn.complete
    assert conn.failure is not None and conn.failure.answered is answered
    conn.connection_lost(None)  # the close that follows the EOF changes nothing
    assert conn.state is State.FAILED and conn.failure.detail == "the backend closed the connection"
    conn.answer_ended()
    assert conn.state is State.CLOSED


def test_a_close_after_a_complete_answer_leaves_it_readable_but_never_reused():
    conn, _ = connection()
    conn.data_received(OK)
    conn.eof_received()
    assert conn.state is State.ANSWERED_CLOSED and conn.complete and conn.failure is None
    assert not conn.reusable() and body_of(conn) == b"hi"
    conn.answer_ended()
    assert conn.state is State.CLOSED and not conn.looks_idle()


def test_a_second_answer_closes_the_connection_but_the_first_stays_complete():
    conn, pool = connection()
    conn.data_received(OK + OK)
    assert pool.refused == [("decode", SECOND_ANSWER)]
    assert conn.state is State.ANSWERED_CLOSED and body_of(conn) == b"hi"


def test_a_body_without_length_cut_short_by_the_proxy_is_not_complete():
    """Only the backend's close ends such a body: the proxy's own abort must not pass the part
    read so far off as the whole answer."""
    conn, _ = connection()
    conn.data_received(UNTIL_EOF + b"part")
    conn.abort()
    conn.connection_lost(None)
    assert conn.state is State.FAILED and not conn.complete and conn.transport.aborted
    assert conn.failure is not None and conn.failure.answered


def test_an_answer_abandoned_midway_closes_its_connection():
    conn, _ = connection()
    conn.data_received(HEAD + b"bo")
    conn.answer_ended()
    assert conn.state is State.CLOSED and conn.transport.aborted and not conn.reusable()


def test_a_parked_connection_closed_by_either_side_is_closed_for_good():
    for close in ("eof", "lost", "abort"):
        conn, _ = connection(stage=None)
        parked = [conn]
        conn.parked_in = parked
        if close == "eof":
            conn.eof_received()
        elif close == "lost":
            conn.connection_lost(ConnectionResetError())
        else:
            conn.abort()
        assert conn.state is State.CLOSED and not conn.looks_idle(), close
        conn.connection_lost(None)
        assert parked == [] and conn.parked_in is None


# -- whatever a backend sends, in whatever order -----------------------------------------------------

ANSWERS = [OK, HEAD, b"body", UNTIL_EOF, b"HTTP/1.1 100 Continue\r\n\r\n", b"garbage\r\n\r\n", b"4\r\n"]
EVENTS = st.one_of(
    st.sampled_from(ANSWERS).map(lambda data: ("data", data)),
    st.sampled_from(["eof", "lost", "abort", "begin", "end", "take"]).map(lambda name: (name, b"")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENTS, max_size=12))
def test_no_order_of_events_breaks_the_rules(events):
    """Backend events never raise; a caller that asks only what the state allows never hits an
    illegal move; and what the connection reports always agrees with its state."""
    conn, _ = connection(stage=None)
    for name, data in events:
        under_way = conn.state not in (State.IDLE, State.CLOSED)
        if name == "data":
            conn.data_received(data)
        elif name == "eof":
            conn.eof_received()
        elif name == "lost":
            conn.connection_lost(None)
        elif name == "abort":
            conn.abort()
        elif name == "begin" and not under_way:
            try:
                conn.begin("decode", None)
            except Closed:
                assert conn.state is State.CLOSED
        elif name == "end" and under_way:
            conn.answer_ended()
        elif name == "take" and conn.chunks:
            conn.take()
        # A failure is kept past the exchange's end, for the caller that ended it to report.
        assert (conn.state is State.FAILED) <= (conn.failure is not None)
        assert conn.failure is None or conn.state in (State.FAILED, State.CLOSED)
        assert conn.lost is (conn.state in (State.ANSWERED_CLOSED, State.FAILED, State.CLOSED))
        assert not conn.reusable() or conn.state is State.ANSWERED
