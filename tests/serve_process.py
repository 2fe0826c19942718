"""`epd-proxy serve` as a child process, for tests that need the real command line."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import aiohttp
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, *flags: str) -> list[str]:
    """The command line of a proxy on 127.0.0.1:`port`, run from this interpreter."""
    return [sys.executable, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


async def wait_healthy(proc: subprocess.Popen, url: str, deadline_s: float = 30.0) -> None:
    """Poll `url`/health until it answers 200; fail if the process exits or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as probe:
        while True:
            try:
                async with probe.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("the proxy process did not become healthy")
            await asyncio.sleep(0.1)
