"""Active health checks (prober.py) against real loopback servers."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd_proxy.fleet.backends import ENCODE, Instance
from epd_proxy.fleet.prober import Prober, check, check_pool
from epd_proxy_tools.testing.harness import free_port
from epd_proxy_tools.testing.polling import eventually


class Backend:
    """/health answering `status` (after `delay_s`), recording what each check sent."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.status, self.delay_s = status, delay_s
        self.seen: list[dict[str, str]] = []
        self.peers: list[tuple] = []

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            self.seen.append(dict(request.headers))
            self.peers.append(request.transport.get_extra_info("peername"))
            await asyncio.sleep(self.delay_s)
            return web.Response(status=self.status)

        app = web.Application()
        app.router.add_get("/health", health)
        return app


@pytest.fixture
async def serve():
    servers: list[TestServer] = []

    async def start(backend: Backend) -> Instance:
        server = TestServer(backend.app())
        await server.start_server()
        servers.append(server)
        return Instance(str(server.make_url("")).rstrip("/"), ENCODE)

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def pool():
    checks = check_pool({"Authorization": "Bearer backend-key"})
    yield checks
    await checks.close()


async def test_a_200_is_healthy_and_the_check_carries_the_backend_key(serve, pool):
    backend = Backend()
    assert await check(pool, await serve(backend), 2.0) is None
    assert backend.seen[0]["Authorization"] == "Bearer backend-key"


async def test_any_other_status_is_a_problem_named_by_it(serve, pool):
    assert await check(pool, await serve(Backend(503)), 2.0) == "HTTP 503"


async def test_a_check_that_takes_too_long_or_finds_nobody_is_a_problem(serve, pool):
    slow = await check(pool, await serve(Backend(delay_s=5.0)), 0.2)
    refused = await check(pool, Instance(f"http://127.0.0.1:{free_port()}", ENCODE), 2.0)
    assert slow and refused and slow != refused


async def test_checks_open_a_fresh_connection_each_time_and_count_as_no_work(serve, pool):
    backend = Backend()
    inst = await serve(backend)
    for _ in range(3):
        assert await check(pool, inst, 2.0) is None
    assert inst.inflight == 0
    assert len(set(backend.peers)) == 3, backend.peers


class RecordingHealth:
    def __init__(self) -> None:
        self.results: list[tuple[str, str | None]] = []

    def checked(self, inst: Instance, problem: str | None) -> None:
        self.results.append((inst.url, problem))


async def test_a_round_checks_every_member_and_reports_each_result(serve, pool):
    good, bad = await serve(Backend()), await serve(Backend(500))
    health = RecordingHealth()
    prober = Prober(pool, health, lambda: [good, bad], interval_s=60, timeout_s=2)
    await prober.round()
    assert sorted(health.results) == sorted([(good.url, None), (bad.url, "HTTP 500")])
    assert prober.rounds == 1


async def test_a_failing_round_does_not_stop_the_checks(serve, pool):
    inst = await serve(Backend())
    calls = []

    def members():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the registry broke once")
        return [inst]

    health = RecordingHealth()
    rounds = []
    prober = Prober(pool, health, members, interval_s=0.01, timeout_s=2)
    task = asyncio.create_task(prober.run_forever(lambda: rounds.append(prober.rounds)))
    try:
        await eventually(lambda: len(rounds) >= 2, what="two rounds after the failed one")
    finally:
        task.cancel()
    assert rounds[:2] == [1, 2] and health.results[0] == (inst.url, None)
