"""The backend-call layer's reading of valid HTTP/1.1 answers, against h11's (httpcore's parser).

Each answer of the corpus is served over a real socket in randomly split pieces; status, headers
(duplicates and order kept), body and trailers must be what h11 reads from the same bytes.
"""

from __future__ import annotations

import asyncio
import random

import h11
import pytest

from epd_proxy.calls.upstream import Timeouts, Upstream
from epd_proxy.fleet.backends import Instance
from tests.http.raw_backends import read_request

BIG = bytes(random.Random(7).randrange(256) for _ in range(200_000))

CORPUS = {
    "content_length": b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}',
    "chunked_with_extensions": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5;name=value\r\nhello\r\n6;quoted="x y";flag\r\n world\r\n0\r\n\r\n'
    ),
    "chunked_with_trailers": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum, X-Other\r\n\r\n"
        b"3\r\nabc\r\n0\r\nX-Checksum: 99\r\nX-Other: o\r\n\r\n"
    ),
    "empty_chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "continue_then_answer": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\nLocation: /x\r\n\r\nok"
    ),
    "early_hints_then_answer": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n!"
    ),
    "close_delimited": b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/plain\r\n\r\nuntil the end",
    "http10_close_delimited": b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nold style",
    "no_content": b"HTTP/1.1 204 No Content\r\nX-Id: 1\r\n\r\n",
    "duplicate_headers": (
        b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nVary: accept\r\nSet-Cookie: b=2\r\nContent-Length: 0\r\n\r\n"
    ),
    "no_reason_phrase": b"HTTP/1.1 500 \r\nContent-Length: 3\r\n\r\nerr",
    "whitespace_around_values": b"HTTP/1.1 200 OK\r\nX-Pad:    spaced   \r\nContent-Length: 1\r\n\r\nz",
    "error_status": b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nbusy",
    "large_chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(BIG[i : i + 70_000]), BIG[i : i + 70_000]) for i in range(0, len(BIG), 70_000))
    + b"0\r\n\r\n",
    "large_content_length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BIG), BIG),
}


def read_with_h11(raw: bytes) -> dict:
    conn = h11.Connection(our_role=h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/x", headers=[("Host", "b"), ("Content-Length", "2")]))
    conn.send(h11.Data(data=b"{}"))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")  # the connection ends after the answer (close-delimited bodies need it)
    got = {"body": b"", "trailers": []}
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            got["status"] = event.status_code
            got["headers"] = [(name.decode(), value.decode()) for name, value in event.headers]
        elif isinstance(event, h11.Data):
            got["body"] += event.data
        elif isinstance(event, h11.EndOfMessage):
            got["trailers"] = [(name.decode(), value.decode()) for name, value in event.headers]
            return got
        elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            raise AssertionError(f"h11 did not read a whole answer: {event}")


def pieces(raw: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randrange(1, 12))))
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]


@pytest.mark.parametrize("name", sorted(CORPUS))
async def test_the_client_reads_valid_answers_as_h11_does(name):
    raw = CORPUS[name]
    expected = read_with_h11(raw)
    rng = random.Random(name)

    async def serve(reader, writer):
        await read_request(reader)
        for piece in pieces(raw, rng):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()  # close-delimited answers end here; the others are complete before

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = Upstream(keep_alive_s=None)  # each split on its own connection, as the server closes
    inst = Instance(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "decode")
    try:
        for _ in range(3):  # three different splits of the same bytes
            got = await pool.call(inst, "POST", "/x", body=b"{}", timeouts=Timeouts(total=10), stage="d", what="D")
            assert got.status == expected["status"]
            assert got.headers.items() == [(k.lower(), v) for k, v in expected["headers"]]
            assert got.body == expected["body"]
            assert got.trailers.items() == [(k.lower(), v) for k, v in expected["trailers"]]
    finally:
        await pool.close()
        server.close()
