"""`epd-proxy serve --workers`: a worker that dies is replaced, the client connections it held stop
counting against --max-client-connections, and /metrics shows every series a single process shows."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from epd_proxy_tools.testing.harness import every_worker_listens, listening, serve_command, serve_process, workers_of
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_slow_clients import read_until_closed
from tests.media import chat, image

DEADLINE_S = 30.0
# Backends for a proxy that must not get as far as calling them.
NOWHERE = ("--encode-servers-urls", "http://127.0.0.1:9", "--decode-servers-urls", "http://127.0.0.1:10")
HEALTH = b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n"


def established(pid: int, port: int) -> int:
    """Client connections to `port` that process `pid` holds."""
    connections = psutil.Process(pid).net_connections("tcp")
    return sum(1 for c in connections if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)


async def held_connection(port: int) -> asyncio.StreamWriter:
    """A client connection answered 200 on /health and kept open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEALTH)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    return writer


async def scrape(url: str) -> tuple[int, str]:
    """/metrics on a connection of its own, so it may land on any worker."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as scraper:
        async with scraper.get(f"{url}/metrics") as resp:
            return resp.status, await resp.text()


def sample(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and not s.labels:
                return s.value
    return None


async def test_a_killed_worker_is_replaced_and_the_connections_it_held_are_released(tmp_path):
    limit = 6
    flags = ("--workers", "2", "--max-client-connections", str(limit))
    async with serve_process(*flags, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) as served:
        parent, port = served.proc.pid, served.port
        first = await eventually(lambda: len(workers_of(parent)) == 2 and workers_of(parent), what="two workers")
        held = [await held_connection(port) for _ in range(limit)]
        try:
            # The kernel spread the six over the two workers somehow: kill one that holds some.
            victim = max(first, key=lambda pid: established(pid, port))
            holding = established(victim, port)
            assert holding >= 1
            assert list(tmp_path.glob(f"gauge_live*_{victim}.db")), "the worker's live gauges are in files"
            os.kill(victim, signal.SIGKILL)
        finally:
            for writer in held:
                writer.close()

        def replaced() -> set[int]:
            workers = workers_of(parent)
            return len(workers) == 2 and victim not in workers and workers - first

        (new,) = await eventually(replaced, timeout=DEADLINE_S, what="the parent to start a new worker")
        await eventually(lambda: listening(new, port), timeout=DEADLINE_S, what="the new worker to listen")
        # The dead worker's gauges do not linger in every scrape's sums.
        assert not list(tmp_path.glob(f"gauge_live*_{victim}.db"))
        # Nothing counts but the scrape itself: the dead worker's connections were released.
        await eventually(
            lambda: scrape_is_alone(served.url),
            timeout=DEADLINE_S,
            what=f"epd_client_connections to drop back once the {holding} held by the dead worker went",
        )
        # The port serves its full limit again, concurrently, and still no more.
        fresh = await asyncio.gather(*(held_connection(port) for _ in range(limit)))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEALTH)
            answer = await read_until_closed(reader)
            writer.close()
            assert not answer or answer.startswith(b"HTTP/1.1 503"), answer
        finally:
            for writer in fresh:
                writer.close()
        await eventually(lambda: scrape_is_alone(served.url), timeout=DEADLINE_S, what="the clients' slots freed")
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{served.url}/v1/chat/completions", json=chat(image("after"))) as resp:
                assert resp.status == 200


async def scrape_is_alone(url: str) -> bool:
    """Whether the scrape is the port's only client connection (a 503 while others still count)."""
    status, text = await scrape(url)
    return status == 200 and sample(text, "epd_client_connections") == 1.0


def series(text: str) -> set[tuple[str, str, tuple[str, ...]]]:
    """(sample name, type, label names) of every series, without the `_created` timestamps that
    prometheus-client's multiprocess mode never writes."""
    return {
        (s.name, family.type, tuple(sorted(s.labels)))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


async def test_workers_show_every_series_of_a_single_process():
    seen = {}
    for workers in ("1", "2"):
        async with serve_process("--workers", workers, "--max-client-connections", "50") as served:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{served.url}/v1/chat/completions", json=chat(image("a"))) as resp:
                    assert resp.status == 200

            async def scraped(url: str = served.url, workers: str = workers) -> bool:
                status, text = await scrape(url)
                assert status == 200, text
                seen[workers] = series(text)
                # The worker that served publishes what only it knows (its encoder estimates)
                # within a second; the other may answer the scrape first.
                return workers == "1" or seen["2"] >= seen["1"]

            await eventually(scraped, timeout=DEADLINE_S, what="every worker's series published")
    assert {name for name, _, _ in seen["1"]} >= {"epd_client_connections", "epd_client_timeouts_total"}
    assert seen["1"] - seen["2"] == set(), "missing with --workers"
    assert seen["2"] - seen["1"] == set(), "only with --workers"


def role_sample(text: str, name: str, role: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("role") == role:
                return s.value
    return None


async def test_autoscaling_figures_add_up_over_workers():
    requests = 12
    async with serve_process("--workers", "2", "--autoscale-window", "30") as served:
        # A connection per request, so the kernel spreads them over both workers (all twelve on
        # one worker: 1 in 2048).
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            for n in range(requests):
                body = chat(image(f"w{n}"), image(f"v{n}"))
                async with client.post(f"{served.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200

        async def added_up() -> bool:
            _, text = await scrape(served.url)
            arrivals = role_sample(text, "epd_role_arrivals_total", "encode")
            decodes = role_sample(text, "epd_role_arrivals_total", "decode")
            load = role_sample(text, "epd_role_offered_load", "decode")
            recommended = role_sample(text, "epd_role_recommended_replicas", "encode")
            return arrivals == 2 * requests and decodes == requests and load is not None and recommended == 1

        # Each worker publishes within a second; whichever answers the scrape adds both up.
        await eventually(added_up, timeout=DEADLINE_S, what="both workers' arrivals in one figure")


def server_side_connections(pids: set[int], port: int) -> int:
    """Connections on `port` any of the workers still has open (established or waiting to close)."""
    count = 0
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections("tcp")
        except psutil.Error:
            continue
        count += sum(1 for c in connections if c.status != psutil.CONN_LISTEN and c.laddr.port == port)
    return count


async def test_after_a_worker_is_killed_under_traffic_fresh_clients_up_to_the_limit_all_get_in():
    limit = 8
    async with serve_process("--workers", "2", "--max-client-connections", str(limit)) as served:
        parent, port = served.proc.pid, served.port
        first = await eventually(lambda: len(workers_of(parent)) == 2 and workers_of(parent), what="two workers")
        statuses: list[int] = []
        stop = asyncio.Event()

        async def traffic(client: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                try:
                    async with client.post(f"{served.url}/v1/chat/completions", json=chat(image("t"))) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                except aiohttp.ClientError:
                    statuses.append(0)  # its worker was killed under it

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)) as client:
            clients = [asyncio.create_task(traffic(client)) for _ in range(limit)]
            await eventually(lambda: statuses.count(200) >= 2 * limit, timeout=DEADLINE_S, what="traffic flowing")
            victim = max(first, key=lambda pid: established(pid, port))
            os.kill(victim, signal.SIGKILL)

            def replaced() -> set[int]:
                workers = workers_of(parent)
                return len(workers) == 2 and victim not in workers and workers - first

            (new,) = await eventually(replaced, timeout=DEADLINE_S, what="the parent to start a new worker")
            await eventually(lambda: listening(new, port), timeout=DEADLINE_S, what="the new worker to listen")
            recovered = len(statuses)
            await eventually(
                lambda: statuses[recovered:].count(200) >= 2 * limit, timeout=DEADLINE_S, what="traffic recovered"
            )
            stop.set()
            await asyncio.gather(*clients)
        workers = first - {victim} | {new}
        # Every connection the traffic had is closed on the workers' side too before the fresh ones come.
        await eventually(lambda: server_side_connections(workers, port) == 0, timeout=DEADLINE_S, what="closed")
        fresh = await asyncio.gather(*(held_connection(port) for _ in range(limit)), return_exceptions=True)
        try:
            refused = [f for f in fresh if not isinstance(f, asyncio.StreamWriter)]
            assert not refused, refused
        finally:
            for writer in fresh:
                if isinstance(writer, asyncio.StreamWriter):
                    writer.close()


async def test_a_killed_workers_connections_stop_counting_before_the_supervisor_reaps_it():
    limit = 8
    async with serve_process("--workers", "2", "--max-client-connections", str(limit)) as served:
        parent, port = served.proc.pid, served.port
        first = await every_worker_listens(served.proc, port, 2, DEADLINE_S)
        held = [await held_connection(port) for _ in range(limit)]
        victim = max(first, key=lambda pid: established(pid, port))
        (survivor,) = first - {victim}
        # A supervisor that cannot run (a starved host; here a stopped one) has not reaped the victim.
        os.kill(parent, signal.SIGSTOP)
        try:
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie")
            for writer in held:
                writer.close()
            await eventually(lambda: server_side_connections({survivor}, port) == 0, timeout=DEADLINE_S, what="closed")
            fresh = await asyncio.gather(*(held_connection(port) for _ in range(limit)), return_exceptions=True)
            refused = [f for f in fresh if not isinstance(f, asyncio.StreamWriter)]
            for writer in fresh:
                if isinstance(writer, asyncio.StreamWriter):
                    writer.close()
            assert not refused, refused
        finally:
            os.kill(parent, signal.SIGCONT)


async def test_a_second_proxy_with_workers_on_a_taken_port_refuses_instead_of_sharing_it():
    # Workers listen with SO_REUSEPORT, so the kernel would let a second multi-worker proxy (the
    # same user, any configuration) join the port and take a share of its clients.
    async with serve_process("--workers", "2") as served:
        for workers in ("2", "1"):
            second = await asyncio.to_thread(
                subprocess.run,
                serve_command(served.process.port, "--workers", workers, *NOWHERE),
                capture_output=True,
                text=True,
                timeout=DEADLINE_S,
            )
            assert second.returncode == 1, (workers, second.stderr)
            assert f"cannot serve on 127.0.0.1:{served.process.port}" in second.stderr, second.stderr
