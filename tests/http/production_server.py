"""The proxy app behind epd_proxy.http.server's production server class, as `epd-proxy serve` runs it,
over fake E and PD: the `serve_proxy` fixture (see conftest.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from epd_proxy.config import Config
from epd_proxy.http import server
from epd_proxy.http.app import STATE, create_app
from epd_proxy.tools.testing.fake_vllm import ECStore, FakeVLLM


@dataclass
class Served:
    host: str
    port: int
    runner: server.GuardedAppRunner
    client: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def gate(self) -> server.ConnectionGate:
        return self.runner.gate

    def timeouts(self, kind: str) -> float:
        """Connections closed by the `kind` clock, as /metrics counts them."""
        return self.runner.app[STATE].metrics.registry.get_sample_value("epd_client_timeouts_total", {"kind": kind})

    async def chat(self, body: dict) -> tuple[int, dict]:
        async with self.client.post(f"{self.url}/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.json()

    async def metrics(self) -> str:
        async with self.client.get(f"{self.url}/metrics") as resp:
            return await resp.text()

    def handlers_in_progress(self) -> int:
        return sum(1 for conn in self.runner.server.connections if conn._request_in_progress)


@pytest.fixture
async def serve_proxy():
    """The proxy app behind epd_proxy.http.server (as `epd-proxy serve` runs it) over fake E and PD."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def build(**overrides) -> Served:
        store = ECStore()
        fakes = [TestServer(FakeVLLM("encode", store).app()), TestServer(FakeVLLM("pd", store).app())]
        for fake in fakes:
            await fake.start_server()
            cleanups.append(fake.close)
        e_url, pd_url = (str(f.make_url("")).rstrip("/") for f in fakes)
        config = dataclasses.replace(Config(encode_urls=(e_url,), decode_urls=(pd_url,)), **overrides)
        runner, site = await server.start(
            create_app(config), server.ClientLimits.from_config(config), host="127.0.0.1", port=0
        )
        cleanups.append(runner.cleanup)
        client = aiohttp.ClientSession()
        cleanups.append(client.close)
        return Served("127.0.0.1", site.port, runner, client)

    yield build
    for cleanup in reversed(cleanups):
        await cleanup()
