"""One connection's protocol (connection.py), fed bytes by hand with a stub transport: the
one-answer rule, the limits on what a backend sends, interim answers, trailers, framing and
read pausing. What it does over real sockets is tests/http/test_hostile_backends.py's."""

from __future__ import annotations

import os
import resource
import socket

import pytest

from epd_proxy.calls.connection import (
    BODY_TOO_LARGE,
    FIELD_TOO_LARGE,
    HEAD_TOO_LARGE,
    NOT_HTTP,
    SECOND_ANSWER,
    TOO_MANY_HEADERS,
    UNSOLICITED,
    UPGRADE,
    Headers,
    Limits,
)
from tests.unit.stub_connection import Transport, body_of, connection

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
    assert conn.failure is not None and conn.failure.refused and conn.failure.answered
    assert conn.transport.aborted and not conn.reusable()


def test_a_body_over_the_exchanges_cap_is_refused():
    conn, pool = connection(max_body=4)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123")
    assert conn.failure is None
    conn.data_received(b"4")
    assert pool.refused == [("decode", BODY_TOO_LARGE)] and conn.failure.refused


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


@pytest.mark.parametrize("sent, answered", [(b"", False), (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", True)])
def test_a_connection_lost_before_the_end_says_whether_the_answer_had_begun(sent, answered):
    conn, _ = connection()
    if sent:
        conn.data_received(sent)
    conn.connection_lost(ConnectionResetError("peer reset"))
    assert (
        conn.failure.answered is answered
        and not conn.failure.refused
        and conn.failure.detail == "ConnectionResetError: peer reset"
    )


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


class _SocketTransport(Transport):
    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


@pytest.mark.parametrize("fd_above", [0, 1100])
def test_a_parked_connection_is_idle_until_bytes_arrive_whatever_its_descriptor_number(fd_above):
    """A proxy with many clients holds backend sockets above descriptor 1024, which select() cannot
    watch: the check before reuse must still tell an idle connection from a readable one."""
    ours, theirs = socket.socketpair()
    if fd_above:
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= fd_above:
            pytest.fail("the open-files limit is too low for this test")
        os.dup2(ours.fileno(), fd_above)
        ours.close()
        ours = socket.socket(fileno=fd_above)
    try:
        conn, _ = connection(stage=None)
        conn.transport = _SocketTransport(ours)
        assert conn.looks_idle()
        theirs.send(b"HTTP/1.1 200 OK\r\n")
        assert not conn.looks_idle()
    finally:
        ours.close()
        theirs.close()
