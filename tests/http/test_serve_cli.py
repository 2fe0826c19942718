"""`epd-proxy serve` as a real process, single and with --workers, in front of fake servers."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from epd_proxy.testing.fake_vllm import ECStore, FakeVLLM
from tests.media import chat, image
from tests.serve_process import free_port, serve_command, wait_healthy


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_process_answers_and_stops_on_sigterm(workers):
    store = ECStore()
    fakes = [FakeVLLM("encode", store), FakeVLLM("pd", store)]
    servers = [TestServer(f.app()) for f in fakes]
    for server in servers:
        await server.start_server()
    e_url, pd_url = (str(s.make_url("")).rstrip("/") for s in servers)
    port = free_port()
    proc = subprocess.Popen(
        serve_command(
            port,
            "--encode-servers-urls",
            e_url,
            "--decode-servers-urls",
            pd_url,
            "--workers",
            str(workers),
            "--log-level",
            "WARNING",
        )
    )
    try:
        await wait_healthy(proc, f"http://127.0.0.1:{port}")
        async with aiohttp.ClientSession() as client:
            for n in range(6):
                async with client.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=chat(image(str(n)))
                ) as resp:
                    assert resp.status == 200, await resp.text()
        assert len(fakes[0].requests) == 6 and fakes[1].loaded_from_cache == 6
        if workers > 1:
            assert len(children_of(proc.pid)) >= workers
        # One view: a new connection per scrape lands on any worker, and each shows every request.
        for _ in range(8):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as scraper:
                async with scraper.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    text = await resp.text()
            assert 'epd_requests_total{status="200"} 6.0' in text
            assert f'epd_instance_up{{instance="{e_url}",role="encode"}} 1.0' in text
    finally:
        proc.terminate()
        assert await asyncio.to_thread(proc.wait, 15) is not None
        for server in servers:
            await server.close()
    # No worker outlived the parent: nobody listens on the port any more.
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
