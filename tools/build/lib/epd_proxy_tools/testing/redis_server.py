"""A real redis-server process for tests of the shared roster (installed by `make system-packages`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from epd_proxy_tools.testing.daemon import find_binary, kill_daemon, start_daemon


def redis_server_binary() -> str:
    return find_binary("redis-server", "redis-server")


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
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.work_dir), "--protected-mode", "no"]
        self.proc = start_daemon(cmd, self.work_dir / "redis.log", self.ping, timeout_s)
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
        kill_daemon(self.proc)
        self.proc = None

    def command(self, *args: str) -> str:
        """One redis-cli command against this server, for tests that look at the store itself."""
        cli = shutil.which("redis-cli") or "redis-cli"
        out = subprocess.run([cli, "-p", str(self.port), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
