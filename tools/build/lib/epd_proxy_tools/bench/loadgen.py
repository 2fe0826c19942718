"""Closed-loop load generator processes, each pre-loaded with the request bodies.

A block is a schedule of (body index, request id) sent over `concurrency` keep-alive
connections, each sending its next request as soon as the previous answer is in. The request id's
first character (w/m/c) marks warm-up, measured and cool-down requests: cool-down keeps the pipe
full until the last measured answer, so the measured window is steady state.

Requests go through the proxy's own backend-call layer (`epd_proxy.calls.upstream`): measured against
aiohttp's client, it costs the load generator a fraction of the CPU per request, and the load
generators share the harness core with the fakes.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream

REQUEST_TIMEOUT_S = 120.0


@dataclass
class Block:
    host: str
    port: int
    path: str
    concurrency: int
    schedule: list[tuple[int, str]]
    pool: str = "main"
    # Ask for streamed answers (the cached bodies are non-streaming JSON objects).
    stream: bool = False


@dataclass
class _Target:
    url: str
    inflight: int = 0


async def _run_block(bodies: list[bytes], block: Block) -> list[tuple[str, float, float, int]]:
    results: list[tuple[str, float, float, int]] = []
    todo: Iterator[tuple[int, str]] = iter(block.schedule)
    target = _Target(f"http://{block.host}:{block.port}")
    timeouts = Timeouts(total=REQUEST_TIMEOUT_S)
    # Keep-alive outlasts the block, so every connection is reused until the block ends.
    upstream = Upstream(
        keep_alive_s=REQUEST_TIMEOUT_S, count_inflight=False, headers={"Content-Type": "application/json"}
    )
    streamed: dict[int, bytes] = {}

    async def worker() -> None:
        for index, rid in todo:
            body = bodies[index]
            if block.stream:
                body = streamed.get(index) or streamed.setdefault(index, body[:-1] + b',"stream":true}')
            started = time.perf_counter()
            try:
                answer = await upstream.call(
                    target,
                    "POST",
                    block.path,
                    body=body,
                    headers={"x-request-id": rid},
                    timeouts=timeouts,
                    stage="bench",
                    what="bench request",
                )
                status = answer.status
            except NoAnswer:
                status = 0
            results.append((rid, started, time.perf_counter(), status))

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, block.concurrency))))
    finally:
        await upstream.close()
    return results


def _client_main(conn, pool_paths: dict[str, str]) -> None:
    from epd_proxy_tools.bench.workload import load_pool

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    pools = {name: load_pool(Path(path)).bodies for name, path in pool_paths.items()}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:
            return
        if command == "stop":
            return
        if command == "run":
            conn.send(("done", runner(_run_block(pools[payload.pool], payload))))


class ClientPool:
    """`processes` load generators; a block's schedule and concurrency are split between them."""

    def __init__(self, processes: int, pool_paths: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self._procs = []
        self._conns = []
        for _ in range(max(1, processes)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child, pool_paths), daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self.pids = []
        for conn in self._conns:
            if not conn.poll(120):
                raise RuntimeError("a load generator process did not start within 120 s")
            _, pid = conn.recv()
            self.pids.append(pid)

    def run(self, block: Block) -> list[tuple[str, float, float, int]]:
        n = len(self._conns)
        per = [block.concurrency // n + (1 if i < block.concurrency % n else 0) for i in range(n)]
        for i, conn in enumerate(self._conns):
            part = Block(block.host, block.port, block.path, per[i], block.schedule[i::n], block.pool, block.stream)
            conn.send(("run", part))
        results = []
        for conn in self._conns:
            _, part = conn.recv()
            results.extend(part)
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
