"""SSE framing through the proxy: events go out as they end under LF, CRLF or CR line ends, and an
event over the cap ends the stream with an in-band error instead of growing the proxy."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from epd_proxy.calls.sse import MAX_EVENT_BYTES
from epd_proxy_tools.testing.harness import Fakes
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat

ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
FIRST = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"one"},"finish_reason":null}]}\n\n'
SECOND = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"two"},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"


class ScriptedDecode:
    """A decode that writes exactly the bytes it is given, and waits for the test where told to."""

    def __init__(self) -> None:
        self.script: list[bytes | asyncio.Event] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            for step in self.script:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                else:
                    await response.write(step)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the proxy let go of the stream
        return response


@pytest.fixture
async def proxy_over_scripted_decode(make_stack):
    decode, fakes = ScriptedDecode(), Fakes()
    decode_url = await fakes.serve(decode.app())
    stack = await make_stack(encoders=1, decoders=0, fakes=fakes, decode_urls=(decode_url,))
    return decode, decode_url, stack.client, stack.state


async def read_until(resp, wanted: bytes) -> bytes:
    got = b""
    while not got.startswith(wanted):
        assert wanted.startswith(got), got
        chunk = await resp.content.readany()
        assert chunk, f"the stream ended after {got!r}"
        got += chunk
    return got


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
async def test_each_event_reaches_the_client_before_decode_sends_the_next(proxy_over_scripted_decode, end):
    decode, _, client, _ = proxy_over_scripted_decode
    role, first, second, done = (event.replace(b"\n", end) for event in (ROLE, FIRST, SECOND, DONE))
    first_read = asyncio.Event()
    decode.script = [role, first, first_read, second, done]
    async with asyncio.timeout(10):
        async with client.post("/v1/chat/completions", json=chat(stream=True)) as resp:
            assert resp.status == 200
            # Decode sends the second event only once the client has the first one.
            got = await read_until(resp, role + first)
            first_read.set()
            got += await resp.content.read()
    assert got == role + first + second + done


async def test_an_event_over_the_cap_ends_the_stream_with_an_in_band_error(proxy_over_scripted_decode):
    decode, decode_url, client, state = proxy_over_scripted_decode
    # An event that never ends: without the cap the proxy would hold all of it.
    piece = b"x" * 65536
    decode.script = [ROLE + FIRST, b"data: ", *[piece] * (4 * MAX_EVENT_BYTES // len(piece))]
    async with asyncio.timeout(30):
        async with client.post("/v1/chat/completions", json=chat(stream=True)) as resp:
            assert resp.status == 200
            got = await resp.content.read()
    assert got.startswith(ROLE + FIRST) and got.endswith(b"\n\ndata: [DONE]\n\n")
    error = orjson.loads(got[len(ROLE + FIRST) :].split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and error["stage"] == "decode" and error["backend"] == decode_url
    assert str(MAX_EVENT_BYTES) in error["message"]
    async with client.get("/metrics") as resp:
        assert 'epd_requests_total{status="aborted"} 1.0' in await resp.text()
    # The decode connection is let go, not left reading the rest of the event.
    await eventually(lambda: state.admission.inflight == 0 and all(i.inflight == 0 for i in state.fleet.all()))
