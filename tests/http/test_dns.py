"""Instances found through DNS, against a real DNS server: unbound (`make system-packages`) on a loopback port,
serving a zone each test rewrites while traffic flows through a real `epd-proxy serve` process.

The fakes are in-process fake vLLM servers. `dns://` names give every address the same port, so
those fakes listen on distinct loopback addresses (127.0.0.2, 127.0.0.3, ... and ::1) on one port;
`dns+srv://` names carry the ports. Tests wait by polling with deadlines, never by fixed sleeps.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from epd_proxy_tools.testing.dns_server import UnboundServer
from epd_proxy_tools.testing.fake_vllm import ECStore, FakeVLLM
from epd_proxy_tools.testing.harness import ProxyProcess, free_port
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

DEADLINE_S = 20.0
POLL = {"timeout": DEADLINE_S, "ignoring": (aiohttp.ClientError, TimeoutError)}
REFRESH_S = 0.5
CONCURRENCY = 4


def free_port_everywhere(hosts: list[str]) -> int:
    """A port free on every one of these loopback addresses."""
    for _ in range(50):
        port = free_port()
        try:
            for host in hosts:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                with socket.socket(family) as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Fleet:
    """In-process fakes started and stopped by the test, sharing one EC store."""

    def __init__(self) -> None:
        self.store = ECStore()
        self.servers: dict[str, tuple[FakeVLLM, TestServer]] = {}

    async def start(self, role: str, host: str, port: int = 0) -> tuple[FakeVLLM, str]:
        fake = FakeVLLM(role, self.store)
        server = TestServer(fake.app(), host=host, port=port or None)
        await server.start_server()
        address = url(host, server.port)
        self.servers[address] = (fake, server)
        return fake, address

    def connections(self, address: str) -> int:
        return len(self.servers[address][1].runner.server.connections)

    async def stop(self, address: str) -> None:
        """A graceful stop, as vLLM on SIGTERM: requests it holds finish, then it closes."""
        _, server = self.servers.pop(address)
        await server.close()

    async def die(self, address: str) -> None:
        """Gone at once, as a killed process: the port refuses and open connections break."""
        _, server = self.servers.pop(address)
        for site in list(server.runner.sites):
            await site.stop()
        for handler in server.runner.server.connections:
            if handler.transport is not None:
                handler.transport.abort()
        await server.close()

    async def close(self) -> None:
        for address in list(self.servers):
            await self.stop(address)


class Proxy(ProxyProcess):
    def __init__(self, client: aiohttp.ClientSession, dns: UnboundServer, *flags: str, env: dict | None = None) -> None:
        common = ["--dns-server", dns.address, "--dns-refresh", str(REFRESH_S), "--probe-interval", "0.5"]
        common += ["--probe-timeout", "1", "--log-level", "WARNING"]
        super().__init__(client, *common, *flags, env=env)

    async def health(self) -> dict:
        assert self.proc.poll() is None, f"the proxy exited with {self.proc.returncode}"
        return (await self.get("/health"))[1]

    async def members(self) -> set[str]:
        return set((await self.health())["instances"])

    async def has(self, *wanted: str, without: tuple[str, ...] = ()) -> bool:
        members = await self.members()
        return set(wanted) <= members and not set(without) & members


class Traffic:
    """Chat requests with an image at a fixed concurrency until the test stops it, which every test
    does in a `finally`. No deadline or budget of its own: one that runs out before the test's
    waits do (each may take its DEADLINE_S on a loaded machine) would end it mid-step, and that
    step would fail as if the proxy had stopped sending there."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self.answered = [0] * CONCURRENCY  # per worker
        self._tasks = [asyncio.create_task(self._loop(n)) for n in range(CONCURRENCY)]

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    async def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                async with self.proxy.client.post(
                    f"{self.proxy.url}/v1/chat/completions", json=chat(image(f"{worker}-{n}"))
                ) as resp:
                    body = await resp.read()
                    status = resp.status
            except aiohttp.ClientError as exc:
                status, body = 0, repr(exc).encode()
            self.statuses[status] += 1
            self.answered[worker] += 1
            if status != 200:
                self.failures.append(f"{status}: {body[:300]!r}")

    async def more(self, count: int) -> None:
        """Until `count` more requests have been answered."""
        target = self.sent + count
        await eventually(lambda: self.sent >= target, what=f"{count} more requests answered", timeout=DEADLINE_S)

    async def settle(self) -> None:
        """Until every worker has had an answer to a request it sent after now."""
        then = list(self.answered)
        await eventually(
            lambda: all(now > before + 1 for now, before in zip(self.answered, then)),
            what="every worker's request under way answered",
            timeout=DEADLINE_S,
        )

    async def stop(self) -> Counter[int]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.statuses


@pytest.fixture
def unbound(tmp_path: Path):
    server = UnboundServer(free_port(), tmp_path / "unbound")
    yield server
    server.kill()


@pytest.fixture
async def fleet():
    made = Fleet()
    yield made
    await made.close()


@pytest.fixture
async def proxy_for(unbound):
    started: list[Proxy] = []
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))

    async def start(*flags: str, env: dict | None = None) -> Proxy:
        proxy = Proxy(client, unbound, *flags, env=env)
        started.append(proxy)
        # Start-up is not what is tested: on a loaded machine --workers 2 takes a while to spawn.
        await eventually(
            lambda: _status_is(proxy, 200), what="the proxy answers /health with 200", **{**POLL, "timeout": 60}
        )
        return proxy

    yield start
    for proxy in started:
        await asyncio.to_thread(proxy.stop)
    await client.close()


async def _status_is(proxy: Proxy, status: int) -> bool:
    assert proxy.proc.poll() is None, f"the proxy exited with {proxy.proc.returncode}"
    return (await proxy.get("/health"))[0] == status


async def _gets_traffic(fleet: Fleet, address: str, traffic: Traffic, what: str) -> None:
    """Until the instance at `address` has a request it did not have before. An encoder the
    scheduler measured slow (one that joined while `_leave_with_notice` slowed them all) waits
    for lanes.STALE_S after its last answer at most (tests/unit/fleet/test_scale_up.py)."""
    fake = fleet.servers[address][0]
    seen, answered = len(fake.requests), traffic.sent
    try:
        await eventually(lambda: len(fake.requests) > seen, what=f"{what} gets requests", timeout=DEADLINE_S)
    except AssertionError as failure:
        # What the proxy made of it meanwhile: in rotation or not, and its scheduler lane.
        health = (await traffic.proxy.health())["instances"].get(address)
        lanes = (await traffic.proxy.get("/status.json"))[1]["scheduler"]["encoders"]
        lane = next((lane for lane in lanes if lane["url"] == address), None)
        meanwhile = f"{traffic.sent - answered} requests answered meanwhile; health {health}; lane {lane}"
        raise AssertionError(f"{failure}; {meanwhile}") from None


async def _leave_with_notice(proxy: Proxy, fleet: Fleet, address: str, unbound: UnboundServer, records: list[str]):
    """Take `address` out of DNS while the proxy has calls under way on it (the fakes of its role
    are slowed so there are some: slowing it alone would have the encoder scheduler send it
    nothing), wait for the proxy to drop it and for those calls to finish, then stop it, as a
    preStop hook does on Kubernetes."""
    role = fleet.servers[address][0].role
    slowed = [fake for fake, _ in fleet.servers.values() if fake.role == role]
    for fake in slowed:
        fake.faults.delay_s = 0.3

    async def busy() -> bool:
        return (await proxy.health())["instances"][address]["inflight"] > 0

    await eventually(busy, what=f"the proxy has calls under way on {address}", **POLL)
    unbound.publish(records)
    await eventually(lambda: proxy.has(without=(address,)), what=f"the proxy drops {address}", **POLL)
    await eventually(lambda: fleet.connections(address) == 0, what=f"the proxy's calls to {address} finish", **POLL)
    await fleet.stop(address)
    for fake in slowed:
        fake.faults.delay_s = 0.0


async def test_instances_join_leave_and_move_while_traffic_flows(unbound, fleet, proxy_for):
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "::1"]
    port = free_port_everywhere(hosts)
    e1, e1_url = await fleet.start("encode", "127.0.0.2", port)
    pd1, pd1_url = await fleet.start("pd", "127.0.0.1")
    unbound.records = ["enc A 127.0.0.2", f"_http._tcp.pd SRV 0 0 {pd1_url.rsplit(':', 1)[1]} pd1", "pd1 A 127.0.0.1"]
    unbound.start()
    proxy = await proxy_for(
        "--encode-servers-urls",
        f"dns://{unbound.name('enc')}:{port}",
        "--decode-servers-urls",
        f"dns+srv://{unbound.name('_http._tcp.pd')}",
    )
    assert await proxy.members() == {e1_url, pd1_url}
    dns = (await proxy.health())["dns"]
    assert dns[f"dns://{unbound.name('enc')}:{port}"]["status"] == "ok", dns

    traffic = Traffic(proxy)
    try:
        await traffic.more(20)
        # Join: two more encoders, one by its AAAA record.
        e2, e2_url = await fleet.start("encode", "127.0.0.3", port)
        e6, e6_url = await fleet.start("encode", "::1", port)
        srv = unbound.records[1:]
        unbound.publish(["enc A 127.0.0.2", "enc A 127.0.0.3", "enc AAAA ::1", *srv])
        await eventually(lambda: proxy.has(e2_url, e6_url), what="the proxy adds the new encoders", **POLL)
        await _gets_traffic(fleet, e2_url, traffic, "the A-record encoder")
        await _gets_traffic(fleet, e6_url, traffic, "the AAAA-record encoder")

        # Leave with notice: out of DNS first, stopped once the proxy let go of it.
        await _leave_with_notice(proxy, fleet, e1_url, unbound, ["enc A 127.0.0.3", "enc AAAA ::1", *srv])
        await traffic.more(20)

        # An encoder changes address (a rescheduled pod): the new one joins, the old one drains.
        e3, e3_url = await fleet.start("encode", "127.0.0.4", port)
        unbound.publish(["enc A 127.0.0.3", "enc A 127.0.0.4", "enc AAAA ::1", *srv])
        await eventually(lambda: proxy.has(e3_url), what="the proxy adds the moved encoder", **POLL)
        await _leave_with_notice(proxy, fleet, e2_url, unbound, ["enc A 127.0.0.4", "enc AAAA ::1", *srv])
        await _gets_traffic(fleet, e3_url, traffic, "the moved encoder")

        # PD moves to another port: SRV carries it.
        pd2, pd2_url = await fleet.start("pd", "127.0.0.1")
        moved = ["enc A 127.0.0.4", "enc AAAA ::1", f"_http._tcp.pd SRV 0 0 {pd2_url.rsplit(':', 1)[1]} pd2"]
        unbound.publish([*moved, *srv, "pd2 A 127.0.0.1"])
        await eventually(lambda: proxy.has(pd2_url), what="the proxy adds the moved PD", **POLL)
        await _leave_with_notice(proxy, fleet, pd1_url, unbound, [*moved, "pd2 A 127.0.0.1"])
        await _gets_traffic(fleet, pd2_url, traffic, "the moved PD")
        await traffic.more(20)
    finally:
        statuses = await traffic.stop()
    print(f"\n{traffic.sent} requests through joins, departures and moves: {dict(statuses)}")
    assert statuses == {200: traffic.sent}, traffic.failures[:5]
    assert await proxy.members() == {e3_url, e6_url, pd2_url}
    assert pd1.loaded_from_cache > 0 and pd2.loaded_from_cache > 0 and e1.requests


async def test_an_instance_that_dies_without_notice_fails_a_bounded_number_of_requests(unbound, fleet, proxy_for):
    port = free_port_everywhere(["127.0.0.2", "127.0.0.3"])
    _, e_url = await fleet.start("encode", "127.0.0.1")
    pd_a, a_url = await fleet.start("pd", "127.0.0.2", port)
    pd_b, b_url = await fleet.start("pd", "127.0.0.3", port)
    e_port = e_url.rsplit(":", 1)[1]
    srv = [f"_http._tcp.enc SRV 0 0 {e_port} e1", "e1 A 127.0.0.1"]
    unbound.records = [*srv, "pd A 127.0.0.2", "pd A 127.0.0.3"]
    unbound.start()
    proxy = await proxy_for(
        "--encode-servers-urls",
        f"dns+srv://{unbound.name('_http._tcp.enc')}",
        "--decode-servers-urls",
        f"dns://{unbound.name('pd')}:{port}",
    )
    assert await proxy.members() == {e_url, a_url, b_url}
    traffic = Traffic(proxy)
    try:
        await _gets_traffic(fleet, b_url, traffic, "the PD that will die")
        await fleet.die(b_url)  # still in DNS: nobody told the proxy

        async def out_of_rotation() -> bool:
            return not (await proxy.health())["instances"][b_url]["in_rotation"]

        await eventually(out_of_rotation, what="the proxy takes the dead PD out of rotation", **POLL)
        await traffic.settle()  # the requests under way then may have chosen it before
        failed_by_then = traffic.sent - traffic.statuses[200]
        await traffic.more(100)
        assert traffic.sent - traffic.statuses[200] == failed_by_then, traffic.failures[-3:]
        # Then Kubernetes removes the dead pod from the Service: the proxy forgets it.
        unbound.publish([*srv, "pd A 127.0.0.2"])
        await eventually(lambda: proxy.has(a_url, without=(b_url,)), what="the proxy drops the dead PD", **POLL)
        await traffic.more(20)
    finally:
        statuses = await traffic.stop()
    failed = traffic.sent - statuses[200]
    print(f"\n{traffic.sent} requests, {failed} failed when a PD died without notice: {dict(statuses)}")
    # Only what was under way on it when it died can fail (none may have been): a request it
    # refused before outlier detection ejected it goes to the other PD (pipeline: a consumer that
    # took none of the request hands it on), so the bound is what the old rule allowed.
    assert failed <= 2 * CONCURRENCY + 3, traffic.failures
    assert set(statuses) <= {200, 502}, traffic.failures


async def test_a_failed_resolution_keeps_the_last_good_set_and_says_so(unbound, fleet, proxy_for):
    _, e_url = await fleet.start("encode", "127.0.0.1")
    pd, pd_url = await fleet.start("pd", "127.0.0.1")
    unbound.records = [
        f"_http._tcp.enc SRV 0 0 {e_url.rsplit(':', 1)[1]} host",
        f"_http._tcp.pd SRV 0 0 {pd_url.rsplit(':', 1)[1]} host",
        "host A 127.0.0.1",
    ]
    unbound.start()
    name = f"dns+srv://{unbound.name('_http._tcp.pd')}"
    proxy = await proxy_for(
        "--encode-servers-urls", f"dns+srv://{unbound.name('_http._tcp.enc')}", "--decode-servers-urls", name
    )
    unbound.kill()

    async def failing() -> dict | None:
        dns = (await proxy.health())["dns"][name]
        return dns if dns["status"] == "failing" else None

    dns = await eventually(failing, what="/health reports the resolution failing", **POLL)
    assert dns["addresses"] == [pd_url] and "no answer" in dns["error"], dns
    status, metrics = await proxy.get("/metrics")
    assert f'epd_dns_up{{name="{name}"}} 0.0' in metrics
    assert f'epd_dns_resolution_failures_total{{name="{name}"}}' in metrics
    assert f'epd_dns_addresses{{name="{name}"}} 1.0' in metrics
    for n in range(5):  # still routing on the last good set
        async with proxy.client.post(f"{proxy.url}/v1/chat/completions", json=chat(image(str(n)))) as resp:
            assert resp.status == 200, await resp.text()
    assert await proxy.members() == {e_url, pd_url}

    # Back, and now it says there is no PD: an answer, so the set empties and /health says 503.
    unbound.records = unbound.records[:1] + unbound.records[2:]
    unbound.start()
    await eventually(lambda: _status_is(proxy, 503), what="the proxy reports the emptied decode stage", **POLL)
    body = await proxy.health()
    assert body["dns"][name]["status"] == "ok" and body["dns"][name]["addresses"] == []
    assert body["decode_cluster"] == "empty" and pd_url not in body["instances"]
    async with proxy.client.post(f"{proxy.url}/v1/chat/completions", json=chat(text="hi")) as resp:
        assert resp.status == 503


async def test_dns_names_next_to_dynamic_registration(unbound, fleet, proxy_for):
    """Encoders from DNS, the PD registered: each source keeps what it added."""
    _, e_url = await fleet.start("encode", "127.0.0.1")
    pd, pd_url = await fleet.start("pd", "127.0.0.1")
    unbound.records = [f"_http._tcp.enc SRV 0 0 {e_url.rsplit(':', 1)[1]} host", "host A 127.0.0.1"]
    unbound.start()
    key = {"X-API-Key": "dns-test-key"}
    proxy = await proxy_for(
        "--dynamic-registration",
        "--encode-servers-urls",
        f"dns+srv://{unbound.name('_http._tcp.enc')}",
        env={"ADMIN_API_KEY": key["X-API-Key"]},
    )
    instances = f"{proxy.url}/instances"
    async with proxy.client.post(instances, json={"role": "prefill_decode", "url": pd_url}, headers=key) as resp:
        assert resp.status == 200, await resp.text()
    async with proxy.client.post(f"{proxy.url}/v1/chat/completions", json=chat(image("x"))) as resp:
        assert resp.status == 200, await resp.text()
    assert pd.loaded_from_cache == 1
    # What DNS found is DNS's to remove, not an admin's (it would be back on the next refresh).
    async with proxy.client.delete(instances, params={"url": e_url}, headers=key) as resp:
        body = await resp.json()
        assert resp.status == 409 and "found through dns+srv://" in body["error"]["message"], body
    body = await proxy.health()
    assert body["dns"][f"dns+srv://{unbound.name('_http._tcp.enc')}"]["addresses"] == [e_url]
    assert body["instances"]["encode"]["live"] == [e_url]


async def test_every_worker_resolves_the_names(unbound, fleet, proxy_for):
    """--workers 2: each worker resolves on its own; whichever answers has the DNS members."""
    _, e_url = await fleet.start("encode", "127.0.0.1")
    _, pd_url = await fleet.start("pd", "127.0.0.1")
    records = [f"_http._tcp.{name} SRV 0 0 {u.rsplit(':', 1)[1]} host" for name, u in (("enc", e_url), ("pd", pd_url))]
    unbound.records = [*records, "host A 127.0.0.1"]
    unbound.start()
    proxy = await proxy_for(
        "--workers",
        "2",
        "--encode-servers-urls",
        f"dns+srv://{unbound.name('_http._tcp.enc')}",
        "--decode-servers-urls",
        f"dns+srv://{unbound.name('_http._tcp.pd')}",
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
        for n in range(20):  # each on a new connection, so both workers answer some
            async with fresh.get(f"{proxy.url}/health") as resp:
                assert resp.status == 200 and set((await resp.json())["instances"]) == {e_url, pd_url}
            async with fresh.post(f"{proxy.url}/v1/chat/completions", json=chat(image(str(n)))) as resp:
                assert resp.status == 200, await resp.text()
        async with fresh.get(f"{proxy.url}/metrics") as resp:
            assert f'epd_dns_up{{name="dns+srv://{unbound.name("_http._tcp.pd")}"}} 1.0' in await resp.text()
