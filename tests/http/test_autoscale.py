"""The autoscaling figures in /metrics under a fakes load that steps up and down: the encoders'
offered load and recommended count follow what the load needs, within a stated tolerance; and
however often they are scraped, their samples take a fixed amount of memory."""

from __future__ import annotations

import asyncio
import itertools
import math
import re

import pytest

from epd_proxy.proxy import STATE
from epd_proxy_tools.testing.fake_vllm import Costs
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

IMAGE_S = 0.05  # each fake encoder serves one image in 50 ms, one sub-request at a time
UTILISATION = 0.5
WINDOW_S = 2.0
# The recommendation may be off by one encoder (the window straddles a step, answers jitter on a
# shared machine), and the load it comes from by 35% of the load offered plus 0.1 encoder.
TOLERANCE_REPLICAS = 1
TOLERANCE_LOAD = 0.35


def figure(text: str, name: str, role: str = "encode") -> float:
    match = re.search(rf'^{name}{{role="{role}"}} ([0-9.e+-]+)$', text, re.M)
    assert match, f"{name} missing"
    return float(match.group(1))


async def offer(stack, per_second: float, names) -> None:
    """One-image requests at `per_second`, open loop, until cancelled (pacing, not synchronising)."""
    tasks: set[asyncio.Task] = set()

    async def one(name: str) -> None:
        async with await stack.chat(chat(image(name))) as resp:
            assert resp.status == 200
            await resp.read()

    try:
        while True:
            task = asyncio.create_task(one(next(names)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(1 / per_second)
    finally:
        for task in tasks:
            task.cancel()


@pytest.mark.timeout(120)
async def test_recommended_encoders_follow_a_load_stepping_up_and_down(make_stack):
    stack = await make_stack(
        encoders=4,
        encoder_options={"costs": Costs(image_s=IMAGE_S)},
        autoscale_window_s=WINDOW_S,
        autoscale_utilisation=UTILISATION,
        coalesce=False,
    )
    names = (f"img{i}" for i in itertools.count())
    seen: list[tuple[int, float, float]] = []
    for per_second in (4, 24, 4):
        load = asyncio.create_task(offer(stack, per_second, names))
        try:
            await follows_within_tolerance(stack, per_second, seen)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    assert [s for s in seen if s[0] == 24][-1][1] >= 2, "the step up asked for more encoders"


async def follows_within_tolerance(stack, per_second: int, seen: list) -> None:
    needed = per_second * IMAGE_S  # encoders' worth of work arriving
    want = max(1, math.ceil(needed / UTILISATION))
    streak = 0

    async def follows():
        nonlocal streak
        async with stack.client.get(stack.url + "/metrics") as resp:
            text = await resp.text()
        got = figure(text, "epd_role_recommended_replicas")
        offered = figure(text, "epd_role_offered_load")
        seen.append((per_second, got, round(offered, 3)))
        close = abs(got - want) <= TOLERANCE_REPLICAS and abs(offered - needed) <= TOLERANCE_LOAD * needed + 0.1
        streak = streak + 1 if close and figure(text, "epd_role_arrival_rate") > 0 else 0
        # Held over a second of polls, so it is not a passing sample.
        return streak >= 5

    await eventually(follows, timeout=8 * WINDOW_S, interval=0.25, what=lambda: f"{want} encoders: {seen[-6:]}")


async def test_3000_scrapes_leave_the_sample_store_at_its_fixed_bound(make_stack):
    stack = await make_stack(encoders=1)
    autoscale = stack.runner.app[STATE].metrics.autoscale
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200

    async def scrape(path: str) -> None:
        async with stack.client.get(stack.url + path) as resp:
            assert resp.status == 200
            await resp.read()

    # 3,000 unauthenticated scrapes, 20 at a time; /metrics costs five times /status.json to render.
    for _ in range(150):
        await asyncio.gather(*(scrape(path) for path in ("/metrics",) * 2 + ("/status.json",) * 18))
    assert autoscale.kept() <= autoscale.max_kept
    assert autoscale.figures()["decode"].arrival_rate > 0
