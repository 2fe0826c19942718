"""The lean server the benchmark hosts its fakes on: the fake vLLM answers through it as it does
under aiohttp, and one connection keeps its answers in request order."""

from __future__ import annotations

import asyncio

import aiohttp

from epd_proxy_tools.testing import bare_server
from epd_proxy_tools.testing.fake_vllm import ECStore, FakeVLLM

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "u1"}


async def _serving(fake: FakeVLLM) -> tuple[asyncio.Server, str]:
    server = await bare_server.start_server(fake.bare_handler(), "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_the_fake_encodes_then_answers_whole_and_streamed_over_one_connection_each():
    store = ECStore()
    (enc_server, enc), (pd_server, pd) = (
        await _serving(FakeVLLM("encode", store)),
        await _serving(FakeVLLM("pd", store)),
    )
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{enc}/v1/chat/completions", json={"messages": [{"content": [IMAGE]}]}) as r:
                assert r.status == 200
                grid = (await r.json())["ec_transfer_params"]["u1"]["metadata"]["image_grid_thw"][0]
            reference = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": "u1"}
            body = {"messages": [{"content": [reference]}]}
            async with session.post(f"{pd}/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Length"]
                assert (await r.json())["choices"][0]["message"]["content"].startswith("answer-")
            async with session.post(f"{pd}/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status == 200 and r.headers["Transfer-Encoding"] == "chunked"
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            async with session.get(f"{pd}/nowhere") as r:
                assert r.status == 404
    finally:
        enc_server.close()
        pd_server.close()


async def test_pipelined_requests_are_answered_in_order_and_connection_close_is_honoured():
    async def answer(exchange: bare_server.Exchange) -> None:
        # The first request answers last unless the server keeps them in order.
        await asyncio.sleep(0.05 if exchange.path == "/slow" else 0)
        exchange.reply(200, exchange.path.encode(), "text/plain")

    server = await bare_server.start_server(answer, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
            b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        received = await asyncio.wait_for(reader.read(), timeout=5)
        bodies = [part.split(b"\r\n\r\n", 1)[1] for part in received.split(b"HTTP/1.1 200 OK\r\n")[1:]]
        assert bodies == [b"/slow", b"/fast", b"/last"]
        writer.close()
    finally:
        server.close()
