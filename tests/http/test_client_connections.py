"""The connection guard (epd_proxy.http.guard) in front of aiohttp's protocol, on a small app of its
own, driven with raw sockets: where heads begin and end on kept-alive and pipelined connections,
refusals in JSON, and the bytes handed on intact."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiohttp import web

from epd_proxy.http.routes import read_body
from tests.http.test_slow_clients import DEADLINE_S, parse_response, read_until_closed


def small_app() -> web.Application:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "0")))
        return web.json_response({"slept": request.query.get("s", "0")})

    async def echo(request: web.Request) -> web.Response:
        body = await read_body(request, 10_000_000)
        return web.Response(body=bytes(body), content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_post("/echo", echo)
    return app


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
    status, headers, _ = parse_response(head)
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), DEADLINE_S)
    return status, headers, body


async def test_a_pipelined_partial_head_waits_behind_a_long_answer(make_stack):
    proxy = await make_stack(encoders=1, app=small_app(), client_header_timeout_s=1.0)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(b"GET /slow?s=2 HTTP/1.1\r\nHost: proxy\r\n\r\nGET /slow HTTP/1.1\r\nHost: pro")
        status, _, body = await read_answer(reader)
        # The answer took longer than the head clock: the pipelined head's clock started over.
        assert status == 200 and orjson.loads(body) == {"slept": "2"}
        answered = time.monotonic()
        status, headers, answer = parse_response(await read_until_closed(reader))
    finally:
        writer.close()
    assert status == 408 and headers["connection"] == "close", answer
    assert time.monotonic() - answered < DEADLINE_S


async def test_the_head_clock_of_a_kept_alive_request_starts_at_its_first_byte(make_stack):
    proxy = await make_stack(encoders=1, app=small_app(), client_header_timeout_s=1.0, client_keepalive_timeout_s=60.0)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(b"GET /slow HTTP/1.1\r\nHost: proxy\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
        await asyncio.sleep(1.5)  # the client's pace: idle for longer than the head clock
        writer.write(b"GET /slow HTTP/1.1\r\nHost: proxy\r\n")
        await writer.drain()
        started = time.monotonic()
        status, _, answer = parse_response(await read_until_closed(reader))
    finally:
        writer.close()
    assert status == 408, answer
    assert time.monotonic() - started >= 0.9, "the head clock ran during the idle wait"


async def test_pipelined_uploads_reach_the_app_byte_for_byte(make_stack):
    proxy = await make_stack(encoders=1, app=small_app())
    bodies = [bytes(range(256)) * 4000, b"x" * 70_000, b"{}"]
    chunked = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(
            b"".join(f"POST /echo HTTP/1.1\r\nHost: p\r\nContent-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies)
            + b"POST /echo HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked
        )
        answers = [await read_answer(reader) for _ in range(4)]
    finally:
        writer.close()
    assert [body for _, _, body in answers] == [*bodies, b"hello world"]


async def test_a_declined_upgrade_leaves_the_connection_guarded(make_stack):
    proxy = await make_stack(encoders=1, app=small_app(), client_header_timeout_s=1.0)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(b"GET /slow HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
        writer.write(b"GET /slow HTTP/1.1\r\nHost: p\r\n\r\nGET /slow HTTP/1.1\r\nHo")
        assert (await read_answer(reader))[0] == 200
        status, _, answer = parse_response(await read_until_closed(reader))
    finally:
        writer.close()
    assert status == 408, answer


LONG = "a" * 9000


@pytest.mark.parametrize(
    "head",
    [
        b"NOT AN HTTP REQUEST\r\n\r\n",
        f"GET /{LONG} HTTP/1.1\r\nHost: p\r\n\r\n".encode(),
        f"GET /slow HTTP/1.1\r\nHost: p\r\nX-Long: {LONG}\r\n\r\n".encode(),
        f"GET /slow HTTP/1.1\r\nHost: p\r\nX-{LONG}: 1\r\n\r\n".encode(),
        b"GET /slow HTTP/1.1\r\nHost: p\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(129)) + b"\r\n",
        b"GET /slow HTTP/1.1\r\nHost: p\r\nBad Name: 1\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: p\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: p\r\nContent-Length: -1\r\n\r\n",
        b"GET /slow HTTP/9.9\r\nHost: p\r\n\r\n",
    ],
    ids=[
        "not-http",
        "long-target",
        "long-value",
        "long-name",
        "129-fields",
        "bad-name",
        "cl-and-te",
        "bad-cl",
        "bad-version",
    ],
)
async def test_a_head_the_server_will_not_read_gets_a_json_400_and_a_close(make_stack, head):
    proxy = await make_stack(encoders=1, app=small_app())
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(head)
        status, headers, body = parse_response(await read_until_closed(reader))
    finally:
        writer.close()
    assert status == 400 and headers["content-type"] == "application/json", body
    assert orjson.loads(body)["error"]["code"] == 400
    # Under the limits, the same requests are served.
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(b"GET /slow HTTP/1.1\r\nHost: p\r\nX-Long: " + b"a" * 8000 + b"\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
    finally:
        writer.close()
