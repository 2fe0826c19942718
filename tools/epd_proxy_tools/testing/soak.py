"""Fault soak: a bounded run of concurrent clients against fake backends that misbehave at random.

    python -m epd_proxy_tools.testing.soak --duration 120 --concurrency 64

Backends randomly drop connections, answer 500/503, stall past the proxy's timeouts, and break
streams halfway; one configured encoder refuses every connection; clients randomly disconnect.
The run checks that no request outlives its timeout, every answer is a 200 or a JSON error, and
that afterwards the proxy's asyncio tasks and sockets are back at their baseline and its memory
did not grow. It prints the figures as JSON and exits non-zero on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import gc
import logging
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd_proxy.config import Config
from epd_proxy.http.app import STATE, create_app
from epd_proxy_tools.testing.fake_vllm import ECStore, FakeVLLM, Faults

ENCODE_TIMEOUT_S = 1.0
DECODE_TIMEOUT_S = 2.0
STALL_S = DECODE_TIMEOUT_S * 3
# Upper bound on any request's life: the encode, failover, retry and decode budgets, plus slack.
HANG_LIMIT_S = 4 * ENCODE_TIMEOUT_S + 2 * DECODE_TIMEOUT_S + 5


@dataclass
class ChaosFaults(Faults):
    """Per request, one fault drawn at random."""

    rng: random.Random = field(default_factory=random.Random)
    injected: collections.Counter = field(default_factory=collections.Counter)

    async def apply(self, request: web.Request) -> web.Response | None:
        roll = self.rng.random()
        if roll < 0.04:
            self.injected["drop"] += 1
            self.fail_next(1, 0)
        elif roll < 0.08:
            self.injected["http_500"] += 1
            self.fail_next(1, 500)
        elif roll < 0.11:
            self.injected["http_503"] += 1
            self.fail_next(1, 503)
        elif roll < 0.13:
            self.injected["stall"] += 1
            await asyncio.sleep(STALL_S)
        elif roll < 0.25:
            await asyncio.sleep(self.rng.uniform(0, 0.05))
        return await super().apply(request)

    def break_stream(self) -> bool:
        if self.rng.random() < 0.05:
            self.injected["stream_reset"] += 1
            return True
        return False


def _image(i: int) -> dict[str, Any]:
    # Drawn from a bounded set: the fake EC store (like vLLM's example connector) never evicts,
    # so unique images would grow the harness's memory and blur the proxy's.
    data = base64.b64encode(random.Random(i).randbytes(64)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def _socket_count() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _cpu_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (schedstat's second field):
    what the host's other load took from the proxy, the fakes and the clients alike."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@contextlib.asynccontextmanager
async def _bound(limit_s: float):
    """asyncio.timeout(limit_s) that gives back the time this process waited for a CPU meanwhile:
    the bound is on the proxy, and seconds the host kept it off every core say nothing of it. A
    proxy that truly hangs waits idle, which costs no CPU wait, so it still runs out."""
    loop = asyncio.get_running_loop()
    started, waited_before = loop.time(), _cpu_wait_s()
    timer: asyncio.TimerHandle | None = None
    async with asyncio.timeout(None) as timeout:

        def expire_or_extend() -> None:
            nonlocal timer
            due = started + limit_s + (_cpu_wait_s() - waited_before)
            if due > loop.time() + 0.01:
                timer = loop.call_at(due, expire_or_extend)
            else:
                timeout.reschedule(loop.time())

        timer = loop.call_at(started + limit_s, expire_or_extend)
        try:
            yield
        finally:
            timer.cancel()


class LoopLag:
    """How late this process's event loop runs its timers: the proxy, its fakes and the clients all
    share it, so a starved host shows here before it shows as a request that "hung"."""

    TICK_S = 0.05

    def __init__(self) -> None:
        self.total_s = 0.0
        self.worst_s = 0.0

    async def watch(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            asked = loop.time()
            await asyncio.sleep(self.TICK_S)
            late = loop.time() - asked - self.TICK_S
            self.total_s += late
            self.worst_s = max(self.worst_s, late)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(duration_s: float, concurrency: int, seed: int, coalesce: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    store = ECStore()
    fakes = [FakeVLLM(role, store, stream_pause_s=0.001, record=False) for role in ("encode", "encode", "pd")]
    injected: collections.Counter = collections.Counter()
    for i, fake in enumerate(fakes):
        fake.faults = ChaosFaults(rng=random.Random(seed + i), injected=injected)
    servers = [TestServer(fake.app()) for fake in fakes]
    for server in servers:
        await server.start_server()
    urls = [str(server.make_url("")).rstrip("/") for server in servers]
    refusing = f"http://127.0.0.1:{_closed_port()}"
    config = Config(
        encode_urls=(urls[0], urls[1], refusing),
        decode_urls=(urls[2],),
        encode_timeout_s=ENCODE_TIMEOUT_S,
        decode_timeout_s=DECODE_TIMEOUT_S,
        backend_keep_alive_s=1.0,
        probe_interval_s=0.5,
        fail_threshold=2,
        coalesce=coalesce,
    )
    proxy = TestServer(create_app(config))
    await proxy.start_server()
    state = proxy.app[STATE]
    target = str(proxy.make_url("/v1/chat/completions"))

    # Let the first health check rounds run before taking the baseline.
    await asyncio.sleep(config.probe_interval_s * 2 + 0.2)
    gc.collect()
    baseline_tasks = len(asyncio.all_tasks())
    baseline_sockets = _socket_count()

    outcomes: collections.Counter = collections.Counter()
    violations: list[str] = []
    rss_samples: list[float] = []
    deadline = time.monotonic() + duration_s
    lag = LoopLag()

    async def one(client: aiohttp.ClientSession, n: int) -> None:
        # Half from 40 popular images (taken from another request's encode, or raw once the proxy
        # saw them encoded), half from thousands the encoders have not seen yet.
        images = [
            _image(rng.randrange(40) if rng.random() < 0.5 else 40 + rng.randrange(4000))
            for _ in range(rng.randrange(0, 5))
        ]
        stream = rng.random() < 0.4
        body = orjson.dumps(
            {
                "model": "tiny-vlm",
                "messages": [{"role": "user", "content": [{"type": "text", "text": f"q{n}"}, *images]}],
                "stream": stream,
            }
        )
        disconnect_after = rng.uniform(0.001, 0.3) if rng.random() < 0.1 else None
        started, lag_before, waited_before = time.monotonic(), lag.total_s, _cpu_wait_s()
        try:
            async with asyncio.timeout(disconnect_after) if disconnect_after else _bound(HANG_LIMIT_S):
                async with client.post(target, data=body, headers={"Content-Type": "application/json"}) as resp:
                    payload = await resp.read()
                    if resp.status == 200:
                        outcomes["200"] += 1
                    else:
                        error = orjson.loads(payload).get("error")
                        if not resp.content_type.startswith("application/json") or not error:
                            violations.append(f"status {resp.status} without a JSON error: {payload[:200]!r}")
                        outcomes[f"{resp.status} {error.get('stage', '?') if isinstance(error, dict) else '?'}"] += 1
        except TimeoutError:
            if disconnect_after is None:
                late, waited = lag.total_s - lag_before, _cpu_wait_s() - waited_before
                violations.append(
                    f"request hung for {time.monotonic() - started:.1f}s"
                    f" (event loop late {late:.1f}s of it, waiting for a CPU {waited:.1f}s)"
                )
            else:
                outcomes["client_disconnected"] += 1
        except aiohttp.ClientPayloadError:
            outcomes["stream_cut (decode broke mid-stream)"] += 1
        except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            violations.append(f"client error {type(exc).__name__}: {exc}")

    async def worker(w: int) -> None:
        async with aiohttp.ClientSession() as client:
            n = 0
            while time.monotonic() < deadline:
                await one(client, w * 1_000_000 + n)
                n += 1

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            rss_samples.append(_rss_mb())
            await asyncio.sleep(1)

    started, waited_before = time.monotonic(), _cpu_wait_s()
    watch = lag.watch(asyncio.get_running_loop().time() + duration_s)
    await asyncio.gather(sample_memory(), watch, *(worker(w) for w in range(concurrency)))
    elapsed, waited = time.monotonic() - started, _cpu_wait_s() - waited_before

    # Let pooled keep-alive connections retire, stalled fake handlers finish their sleep, and
    # cancelled handlers unwind; whatever is left after that is a leak.
    await asyncio.sleep(max(config.pool_keep_alive_s, STALL_S) + 1.5)
    gc.collect()
    leaked_tasks = len(asyncio.all_tasks()) - baseline_tasks
    remaining_tasks = sorted(repr(t.get_coro())[:100] for t in asyncio.all_tasks() if t is not asyncio.current_task())
    leaked_sockets = _socket_count() - baseline_sockets
    acquired = state.upstream.connections_in_use()
    leaked_inflight = sum(inst.inflight for inst in state.fleet.all()) + state.admission.inflight
    # The scheduler's books: nothing still waiting to share, in flight or counted outstanding.
    leaked_lane_work = sum(lane.leftover() for lane in state.lanes.all())
    # Images still marked as being encoded, which a later request would wait for.
    assert state.pipeline is not None
    leaked_shares = len(state.pipeline.in_flight)
    coalesced = sum(
        sample.value for sample in state.metrics.coalesced.collect()[0].samples if sample.name.endswith("_total")
    )
    quarter = max(1, len(rss_samples) // 4)
    rss_growth = (
        (max(rss_samples[-quarter:]) - max(rss_samples[quarter : 2 * quarter] or rss_samples)) if rss_samples else 0.0
    )

    await proxy.close()
    for server in servers:
        await server.close()

    total = sum(outcomes.values())
    report = {
        "duration_s": round(elapsed, 1),
        "concurrency": concurrency,
        "requests": total,
        "requests_per_s": round(total / elapsed, 1),
        "faults_injected": dict(injected) | {"refusing_encoder": 1},
        "outcomes": dict(sorted(outcomes.items())),
        "violations": violations[:20],
        "violation_count": len(violations),
        "leaked_tasks": leaked_tasks,
        "tasks_after": remaining_tasks,
        "leaked_sockets": leaked_sockets,
        "leaked_inflight_counts": leaked_inflight,
        "backend_connections_still_acquired": acquired,
        "leaked_lane_work": leaked_lane_work,
        "leaked_shares": leaked_shares,
        "coalesced_subrequests": int(coalesced),
        "rss_mb_start": round(rss_samples[quarter], 1) if len(rss_samples) > quarter else None,
        "rss_mb_end": round(rss_samples[-1], 1) if rss_samples else None,
        "rss_growth_mb": round(rss_growth, 1),
        "loop_lag_worst_s": round(lag.worst_s, 2),
        "loop_lag_total_s": round(lag.total_s, 1),
        "cpu_wait_s": round(waited, 1),
    }
    report["ok"] = (
        not violations
        and leaked_tasks <= 0
        and leaked_sockets <= 0
        and leaked_inflight == 0
        and acquired == 0
        and leaked_lane_work == 0
        and leaked_shares == 0
        and rss_growth < 50
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-coalescing", dest="coalesce", action="store_false", help="the proxy's --no-coalescing")
    args = parser.parse_args(argv)
    # Thousands of injected faults would each log a warning; the report is what matters here.
    logging.basicConfig(level=logging.CRITICAL)
    report = asyncio.run(run(args.duration, args.concurrency, args.seed, args.coalesce))
    sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
