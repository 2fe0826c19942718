"""A server that only reads each request and answers a fixed chat completion: the cost of the
client-facing server alone, with no backend behind it, as a bench arm.

    python -m epd_proxy_tools.bench --arms saturation \
      --proxy "sink-aiohttp@saturation=python -m epd_proxy_tools.bench.sink --server aiohttp" \
      --proxy "sink-bare@saturation=python -m epd_proxy_tools.bench.sink --server bare"

`aiohttp` reads the body as epd-proxy's handler does; `bare` is the lean server the benchmark's
fakes run under (epd_proxy_tools.testing.bare_server, an asyncio.Protocol over httptools with no limits,
timeouts or flow control): the floor a hand-rolled server could reach. Takes the reference proxy's command line and ignores the backend flags.
"""

from __future__ import annotations

import argparse

import uvloop
from aiohttp import web

from epd_proxy_tools.testing import bare_server

ANSWER = (
    b'{"id":"sink","object":"chat.completion","model":"sink","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
)


async def _chat(request: web.Request) -> web.Response:
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
    return web.Response(body=ANSWER, content_type="application/json")


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def serve_aiohttp(host: str, port: int) -> None:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/health", _ok)
    app.router.add_get("/v1/models", _ok)
    uvloop.install()
    web.run_app(app, host=host, port=port, access_log=None, print=None)


def _answer(exchange: bare_server.Exchange) -> None:
    if exchange.method == "POST":
        exchange.reply(200, ANSWER, "application/json")
    else:
        exchange.reply(200, b"ok", "text/plain")


def serve_bare(host: str, port: int) -> None:
    async def main() -> None:
        server = await bare_server.start_server(_answer, host, port)
        await server.serve_forever()

    uvloop.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("aiohttp", "bare"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _backend_flags = parser.parse_known_args(argv)
    (serve_aiohttp if args.server == "aiohttp" else serve_bare)(args.host, args.port)


if __name__ == "__main__":
    main()
