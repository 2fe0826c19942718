"""The real daemons the tests run beside the proxy (redis-server, unbound): found where Debian
installs them, started with their output in a log, awaited until they answer, killed outright."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def find_binary(name: str, package: str, fallback: str | None = None) -> str:
    path = shutil.which(name) or (fallback if fallback and Path(fallback).exists() else None)
    if path is None:
        raise RuntimeError(
            f"{name} is not installed: `sudo apt-get install {package}` (or `make system-packages` as root)"
        )
    return path


def start_daemon(cmd: Sequence[str], log_path: Path, answers: Callable[[], bool], timeout_s: float) -> subprocess.Popen:
    """`cmd` running in the foreground with its output appended to `log_path`, once `answers()`."""
    name = Path(cmd[0]).name
    log = open(log_path, "ab")  # noqa: SIM115 - the child holds it as long as it runs
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + timeout_s
    while not answers():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            kill_daemon(proc)  # the caller gets no handle to stop it with
            raise RuntimeError(f"{name} did not answer within {timeout_s:g}s; see {log_path}")
        time.sleep(0.05)
    return proc


def kill_daemon(proc: subprocess.Popen | None) -> None:
    """SIGKILL: no shutdown handshake, as a crashed server."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
