"""An EPD stack of in-process fake vLLM servers behind a real proxy app, one per test."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from epd_proxy.config import Config
from epd_proxy.http import server as server_module
from epd_proxy.http.app import create_app
from epd_proxy.tools.testing.fake_vllm import ECStore, FakeVLLM
from tests.http.production_server import serve_proxy  # noqa: F401 (fixture)
from tests.http.raw_backends import peer, upstream  # noqa: F401 (fixtures of the upstream tests)


@dataclass
class Stack:
    encoders: list[FakeVLLM]
    consumers: list[FakeVLLM]
    prefills: list[FakeVLLM]
    store: ECStore
    url: str
    client: aiohttp.ClientSession
    servers: list[TestServer] = field(default_factory=list)
    backend_urls: dict[str, list[str]] = field(default_factory=dict)

    @property
    def pd(self) -> FakeVLLM:
        return self.consumers[0]

    @property
    def pd_url(self) -> str:
        return self.backend_urls["d"][0]

    async def chat(self, body: dict[str, Any] | bytes, **kwargs):
        data = body if isinstance(body, bytes) else None
        json_body = None if isinstance(body, bytes) else body
        return await self.client.post(f"{self.url}/v1/chat/completions", data=data, json=json_body, **kwargs)

    def encoder_requests(self) -> list[dict[str, Any]]:
        return [seen.body for e in self.encoders for seen in e.requests]


class ProductionServer:
    """The proxy behind server.start, closed like the fakes' TestServers."""

    def __init__(self, runner: server_module.GuardedAppRunner) -> None:
        self.runner = runner
        self.app = runner.app

    async def close(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def make_stack():
    stacks: list[Stack] = []

    async def build(
        encoders: int = 2,
        prefills: int = 0,
        decoders: int = 1,
        encoder_options: dict[str, Any] | None = None,
        consumer_options: dict[str, Any] | None = None,
        **config_overrides: Any,
    ) -> Stack:
        store = ECStore()
        # With consumer addresses configured the consumer is a Mooncake one: it needs every push.
        consumer_options = {"mooncake": bool(config_overrides.get("ec_consumer_zmq_addrs")), **(consumer_options or {})}
        fake_encoders = [FakeVLLM("encode", store, **(encoder_options or {})) for _ in range(encoders)]
        fake_prefills = [FakeVLLM("prefill", store) for _ in range(prefills)]
        fake_consumers = [FakeVLLM("decode" if prefills else "pd", store, **consumer_options) for _ in range(decoders)]
        servers = []
        urls: dict[str, list[str]] = {"e": [], "p": [], "d": []}
        for key, fakes in (("e", fake_encoders), ("p", fake_prefills), ("d", fake_consumers)):
            for fake in fakes:
                server = TestServer(fake.app())
                await server.start_server()
                servers.append(server)
                urls[key].append(str(server.make_url("")).rstrip("/"))
        config = Config(encode_urls=tuple(urls["e"]), prefill_urls=tuple(urls["p"]), decode_urls=tuple(urls["d"]))
        config = dataclasses.replace(config, **config_overrides)
        # The proxy runs under the production server class, as `epd-proxy serve` runs it.
        runner, site = await server_module.start(
            create_app(config), server_module.ClientLimits.from_config(config), host="127.0.0.1", port=0
        )
        servers.append(ProductionServer(runner))
        stack = Stack(
            fake_encoders,
            fake_consumers,
            fake_prefills,
            store,
            f"http://127.0.0.1:{site.port}",
            aiohttp.ClientSession(),
            servers,
            urls,
        )
        stacks.append(stack)
        return stack

    yield build
    for stack in stacks:
        await stack.client.close()
        for server in reversed(stack.servers):
            await server.close()
