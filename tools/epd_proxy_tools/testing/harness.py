"""The one way tests (and the bench) start a proxy over fake vLLM servers on loopback.

`start_stack` runs the proxy app in this process under the production server class, as
`epd-proxy serve` runs it; `ProxyProcess` and `serve_process` run the real command line as a child
process (workers, signals, the environment). Either is static (the fakes listed as URLs) or dynamic
(an empty fleet the fakes join through `/instances`). `Proxy.chat` is the one client call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd_proxy.config import Config
from epd_proxy.http import server as server_module
from epd_proxy.http.app import create_app
from epd_proxy.proxy import STATE, ProxyState
from epd_proxy_tools.testing.fake_vllm import ECStore, FakeVLLM
from epd_proxy_tools.testing.polling import eventually

ADMIN_KEY = "sekrit"
ROLE_OF_FAKE = {"prefill_decode": "pd"}  # the registration role that names a fake's role differently


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(port: int, *flags: str) -> list[str]:
    """The command line of a proxy on 127.0.0.1:`port`, run from this interpreter."""
    return [sys.executable, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


class Proxy:
    """A running proxy at `url`, called through `client`."""

    url: str
    client: aiohttp.ClientSession
    admin_key = ADMIN_KEY

    async def chat(self, body: dict[str, Any] | bytes, **kwargs: Any) -> aiohttp.ClientResponse:
        """POST /v1/chat/completions with a JSON `body` (or raw bytes); use as `async with await`."""
        raw = isinstance(body, bytes)
        return await self.client.post(
            f"{self.url}/v1/chat/completions", data=body if raw else None, json=None if raw else body, **kwargs
        )

    async def get(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        """GET `path`: the status and the JSON body (text when the answer is not JSON)."""
        async with self.client.get(self.url + path, **kwargs) as resp:
            body = await resp.json() if resp.content_type == "application/json" else await resp.text()
            return resp.status, body

    async def metrics(self) -> str:
        async with self.client.get(f"{self.url}/metrics") as resp:
            return await resp.text()

    async def register(self, role: str, url: str) -> tuple[int, Any]:
        body, headers = {"role": role, "url": url}, {"X-API-Key": self.admin_key}
        async with self.client.post(f"{self.url}/instances", json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def unregister(self, url: str) -> tuple[int, Any]:
        params, headers = {"url": url}, {"X-API-Key": self.admin_key}
        async with self.client.delete(f"{self.url}/instances", params=params, headers=headers) as resp:
            return resp.status, await resp.json()


@dataclass
class Fakes:
    """Fake vLLM servers (or any aiohttp app) on loopback sharing one EC store, stopped by `close`."""

    store: ECStore = field(default_factory=ECStore)
    servers: list[TestServer] = field(default_factory=list)

    async def serve(self, app: web.Application) -> str:
        server = TestServer(app)
        await server.start_server()
        self.servers.append(server)
        return str(server.make_url("")).rstrip("/")

    async def start(self, role: str, **options: Any) -> tuple[FakeVLLM, str]:
        fake = FakeVLLM(role, self.store, **options)
        return fake, await self.serve(fake.app())

    async def close(self) -> None:
        for server in reversed(self.servers):
            await server.close()
        self.servers.clear()


@dataclass
class Stack(Proxy):
    """The proxy app in this process behind the production server class, over `fakes`."""

    fakes: Fakes
    runner: server_module.GuardedAppRunner
    port: int
    client: aiohttp.ClientSession
    encoders: list[FakeVLLM] = field(default_factory=list)
    prefills: list[FakeVLLM] = field(default_factory=list)
    consumers: list[FakeVLLM] = field(default_factory=list)
    backend_urls: dict[str, list[str]] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def store(self) -> ECStore:
        return self.fakes.store

    @property
    def servers(self) -> list[TestServer]:
        """The fakes' servers: encoders, prefills, then consumers."""
        return self.fakes.servers

    @property
    def state(self) -> ProxyState:
        return self.runner.app[STATE]

    @property
    def pd(self) -> FakeVLLM:
        return self.consumers[0]

    @property
    def pd_url(self) -> str:
        return self.backend_urls["d"][0]

    @property
    def gate(self) -> server_module.ConnectionGate:
        return self.runner.gate

    def timeouts(self, kind: str) -> float:
        """Connections closed by the `kind` clock, as /metrics counts them."""
        return self.state.metrics.registry.get_sample_value("epd_client_timeouts_total", {"kind": kind})

    def handlers_in_progress(self) -> int:
        return sum(1 for guard in self.runner.guards if guard.busy)

    def encoder_requests(self) -> list[dict[str, Any]]:
        return [seen.body for e in self.encoders for seen in e.requests]

    async def join(self, role: str, **options: Any) -> tuple[FakeVLLM, str]:
        """Start one more fake and register it (dynamic mode)."""
        fake, url = await self.fakes.start(ROLE_OF_FAKE.get(role, role), **options)
        status, body = await self.register(role, url)
        assert status == 200, body
        return fake, url

    async def close(self) -> None:
        """The client and the proxy first, then the fakes."""
        await self.client.close()
        await self.runner.cleanup()
        await self.fakes.close()


async def start_stack(
    encoders: int = 2,
    prefills: int = 0,
    decoders: int = 1,
    encoder_options: dict[str, Any] | None = None,
    consumer_options: dict[str, Any] | None = None,
    prefill_options: dict[str, Any] | None = None,
    dynamic: bool = False,
    app: web.Application | None = None,
    fakes: Fakes | None = None,
    **config_overrides: Any,
) -> Stack:
    """Fakes and an in-process proxy. Static: `encoders`, `prefills` and `decoders` fakes listed in
    the config. Dynamic: an empty fleet with the admin key `ADMIN_KEY` and no active probes; fakes
    join with `Stack.join`. `app` replaces the proxy app (to test the server class alone); `fakes`
    brings servers a test started itself (scripted backends, named in `config_overrides`)."""
    fakes = fakes or Fakes()
    # With consumer addresses configured the consumer is a Mooncake one: it needs every push.
    consumer_options = {"mooncake": bool(config_overrides.get("ec_consumer_zmq_addrs")), **(consumer_options or {})}
    consumer_role = "decode" if prefills else "pd"
    stack_fakes: dict[str, list[FakeVLLM]] = {"e": [], "p": [], "d": []}
    urls: dict[str, list[str]] = {"e": [], "p": [], "d": []}
    if not dynamic:
        wanted = (("e", "encode", encoders, encoder_options), ("p", "prefill", prefills, prefill_options))
        for key, role, count, options in (*wanted, ("d", consumer_role, decoders, consumer_options)):
            for _ in range(count):
                fake, url = await fakes.start(role, **(options or {}))
                stack_fakes[key].append(fake)
                urls[key].append(url)
        listed = {"encode_urls": tuple(urls["e"]), "prefill_urls": tuple(urls["p"]), "decode_urls": tuple(urls["d"])}
    else:
        listed = {"dynamic_registration": True, "admin_api_key": ADMIN_KEY, "probe_interval_s": 0}
    try:
        # One construction: a Config checks its topology as it is made, overrides included.
        config = Config(**{**listed, **config_overrides})
        runner, site = await server_module.start(
            app or create_app(config), server_module.ClientLimits.from_config(config), host="127.0.0.1", port=0
        )
    except BaseException:
        await fakes.close()  # a stack that never started must not leave its fakes listening
        raise
    # Paths alone reach the proxy; full URLs reach anything else.
    client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{site.port}")
    return Stack(fakes, runner, site.port, client, stack_fakes["e"], stack_fakes["p"], stack_fakes["d"], urls)


class ProxyProcess(Proxy):
    """`epd-proxy serve` with `flags` as a child process on a free loopback port, driven through `client`."""

    def __init__(
        self, client: aiohttp.ClientSession, *flags: str, env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.client = client
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(serve_command(self.port, *flags), env={**os.environ, **(env or {})})

    async def healthy(self, deadline_s: float = 30.0, what: str = "the proxy process did not become healthy") -> None:
        await wait_healthy(self.proc, self.url, deadline_s, what)

    def stop(self, within_s: float = 15.0) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(within_s)
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
                raise AssertionError(f"{what} (it exited with {proc.returncode})")
            async with probe.get(f"{url}/health") as resp:
                return resp.status == 200

        await eventually(healthy, timeout=deadline_s, interval=0.1, what=what, ignoring=(aiohttp.ClientError,))


def workers_of(parent: int) -> set[int]:
    """The parent's worker processes (multiprocessing's spawned children, not its helpers)."""
    found = set()
    for child in psutil.Process(parent).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            pass  # exited meanwhile
    return found


def listening(pid: int, port: int) -> bool:
    try:
        connections = psutil.Process(pid).net_connections("tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


async def every_worker_listens(proc: subprocess.Popen, port: int, workers: int, deadline_s: float = 30.0) -> set[int]:
    """Wait until `proc` has `workers` workers and each listens on `port`, and return their pids:
    /health answers once one of them does, and until the others listen every connection goes to
    that one."""

    def all_listen() -> set[int] | None:
        pids = workers_of(proc.pid)
        return pids if len(pids) == workers and all(listening(pid, port) for pid in pids) else None

    return await eventually(all_listen, timeout=deadline_s, what=f"{workers} workers listening")


@dataclass
class Served:
    """A proxy process started by `serve_process` over one fake E and one fake PD."""

    process: ProxyProcess
    encoder: FakeVLLM
    encoder_url: str
    pd: FakeVLLM

    @property
    def proc(self) -> subprocess.Popen:
        return self.process.proc

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def url(self) -> str:
        return self.process.url


@contextlib.asynccontextmanager
async def serve_process(
    *flags: str,
    stop_within_s: float = 20.0,
    env: dict[str, str] | None = None,
    starting: Callable[[subprocess.Popen], Awaitable[None]] | None = None,
) -> AsyncIterator[Served]:
    """`epd-proxy serve` over a fake E and a fake PD, once it answers /health; on the way out the
    process gets SIGTERM and must exit within `stop_within_s`, then the fakes stop. `env` is
    added to this process's environment; `starting` is awaited with the process as soon as it is
    spawned, before it answers."""
    fakes = Fakes()
    encoder, e_url = await fakes.start("encode")
    pd, pd_url = await fakes.start("pd")
    client = aiohttp.ClientSession()
    urls = ("--encode-servers-urls", e_url, "--decode-servers-urls", pd_url)
    process = ProxyProcess(client, *urls, "--log-level", "WARNING", *flags, env=env)
    try:
        if starting is not None:
            await starting(process.proc)
        await process.healthy()
        yield Served(process, encoder, e_url, pd)
    finally:
        process.proc.terminate()
        try:
            await asyncio.to_thread(process.proc.wait, stop_within_s)
        finally:
            await client.close()
            await fakes.close()
