"""`epd-proxy serve` as a child process, for tests that need the real command line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from epd_proxy.tools.testing.fake_vllm import ECStore, FakeVLLM
from tests.http.polling import eventually


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, *flags: str) -> list[str]:
    """The command line of a proxy on 127.0.0.1:`port`, run from this interpreter."""
    return [sys.executable, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


class ProxyProcess:
    """`epd-proxy serve` on a free loopback port with `flags`, driven through `client`."""

    def __init__(self, client: aiohttp.ClientSession, *flags: str, env: dict[str, str] | None = None) -> None:
        self.client = client
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(serve_command(self.port, *flags), env={**os.environ, **(env or {})})

    async def get(self, path: str) -> tuple[int, dict | str]:
        async with self.client.get(self.url + path) as resp:
            body = await resp.json() if resp.content_type == "application/json" else await resp.text()
            return resp.status, body

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


async def wait_healthy(
    proc: subprocess.Popen, url: str, deadline_s: float = 30.0, what: str = "the proxy process did not become healthy"
) -> None:
    """Poll `url`/health until it answers 200; fail (saying `what`) if the process exits or the deadline passes."""
    async with aiohttp.ClientSession() as probe:

        async def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(what)
            async with probe.get(f"{url}/health") as resp:
                return resp.status == 200

        await eventually(healthy, timeout=deadline_s, interval=0.1, what=what, ignoring=(aiohttp.ClientError,))


@dataclass
class Served:
    """A proxy process started by `serve_process`, and the fakes behind it."""

    proc: subprocess.Popen
    port: int
    encoder: FakeVLLM
    encoder_url: str
    pd: FakeVLLM

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def serve_process(*flags: str, stop_within_s: float = 20.0, env: dict[str, str] | None = None):
    """`epd-proxy serve` over a fake E and a fake PD, once it answers /health; on the way out the
    process gets SIGTERM and must exit within `stop_within_s`, then the fakes stop. `env` is
    added to this process's environment."""
    store = ECStore()
    encoder, pd = FakeVLLM("encode", store), FakeVLLM("pd", store)
    servers = [TestServer(encoder.app()), TestServer(pd.app())]
    for server in servers:
        await server.start_server()
    e_url, pd_url = (str(s.make_url("")).rstrip("/") for s in servers)
    port = free_port()
    proc = subprocess.Popen(
        serve_command(
            port, "--encode-servers-urls", e_url, "--decode-servers-urls", pd_url, "--log-level", "WARNING", *flags
        ),
        env={**os.environ, **(env or {})},
    )
    served = Served(proc, port, encoder, e_url, pd)
    try:
        await wait_healthy(proc, served.url)
        yield served
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, stop_within_s)
        for server in servers:
            await server.close()
