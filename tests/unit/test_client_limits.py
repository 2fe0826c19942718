"""The client-side limits: flags, config checks, the connection gate and the heap trimmer."""

from __future__ import annotations

import ctypes
import multiprocessing

import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.server import ClientLimits, ConnectionGate, HeapTrimmer
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


@pytest.mark.parametrize("shared", [False, True], ids=["one process", "shared by workers"])
def test_the_gate_admits_up_to_its_limit_and_counts_refusals(shared):
    counter = multiprocessing.get_context("spawn").Value("q", 0) if shared else None
    gate = ConnectionGate(2, counter)
    assert [gate.enter() for _ in range(3)] == [True, True, False]
    assert (gate.open, gate.refused) == (2, 1)
    gate.leave()
    assert gate.enter() and gate.open == 2
    if shared:
        # Another worker's gate over the same counter sees the port's connections.
        other = ConnectionGate(2, counter)
        assert not other.enter() and other.open == 2


def test_an_unlimited_gate_still_counts():
    gate = ConnectionGate(0)
    assert all(gate.enter() for _ in range(5)) and gate.open == 5 and gate.refused == 0


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
