"""A real redis-server process for tests of the shared roster (installed by `make store`)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: `make store` installs it (Debian package, as root)")
    return path


class RedisServer:
    """One throwaway server on a loopback port, without persistence: a restart starts empty, the
    harder case for the proxies (see roster.py's reseeding)."""

    def __init__(self, port: int, work_dir: Path) -> None:
        self.port = port
        self.work_dir = work_dir
        self.proc: subprocess.Popen | None = None

    def url(self, prefix: str = "epd") -> str:
        return f"redis://127.0.0.1:{self.port}/0?prefix={prefix}"

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.work_dir / "redis.log", "ab")  # noqa: SIM115 - lives as long as the process
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.work_dir), "--protected-mode", "no"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.work_dir}/redis.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer within {timeout_s}s")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Gone at once, as a crashed store: no shutdown handshake with clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def command(self, *args: str) -> str:
        """One redis-cli command against this server, for tests that look at the store itself."""
        cli = shutil.which("redis-cli") or "redis-cli"
        out = subprocess.run([cli, "-p", str(self.port), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
