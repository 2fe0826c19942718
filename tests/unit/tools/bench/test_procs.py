"""CPU and memory from /proc (procs.py), read of this test's own process and a child."""

from __future__ import annotations

import os
import subprocess
import sys

from epd_proxy_tools.bench.procs import cpu_seconds, cpu_split, peak_rss_mb, rss_mb, tree


def test_the_tree_holds_a_process_and_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert tree(os.getpid())[0] == os.getpid() and child.pid in tree(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_cpu_time_grows_with_work_and_a_gone_process_reads_as_zero():
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(3_000_000))
    assert cpu_seconds(os.getpid()) > before
    assert cpu_split(2**22 + 12345) == (0.0, 0.0)


def test_memory_is_in_megabytes_and_the_peak_is_no_lower():
    assert 1 < rss_mb(os.getpid()) <= peak_rss_mb(os.getpid()) < 100_000
