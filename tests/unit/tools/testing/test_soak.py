"""The soak's bound on a request: wall time the host let the process run, not time it kept it waiting."""

from __future__ import annotations

import asyncio
import time

import pytest

from epd_proxy_tools.testing import soak


async def test_a_request_that_waits_idle_runs_out_at_its_bound():
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with soak._bound(0.2):
            await asyncio.Event().wait()
    assert 0.2 <= time.monotonic() - started < 2.0


async def test_time_spent_waiting_for_a_cpu_is_given_back(monkeypatch):
    loop = asyncio.get_running_loop()
    started = loop.time()
    # As if the host kept the process off the CPU for as long as it ran: every second counts half.
    monkeypatch.setattr(soak, "_cpu_wait_s", lambda: (loop.time() - started) / 2)
    with pytest.raises(TimeoutError):
        async with soak._bound(0.2):
            await asyncio.Event().wait()
    # limit + waited: t = 0.2 + t/2, so t = 0.4.
    assert loop.time() - started >= 0.38


async def test_a_request_that_finishes_in_time_is_not_cut():
    async with soak._bound(5.0):
        await asyncio.sleep(0.01)
