"""What naming an http(s) image by its bytes costs the proxy, against the two other ways:

    python -m epd_proxy_tools.bench.media_fetch [--sizes 100,200,300] [--rounds 300]

- `fetched`: the proxy fetches the URL (calls/media.py, from an origin in another process on
  loopback), turns the bytes into a `data:` URL, names it, and writes the encoder's body;
- `cached`: the same, the origin calling its answer fresh, so the bytes come from the cache;
- `unnamed`: the URL is forwarded without a name, as each side would fetch and name it itself:
  only the encoder body is written;
- `inline`: the client sent the same image as a `data:` URL (the common case): the body is read
  and named, and the encoder's body written.

For each size (KB of image bytes) it prints the proxy's CPU per request (process time, the
origin's excluded) and the bytes of one body carrying the item (the encoder's; the consumer's
where it gets the item raw is as large).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import socket
import subprocess
import sys
import time

import orjson

from epd_proxy.addresses import Networks
from epd_proxy.calls.media import FetchRules, MediaFetcher
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.extract import MEDIA_HASHES, normalise_request, parse_request
from epd_proxy.journey.remote import fetch_media
from epd_proxy_tools.testing.harness import free_port

ORIGIN = """
import os, sys
from aiohttp import web
blobs = {{size: os.urandom(size * 1024) for size in {sizes}}}
async def handle(request):
    fresh = {{"Cache-Control": "max-age=600"}} if "fresh" in request.query else {{}}
    return web.Response(body=blobs[int(request.match_info["kb"])], content_type="image/png", headers=fresh)
app = web.Application()
app.router.add_get("/{{kb}}.png", handle)
web.run_app(app, host="127.0.0.1", port={port}, print=None)
"""


def body_with(url: str) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, part]}]}


def encoder_body(item) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [{**item.part, "uuid": item.uuid}]}]})


async def measure(sizes: list[int], rounds: int, port: int) -> None:
    fetcher = MediaFetcher(FetchRules(allow_networks=Networks().parse("127.0.0.1/32")))
    digest = MEDIA_HASHES["sha256"]
    print(f"{'KB':>4} {'way':>8} {'CPU ms/req':>11} {'body bytes':>11}")
    try:
        for kb in sizes:
            url = f"http://127.0.0.1:{port}/{kb}.png"
            await fetch_media(normalise_request(body_with(url)), fetcher, CHAT, digest)  # warm the connection
            started = time.process_time()
            for _ in range(rounds):
                normalised = await fetch_media(normalise_request(body_with(url)), fetcher, CHAT, digest)
                size = len(encoder_body(normalised.items[0]))
            report(kb, "fetched", started, rounds, size)
            fresh = url + "?fresh"
            await fetch_media(normalise_request(body_with(fresh)), fetcher, CHAT, digest)
            started = time.process_time()
            for _ in range(rounds):
                normalised = await fetch_media(normalise_request(body_with(fresh)), fetcher, CHAT, digest)
                size = len(encoder_body(normalised.items[0]))
            report(kb, "cached", started, rounds, size)
            started = time.process_time()
            for _ in range(rounds):
                item = normalise_request(body_with(url)).items[0]
                size = len(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [item.part]}]}))
            report(kb, "unnamed", started, rounds, size)
            inline = orjson.dumps(
                body_with(f"data:image/png;base64,{base64.b64encode(os.urandom(kb * 1024)).decode()}")
            )
            started = time.process_time()
            for _ in range(rounds):
                normalised, spliced = parse_request(bytearray(inline))
                item = normalised.items[0]
                wire = {"model": "m", "messages": [{"role": "user", "content": [{**item.part, "uuid": item.uuid}]}]}
                size = sum(len(piece) for piece in spliced.dumps(wire)) if spliced else len(orjson.dumps(wire))
            report(kb, "inline", started, rounds, size)
    finally:
        await fetcher.close()


def report(kb: int, way: str, started: float, rounds: int, size: int) -> None:
    print(f"{kb:>4} {way:>8} {(time.process_time() - started) / rounds * 1000:>11.3f} {size:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,200,300", help="image sizes in KB, comma list")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    port = free_port()
    origin = subprocess.Popen([sys.executable, "-c", ORIGIN.format(sizes=sizes, port=port)])
    try:
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                    break
            except OSError:
                time.sleep(0.1)
        asyncio.run(measure(sizes, args.rounds, port))
    finally:
        origin.terminate()
        origin.wait(10)


if __name__ == "__main__":
    main()
