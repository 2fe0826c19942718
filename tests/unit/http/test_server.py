"""The client-side limits: flags, config checks, the connection gate and the heap trimmer."""

from __future__ import annotations

import ctypes
import multiprocessing
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from epd_proxy.config import Config, ConfigError
from epd_proxy.http.server import ClientLimits, ConnectionGate, GateCounters, HeapTrimmer, PortConnections
from tests.unit.test_config import parse


def test_flags_reach_the_config_and_defaults_are_sane():
    defaults = parse()
    assert (defaults.client_header_timeout_s, defaults.client_body_timeout_s) == (60.0, 60.0)
    assert defaults.client_keepalive_timeout_s == 75.0 and defaults.max_client_connections == 1024
    config = parse(
        "--client-header-timeout",
        "5",
        "--client-body-timeout",
        "0",
        "--client-keepalive-timeout",
        "2.5",
        "--max-client-connections",
        "10",
    )
    limits = ClientLimits.from_config(config)
    assert limits == ClientLimits(
        header_timeout_s=5.0, body_timeout_s=None, keepalive_timeout_s=2.5, max_connections=10
    )


@pytest.mark.parametrize(
    "field, flag",
    [
        ("client_header_timeout_s", "--client-header-timeout"),
        ("client_body_timeout_s", "--client-body-timeout"),
        ("client_keepalive_timeout_s", "--client-keepalive-timeout"),
        ("max_client_connections", "--max-client-connections"),
    ],
)
def test_negative_limits_fail_at_startup(field, flag):
    with pytest.raises(ConfigError, match=flag):
        Config(encode_urls=("http://e",), decode_urls=("http://d",), **{field: -1})


def refused(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("epd_client_connections_refused_total")


def test_the_gate_admits_up_to_its_limit_and_counts_refusals():
    registry = CollectorRegistry()
    gate = ConnectionGate(2, counters=GateCounters(registry))
    assert [gate.enter() for _ in range(3)] == [True, True, False]
    assert (gate.open, refused(registry)) == (2, 1)
    gate.leave()
    assert gate.enter() and gate.open == 2


def port_connections(tmp_path, workers: int) -> PortConnections:
    lock = tmp_path / "lock"
    lock.touch()
    return PortConnections.create(multiprocessing.get_context("spawn"), workers, str(lock))


def test_workers_share_the_limit_and_a_dead_workers_connections_are_released(tmp_path):
    port = port_connections(tmp_path, 2)
    registry = CollectorRegistry()
    first = ConnectionGate(3, port.worker(0), GateCounters(registry))
    second = ConnectionGate(3, port.worker(1))
    assert first.enter() and first.enter() and second.enter()
    # The port is full, whichever worker is asked.
    assert not first.enter() and not second.enter()
    assert first.open == second.open == port.total == 3 and refused(registry) == 1
    second.leave()
    assert first.enter()
    # The first worker died holding three: once the parent releases its slot they no longer count.
    port.release(0)
    assert second.open == 0
    assert [second.enter() for _ in range(4)] == [True, True, True, False]


def hold_the_lock_until_killed(port: PortConnections, holding) -> None:
    with port._locked():
        holding.set()
        time.sleep(600)


def test_a_worker_killed_during_the_check_does_not_lock_the_others_out(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = port_connections(tmp_path, 2)
    holding = ctx.Event()
    worker = ctx.Process(target=hold_the_lock_until_killed, args=(port.worker(0), holding))
    worker.start()
    try:
        assert holding.wait(30), "the worker did not take the lock"
    finally:
        worker.kill()
        worker.join(30)
    gate = ConnectionGate(1, port.worker(1))
    admitted = []
    # In a thread: a lock that stayed taken would block this test instead of failing it.
    checking = threading.Thread(target=lambda: admitted.append(gate.enter()), daemon=True)
    checking.start()
    checking.join(10)
    assert admitted == [True], "the check still waits for the dead worker's lock"


def test_an_unlimited_gate_still_counts():
    registry = CollectorRegistry()
    gate = ConnectionGate(0, counters=GateCounters(registry))
    assert all(gate.enter() for _ in range(5)) and gate.open == 5 and refused(registry) == 0


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_the_trimmer_gives_freed_heap_back():
    assert not HeapTrimmer(threshold=1 << 40).trim_if_worth_it(), "too little free memory to bother"
    trimmer = HeapTrimmer(threshold=8 << 20)
    if trimmer._trim is None:
        pytest.skip("not glibc: the trimmer is a no-op here")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 800 blocks of 100 KB (under the mmap threshold), every other one freed: 40 MB free in the
    # middle of the heap, where glibc never gives it back by itself.
    blocks = []
    for _ in range(800):
        block = libc.malloc(100_000)
        ctypes.memset(block, 1, 100_000)
        blocks.append(block)
    pins = blocks[1::2]
    for block in blocks[::2]:
        libc.free(block)
    held = rss()
    try:
        assert trimmer.trim_if_worth_it()
        assert held - rss() > 30e6
    finally:
        for pin in pins:
            libc.free(pin)
