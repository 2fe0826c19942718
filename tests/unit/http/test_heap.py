"""The heap trimmer gives memory glibc holds free back to the system."""

from __future__ import annotations

import ctypes

import pytest

from epd_proxy.http.heap import HeapTrimmer


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
