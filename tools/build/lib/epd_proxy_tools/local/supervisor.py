"""Process-group supervision and health waiting for the local stack.

Standard library only, so ``epd-proxy up --dry-run`` and the proxy itself never
pull in torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class StackError(RuntimeError):
    pass


@dataclass
class Managed:
    """One server process, started as the leader of its own process group."""

    name: str
    cmd: list[str]
    env_overrides: dict[str, str]
    log_path: Path
    health_url: str
    cwd: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started_at: float = 0.0
    healthy_at: float | None = None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, base_env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(base_env)
        env.update(self.env_overrides)
        log = open(self.log_path, "wb")
        try:
            # A new session makes the server the leader of a fresh process
            # group: vLLM forks an engine-core process, and stopping the
            # group is the only way to be sure it goes away with the API
            # server.  It also keeps the terminal's Ctrl-C away from the
            # servers so that we control the shutdown order.
            self.proc = subprocess.Popen(
                self.cmd,
                env=env,
                cwd=str(self.cwd) if self.cwd else None,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.started_at = time.monotonic()
        self.healthy_at = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            data = self.log_path.read_bytes()[-20000:].decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-lines:])


def _exists(send_signal, ident: int) -> bool:
    """Signal 0 probes existence; a permission error still means someone is there."""
    try:
        send_signal(ident, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    return _exists(os.killpg, pgid)


def pid_alive(pid: int) -> bool:
    return _exists(os.kill, pid)


def stop_groups(items: Sequence[Managed], grace: float = 15.0) -> None:
    """SIGTERM every group, wait up to ``grace`` seconds, then SIGKILL."""
    pgids = [m.pgid for m in items if m.pgid is not None]
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for m in items:
            if m.proc is not None:
                m.proc.poll()  # reap the leader so the group can empty
        if not any(group_alive(p) for p in pgids):
            break
        time.sleep(0.2)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for m in items:
        if m.proc is not None:
            try:
                m.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port_block(count: int, host: str = "127.0.0.1", start: int = 18200, stop: int = 30000) -> int:
    """First base port such that base .. base+count-1 are all free."""
    base = start
    while base + count < stop:
        if all(port_free(host, base + i) for i in range(count)):
            return base
        base += count
    raise StackError(f"no block of {count} free ports in {start}..{stop}")


class Progress:
    """One status line per instance; redrawn in place on a terminal."""

    def __init__(self, items: Sequence[Managed], stream=None, tty: bool | None = None):
        self.items = list(items)
        self.stream = stream or sys.stdout
        if tty is None:
            tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.tty = tty
        self._drawn = 0
        self._last_plain = 0.0
        self._reported: set[str] = set()
        self._t0 = time.monotonic()

    def _line(self, m: Managed, now: float) -> str:
        if m.healthy_at is not None:
            state = f"ready after {m.healthy_at - m.started_at:5.1f} s"
        elif not m.alive():
            state = "EXITED"
        else:
            state = f"starting ... {now - m.started_at:5.1f} s"
        return f"  {m.name:<12} {m.health_url:<36} {state}"

    def update(self, final: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            out = []
            if self._drawn:
                out.append(f"\x1b[{self._drawn}F")
            for m in self.items:
                out.append("\x1b[2K" + self._line(m, now) + "\n")
            self.stream.write("".join(out))
            self.stream.flush()
            self._drawn = len(self.items)
            return
        for m in self.items:
            if m.healthy_at is not None and m.name not in self._reported:
                self._reported.add(m.name)
                self.stream.write(self._line(m, now) + "\n")
        if final or now - self._last_plain >= 15.0:
            self._last_plain = now
            waiting = [m for m in self.items if m.healthy_at is None]
            if waiting and not final:
                names = ", ".join(m.name for m in waiting)
                self.stream.write(f"  waiting {now - self._t0:5.1f} s for: {names}\n")
        self.stream.flush()


def wait_healthy(
    items: Sequence[Managed],
    timeout: float,
    progress: Progress | None = None,
    poll: float = 0.5,
    should_abort: Callable[[], bool] | None = None,
) -> None:
    """Block until every item's health URL answers 2xx.

    Fails fast (with the log tail) when a server exits, rather than waiting
    out the whole timeout.
    """
    deadline = time.monotonic() + timeout
    pending = [m for m in items if m.healthy_at is None]
    while pending:
        for m in list(pending):
            if not m.alive():
                if progress:
                    progress.update(final=True)
                raise StackError(
                    f"{m.name} exited with code {m.proc.returncode if m.proc else '?'} "
                    f"before becoming healthy; log {m.log_path}:\n{m.log_tail()}"
                )
            if http_ok(m.health_url, timeout=min(2.0, poll * 4)):
                m.healthy_at = time.monotonic()
                pending.remove(m)
        if progress:
            progress.update(final=not pending)
        if not pending:
            return
        if should_abort and should_abort():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            names = ", ".join(m.name for m in pending)
            tails = "\n".join(f"--- {m.name} ({m.log_path}):\n{m.log_tail(10)}" for m in pending)
            raise StackError(f"timed out after {timeout:.0f} s waiting for {names}\n{tails}")
        time.sleep(poll)


def pss_kib(pgid: int) -> int:
    """Proportional set size of every process in a group, in KiB (Linux)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            text = (entry / "smaps_rollup").read_text()
        except (OSError, ProcessLookupError, ValueError):
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
                break
    return total
