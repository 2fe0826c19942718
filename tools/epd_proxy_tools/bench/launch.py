"""Starting what a benchmark measures: an arm's command run with this checkout and interpreter, and
waiting until the process answers. Both benches (fakes in runner.py, real engines in real.py) use it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

# The tree this benchmark (and so, by default, every proxy it starts) runs from.
CHECKOUT = str(Path(__file__).resolve().parents[3])


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def command_words(words: list[str]) -> list[str]:
    """An arm's command as typed, run with this interpreter: `epd-proxy serve` is this checkout's
    proxy, and a bare `python` is this environment's, which has the reference script's packages
    (the one first on PATH may not)."""
    if words[:2] == ["epd-proxy", "serve"]:
        return [sys.executable, "-m", "epd_proxy", *words[1:]]
    if words and words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    return words


def proxy_environment(ours: bool, pairs: Iterable[str] = (), own: Mapping[str, str] | None = None) -> dict[str, str]:
    """A proxy arm's environment: this process's; for ours, this checkout first on PYTHONPATH
    (`python -m` puts the working directory first on sys.path, so ours also run from the results
    folder, away from any other tree), unless the arm names another tree; then the
    `--proxy-env KEY=VALUE` pairs, then the arm's own."""
    env = dict(os.environ)
    if ours:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CHECKOUT, env.get("PYTHONPATH")) if p)
    for pair in pairs:
        key, _, value = pair.partition("=")
        env[key] = value
    env.update(own or {})
    return env


def stop_process(proc: subprocess.Popen) -> None:
    """Ask a started server to stop, and kill it if it has not within 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_ready(url: str, proc: subprocess.Popen, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was ready")
        try:
            http_get(url, timeout=2.0)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {deadline_s:.0f} s")
