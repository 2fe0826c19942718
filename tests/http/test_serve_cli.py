"""`epd-proxy serve` as a real process, single and with --workers, in front of fake servers."""

from __future__ import annotations

import socket
import subprocess

import aiohttp
import pytest

from epd_proxy_tools.testing.harness import serve_process
from tests.media import chat, image


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_process_answers_and_stops_on_sigterm(workers):
    async with serve_process("--workers", str(workers), stop_within_s=15) as served:
        async with aiohttp.ClientSession() as client:
            for n in range(6):
                async with client.post(f"{served.url}/v1/chat/completions", json=chat(image(str(n)))) as resp:
                    assert resp.status == 200, await resp.text()
        assert len(served.encoder.requests) == 6 and served.pd.loaded_from_cache == 6
        if workers > 1:
            assert len(children_of(served.proc.pid)) >= workers
        # One view: a new connection per scrape lands on any worker, and each shows every request.
        for _ in range(8):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as scraper:
                async with scraper.get(f"{served.url}/metrics") as resp:
                    text = await resp.text()
            assert 'epd_requests_total{status="200"} 6.0' in text
            assert f'epd_instance_up{{instance="{served.encoder_url}",role="encode"}} 1.0' in text
    # serve_process saw the process exit on SIGTERM within 15 s; no worker outlived the parent
    # either: nobody listens on the port any more.
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", served.port), timeout=2):
        pass
