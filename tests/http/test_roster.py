"""Proxy processes sharing one dynamic roster through a real redis-server (`--roster`).

Every proxy is a real `epd-proxy serve` process; the backends are in-process fakes. Tests wait by
polling with deadlines, never by sleeping for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from epd_proxy.fleet.registry import Record, Registry, RegistryError
from epd_proxy.fleet.roster import RedisRoster
from epd_proxy_tools.testing.fake_vllm import FakeVLLM
from epd_proxy_tools.testing.harness import Fakes, ProxyProcess, free_port
from epd_proxy_tools.testing.polling import eventually
from epd_proxy_tools.testing.redis_server import RedisServer
from tests.media import chat, image

KEY = "roster-test-key"
DEADLINE_S = 20.0
# A proxy still starting, or busy with a store that went away, may not answer a poll.
POLL = {"timeout": DEADLINE_S, "ignoring": (aiohttp.ClientError, TimeoutError)}


class Proxy(ProxyProcess):
    admin_key = KEY

    def __init__(self, client: aiohttp.ClientSession, roster_url: str, *extra: str, workers: int = 1) -> None:
        flags = ["--dynamic-registration", "--roster", roster_url, "--workers", str(workers), "--log-level", "WARNING"]
        flags += ["--probe-interval", "0.2", "--probe-timeout", "1", *extra]
        super().__init__(client, *flags, env={"ADMIN_API_KEY": KEY})

    async def ready(self) -> None:
        async def up() -> bool:
            assert self.proc.poll() is None, f"proxy on {self.port} exited with {self.proc.returncode}"
            return (await self.get("/health"))[0] == 200

        await eventually(up, what=f"proxy on {self.port} answers /health", **POLL)

    async def members(self) -> dict[str, list[str]]:
        """role -> URLs (live or evicted) as this process sees them."""
        status, body = await self.get("/instances")
        assert status == 200
        return {role: sorted(v["live"] + v["evicted"]) for role, v in body.items() if v["live"] or v["evicted"]}

    async def roster_status(self) -> str:
        return (await self.get("/health"))[1]["roster"]["status"]

    async def ask(self, n: int, with_image: bool = True) -> tuple[int, dict]:
        """Question `n` (with an image of its own unless told otherwise): the status and the body."""
        body = chat(image(str(n))) if with_image else chat(text=f"question {n}")
        async with await self.chat(body) as resp:
            return resp.status, await resp.json()


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(free_port(), tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture
async def fakes():
    """Start in-process fake vLLM servers: `await fakes("encode", "pd")` -> [(fake, url), ...]."""
    started = Fakes()

    async def start(*roles: str) -> list[tuple[FakeVLLM, str]]:
        return [await started.start(role) for role in roles]

    yield start
    await started.close()


@pytest.fixture
async def proxies(redis_server):
    started: list[Proxy] = []
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))

    async def start(n: int, *extra: str, workers: int = 1) -> list[Proxy]:
        new = [Proxy(client, redis_server.url("t"), *extra, workers=workers) for _ in range(n)]
        started.extend(new)
        await asyncio.gather(*(p.ready() for p in new))
        return new

    yield start
    for proxy in started:
        await asyncio.to_thread(proxy.stop)
    await client.close()


async def test_three_processes_share_one_roster_and_survive_the_store(redis_server, fakes, proxies):
    (encoder, e_url), (pd, pd_url), (_, e2_url) = await fakes("encode", "pd", "encode")
    # Without an encoder, image requests are refused rather than encoded by the PD: what each
    # process knows of the fleet shows in its answers.
    a, b, c = await proxies(3, "--no-consumer-encode")
    want = {"encode": [e_url], "prefill_decode": [pd_url]}

    # Register through A; B and C learn of it from the store's change notification.
    assert await a.register("encode", e_url) == (200, {"registered": True})
    assert await a.register("prefill_decode", pd_url) == (200, {"registered": True})
    assert await a.members() == want  # read-your-writes on the process that took the registration
    started = time.monotonic()
    await asyncio.gather(
        *(eventually(lambda p=p: _has(p, want), what=f"{p.url} sees A's registrations", **POLL) for p in (b, c))
    )
    print(f"\nregistration visible on the other processes after {(time.monotonic() - started) * 1000:.0f} ms")

    # Route through the others.
    for n, proxy in enumerate((b, c, b, c)):
        status, body = await proxy.ask(n)
        assert status == 200, body
    assert len(encoder.requests) == 4 and pd.loaded_from_cache == 4

    # Same rules as one registry: a role conflict found in the shared roster is a 409 anywhere.
    status, body = await b.register("decode", e2_url)
    assert status == 409 and "prefill_decode" in body["error"]["message"]
    status, body = await c.register("prefill_decode", e_url)
    assert status == 409

    # Delete through a third process; everyone drops it, and image requests have no encoder left.
    assert await c.unregister(e_url) == (200, {"removed": True})
    for proxy in (a, b, c):
        await eventually(
            lambda p=proxy: _has(p, {"prefill_decode": [pd_url]}), what=f"{proxy.url} drops the encoder", **POLL
        )
    status, body = await a.ask(10)
    assert status == 503, body
    assert await b.register("encode", e_url) == (200, {"registered": True})
    for proxy in (a, b, c):
        await eventually(lambda p=proxy: _has(p, want), what=f"{proxy.url} sees the encoder again", **POLL)

    # The store goes away: traffic continues on the last roster, the store is reported down,
    # and the fleet cannot change.
    redis_server.kill()
    for proxy in (a, b, c):
        await eventually(lambda p=proxy: _status_is(p, "down"), what=f"{proxy.url} reports the store down", **POLL)
        status, metrics = await proxy.get("/metrics")
        assert "epd_roster_up 0.0" in metrics
    for n, proxy in enumerate((a, b, c, a, b, c), start=20):
        status, body = await proxy.ask(n)
        assert status == 200, body
    status, body = await a.register("encode", e2_url)
    assert status == 503 and body["error"]["type"] == "roster_unavailable", body
    assert "unreachable" in body["error"]["message"]
    status, body = await c.unregister(e_url)
    assert status == 503, body
    assert await b.members() == want

    # It comes back empty (no persistence): the processes put the roster back, converge, and
    # accept changes again, seen everywhere.
    redis_server.start()
    for proxy in (a, b, c):
        await eventually(lambda p=proxy: _status_is(p, "up"), what=f"{proxy.url} reports the store up", **POLL)
    assert redis_server.command("EXISTS", f"t:instance:{pd_url}") == "1"
    status, body = await c.register("encode", e2_url)
    assert (status, body) == (200, {"registered": True})
    both = {"encode": sorted([e_url, e2_url]), "prefill_decode": [pd_url]}
    for proxy in (a, b, c):
        await eventually(lambda p=proxy: _has(p, both), what=f"{proxy.url} converges after the store restart", **POLL)
        status, metrics = await proxy.get("/metrics")
        assert "epd_roster_up 1.0" in metrics
    # What one encodes reaches the others again once their channel to the store has rejoined
    # (each process on its own backoff): A encodes a new image at every poll until B hears one.
    before = await _replica_count(b, "heard")
    images = iter(range(40, 1000))

    async def heard_again() -> bool:
        status, body = await a.ask(next(images))
        assert status == 200, body
        return await _replica_count(b, "heard") > before

    await eventually(heard_again, what="B hears what A encoded after the store restart", **POLL)


async def test_a_record_nobody_keeps_alive_expires_everywhere(redis_server, fakes, proxies):
    """--evicted-ttl is the record's TTL in the store: instances some process has in rotation get
    it renewed; one that every process evicted is forgotten by all of them when it runs out."""
    ((pd, pd_url),) = await fakes("pd")
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    a, b = await proxies(2, "--evicted-ttl", "1.5", "--fail-threshold", "1")
    assert (await a.register("prefill_decode", pd_url))[0] == 200
    registered_at = time.monotonic()
    assert (await b.register("encode", dead_url))[0] == 200
    ttl_ms = int(redis_server.command("PTTL", f"t:instance:{dead_url}"))
    assert 0 < ttl_ms <= 1500

    for proxy in (a, b):
        await eventually(lambda p=proxy: _evicted(p, dead_url), what=f"{proxy.url} evicts the dead encoder", **POLL)
    for proxy in (a, b):
        await eventually(
            lambda p=proxy: _has(p, {"prefill_decode": [pd_url]}), what=f"{proxy.url} forgets the dead encoder", **POLL
        )
    assert redis_server.command("EXISTS", f"t:instance:{dead_url}") == "0"
    # The healthy PD outlived its own first TTL: the processes renewed its lease.
    assert time.monotonic() - registered_at > 1.5
    assert int(redis_server.command("PTTL", f"t:instance:{pd_url}")) > 0
    status, body = await a.ask(1, with_image=False)
    assert status == 200, body


@contextlib.asynccontextmanager
async def fresh_connections(proxy: Proxy):
    """Every request of `proxy` on a new connection, so each may land on any of its workers."""
    shared = proxy.client
    proxy.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        yield
    finally:
        await proxy.client.close()
        proxy.client = shared


async def on_every_worker(check: Callable[[], Awaitable[bool]], what: str, times: int) -> None:
    """Poll until `check` holds `times` times in a row: a worker that disagrees would break the run."""
    streak = 0

    async def steady() -> bool:
        nonlocal streak
        streak = streak + 1 if await check() else 0
        return streak >= times

    await eventually(steady, what=what, **POLL)


async def test_workers_share_the_roster(redis_server, fakes, proxies):
    """`--workers 2 --roster`: one port, two processes, each fresh connection landing on either.
    A registration reaching one worker must show on every read and route every request."""
    (encoder, e_url), (pd, pd_url) = await fakes("encode", "pd")
    (proxy,) = await proxies(1, workers=2)
    assert (await proxy.register("encode", e_url))[0] == 200
    assert (await proxy.register("prefill_decode", pd_url))[0] == 200
    want = {"encode": [e_url], "prefill_decode": [pd_url]}
    async with fresh_connections(proxy):
        await on_every_worker(lambda: _has(proxy, want), "every worker sees the registrations", times=30)
        for n in range(12):
            status, body = await proxy.ask(n)
            assert status == 200, body
    assert len(encoder.requests) == 12 and pd.loaded_from_cache == 12


async def test_workers_drop_the_metric_series_of_a_removed_instance(redis_server, fakes, proxies):
    """With --workers every worker's counters live in shared files that outlast the instance they
    name; /metrics must still forget an instance once it left, whichever worker answers."""
    (_, e1), (_, e2), (_, pd_url) = await fakes("encode", "encode", "pd")
    (proxy,) = await proxies(1, workers=2)
    for role, url in (("encode", e1), ("encode", e2), ("prefill_decode", pd_url)):
        assert (await proxy.register(role, url))[0] == 200
    want = {"encode": sorted([e1, e2]), "prefill_decode": [pd_url]}

    async def scrape() -> str:
        status, text = await proxy.get("/metrics")
        assert status == 200
        return text

    async def forgotten() -> bool:
        text = await scrape()
        assert f'epd_encoder_subrequests_total{{encoder="{e2}"}}' in text  # the others stay
        return e1 not in text

    async with fresh_connections(proxy):
        await on_every_worker(lambda: _has(proxy, want), "every worker sees the registrations", times=20)
        for n in range(8):
            status, body = await proxy.ask(n)
            assert status == 200, body
        text = await scrape()
        assert f'epd_encoder_subrequests_total{{encoder="{e1}"}}' in text
        assert f'epd_instance_up{{instance="{e1}",role="encode"}}' in text
        assert (await proxy.unregister(e1))[0] == 200
        await on_every_worker(forgotten, "no worker reports the removed encoder", times=20)


async def test_an_image_one_replica_saw_encoded_goes_raw_through_another(redis_server, fakes, proxies):
    """Replicas sharing a roster tell each other through its store what they saw encoded
    (fleet/replicas.py): the EC store holds it for every consumer, so another replica sends the
    same image raw under its name instead of having it encoded again. Without KV events, the
    record is all either replica knows of what the fleet holds."""
    (encoder, e_url), (pd, pd_url) = await fakes("encode", "pd")
    a, b = await proxies(2, "--no-kv-events")
    assert (await a.register("encode", e_url))[0] == 200
    assert (await a.register("prefill_decode", pd_url))[0] == 200
    want = {"encode": [e_url], "prefill_decode": [pd_url]}
    await eventually(lambda: _has(b, want), what="B sees A's registrations", **POLL)

    status, body = await a.ask(1)
    assert status == 200, body
    assert len(encoder.requests) == 1
    await eventually(lambda: _replica_names(a, "told", 1), what="A tells of its encoded image", **POLL)
    await eventually(lambda: _replica_names(b, "heard", 1), what="B hears of it", **POLL)

    status, body = await b.ask(1)
    assert status == 200, body
    assert len(encoder.requests) == 1, "B had the image A saw encoded encoded again"
    assert pd.encoded_locally == 0  # the PD took it from its prefix or the EC store, never encoded it
    # A new image is still encoded (a replica skipping its own names: tests/unit/fleet/test_replicas.py).
    status, body = await b.ask(2)
    assert status == 200, body
    assert len(encoder.requests) == 2
    await eventually(lambda: _replica_names(b, "told", 1), what="B tells of its new image", **POLL)
    await eventually(lambda: _replica_names(a, "heard", 1), what="A hears of it", **POLL)


async def _replica_names(proxy: Proxy, what: str, count: int) -> bool:
    return await _replica_count(proxy, what) == count


async def _replica_count(proxy: Proxy, what: str) -> float:
    _, text = await proxy.get("/metrics")
    series = f'epd_replica_names_total{{what="{what}"}} '
    return next((float(line.removeprefix(series)) for line in text.splitlines() if line.startswith(series)), 0.0)


async def _has(proxy: Proxy, want: dict[str, list[str]]) -> bool:
    return await proxy.members() == want


async def _status_is(proxy: Proxy, status: str) -> bool:
    return await proxy.roster_status() == status


async def _evicted(proxy: Proxy, url: str) -> bool:
    _, body = await proxy.get("/instances")
    return url in body["encode"]["evicted"]


async def test_a_proxy_started_before_its_store_serves_and_joins_when_it_appears(tmp_path, fakes):
    ((pd, pd_url),) = await fakes("pd")
    store = RedisServer(free_port(), tmp_path / "late-redis")  # not started yet
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as client:
        proxy = Proxy(client, store.url("late"))
        try:
            await proxy.ready()
            status, body = await proxy.get("/health")
            assert body["roster"]["status"] == "down" and body["roster"]["seconds_since_sync"] is None
            status, body = await proxy.register("prefill_decode", pd_url)
            assert status == 503 and body["error"]["type"] == "roster_unavailable"
            store.start()
            await eventually(lambda: _status_is(proxy, "up"), what="the proxy connects once the store is there", **POLL)
            assert (await proxy.register("prefill_decode", pd_url))[0] == 200
            status, body = await proxy.ask(1, with_image=False)
            assert status == 200, body
        finally:
            await asyncio.to_thread(proxy.stop)
            store.kill()


# -- the roster component itself, two of them in this process standing for two proxies ------------


@pytest.fixture
async def rosters(redis_server):
    made: list[RedisRoster] = []

    async def make(prefix: str, n: int = 2) -> list[tuple[RedisRoster, Registry]]:
        out = []
        for _ in range(n):
            fleet = Registry(dynamic=True)
            roster = RedisRoster(
                redis_server.url(prefix), ttl_s=60, on_change=fleet.sync, in_rotation=lambda f=fleet: urls(f.all())
            )
            made.append(roster)
            await roster.start()
            assert roster.up
            out.append((roster, fleet))
        return out

    yield make
    for roster in made:
        await roster.close()


@pytest.mark.parametrize("round_", range(5))
async def test_conflicting_registrations_at_once_admit_exactly_one(rosters, round_):
    (r1, _), (r2, _) = await rosters(f"race{round_}")
    results = await asyncio.gather(
        r1.add(Record("http://pd", "prefill_decode")), r2.add(Record("http://p", "prefill")), return_exceptions=True
    )
    assert sorted(type(r).__name__ for r in results) == ["RegistryError", "bool"], results
    assert [r.status for r in results if isinstance(r, RegistryError)] == [409]


async def test_a_flushed_store_is_refilled_but_an_emptied_roster_stays_empty(rosters, redis_server):
    (r1, fleet1), (r2, fleet2) = await rosters("wipe")
    assert await r1.add(Record("http://pd", "prefill_decode")) is True

    async def second_sees_it() -> bool:
        return bool(fleet2.members("prefill_decode"))

    await eventually(second_sees_it, what="the second roster sees the PD", **POLL)

    redis_server.command("FLUSHALL")  # the store loses its data under connected clients
    await r2.resync()
    assert redis_server.command("EXISTS", "wipe:instance:http://pd") == "1"
    await r1.resync()
    assert urls(fleet1.members("prefill_decode")) == urls(fleet2.members("prefill_decode")) == ["http://pd"]

    assert await r2.remove("http://pd") is True
    await r1.resync()
    assert fleet1.members("prefill_decode") == [] and redis_server.command("EXISTS", "wipe:instance:http://pd") == "0"


def urls(instances) -> list[str]:
    return [inst.url for inst in instances]
