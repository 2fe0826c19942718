"""CPU and memory of processes (and their children) from /proc, and per-core busy time."""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            except OSError:
                continue
            kids.extend(int(k) for k in text.split())
    except OSError:
        pass
    return kids


def tree(pid: int, limit: int = 256) -> list[int]:
    """`pid` and its descendants (a `--workers N` proxy forks its workers)."""
    out, todo = [], [pid]
    while todo and len(out) < limit:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) seconds."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    # The command name may contain spaces: fields are counted after its closing parenthesis.
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[11]) * TICK_S, int(fields[12]) * TICK_S


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


def tree_cpu_split(pid: int) -> tuple[float, float]:
    user = system = 0.0
    for p in tree(pid):
        u, s = cpu_split(p)
        user += u
        system += s
    return user, system


def peak_rss_mb(pid: int) -> float:
    """VmHWM summed over the tree: workers are separate address spaces."""
    return _status_mb(pid, "VmHWM:")


def rss_mb(pid: int) -> float:
    """VmRSS now, summed over the tree."""
    return _status_mb(pid, "VmRSS:")


def _status_mb(pid: int, field: str) -> float:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def core_busy() -> dict[int, tuple[float, float]]:
    """Per core: (busy seconds, total seconds) since boot."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            name, *vals = line.split()
            ticks = [int(v) for v in vals]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            total = sum(ticks[:8])
            out[int(name[3:])] = ((total - idle) * TICK_S, total * TICK_S)
    return out


def pin_tree(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and its descendants onto `cpus` (affinity is per thread on Linux)."""
    for p in tree(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                os.sched_setaffinity(int(task), cpus)
            except OSError:
                continue  # the thread ended meanwhile
