"""A real DNS server for the discovery tests: Debian's unbound (installed by `make system-packages`) on a
loopback port, authoritative for one zone that the test rewrites while the proxy resolves it."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

from epd_proxy_tools.testing.daemon import find_binary, kill_daemon, start_daemon

ZONE = "epd.test."


def unbound_binary() -> str:
    return find_binary("unbound", "unbound", fallback="/usr/sbin/unbound")


def _config(port: int, work_dir: Path) -> str:
    # No recursion, no cache, no DNSSEC: it answers from the zone file alone, and a rewrite shows
    # on the very next query. `test.` is one of unbound's default blocked zones, hence nodefault.
    return f"""server:
  interface: 127.0.0.1
  port: {port}
  do-daemonize: no
  username: ""
  chroot: ""
  directory: "{work_dir}"
  pidfile: ""
  use-syslog: no
  logfile: ""
  verbosity: 1
  do-ip6: no
  access-control: 127.0.0.0/8 allow
  module-config: "iterator"
  cache-max-ttl: 0
  cache-max-negative-ttl: 0
  local-zone: "test." nodefault
auth-zone:
  name: "{ZONE}"
  zonefile: "{work_dir}/zone"
  for-downstream: yes
  for-upstream: no
  fallback-enabled: no
remote-control:
  control-enable: yes
  control-interface: "{work_dir}/control.sock"
  control-use-cert: no
"""


class UnboundServer:
    """One throwaway server. `records` lines are zone file records relative to ZONE, such as
    `enc A 127.0.0.2` or `_http._tcp.pd SRV 0 0 8001 pd1`; `publish` swaps them all at once."""

    def __init__(self, port: int, work_dir: Path) -> None:
        self.port = port
        self.work_dir = work_dir
        self.proc: subprocess.Popen | None = None
        self._serial = 0
        self.records: list[str] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def name(self, relative: str) -> str:
        return f"{relative}.{ZONE}"

    def _write_zone(self, records: Iterable[str]) -> None:
        self._serial += 1
        lines = [f"$ORIGIN {ZONE}", "$TTL 0", f"@ SOA ns.{ZONE} admin.{ZONE} {self._serial} 60 60 60 0"]
        lines += [f"@ NS ns.{ZONE}", "ns A 127.0.0.1", *records]
        tmp = self.work_dir / "zone.new"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.work_dir / "zone")

    def start(self, timeout_s: float = 20.0) -> UnboundServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._write_zone(self.records)
        (self.work_dir / "unbound.conf").write_text(_config(self.port, self.work_dir))
        cmd = [unbound_binary(), "-d", "-c", str(self.work_dir / "unbound.conf")]
        self.proc = start_daemon(cmd, self.work_dir / "unbound.log", self.answers, timeout_s)
        return self

    def publish(self, records: Iterable[str]) -> None:
        """Rewrite the zone and have unbound load it; the next query sees it."""
        self.records = list(records)
        self._write_zone(self.records)
        if self.proc is None:
            return  # stopped: the server starts with it
        control = shutil.which("unbound-control") or "/usr/sbin/unbound-control"
        conf = str(self.work_dir / "unbound.conf")
        out = subprocess.run(
            [control, "-c", conf, "auth_zone_reload", ZONE], capture_output=True, text=True, timeout=10
        )
        if out.returncode != 0 or "ok" not in out.stdout:
            raise RuntimeError(f"unbound-control auth_zone_reload failed: {out.stdout} {out.stderr}")

    def answers(self) -> bool:
        """Whether the server answers a query for the zone's SOA (a hand-made UDP query)."""
        qname = b"".join(bytes([len(label)]) + label.encode() for label in ZONE.rstrip(".").split(".")) + b"\0"
        query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + qname + b"\x00\x06\x00\x01"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.5)
            try:
                sock.sendto(query, ("127.0.0.1", self.port))
                answer = sock.recv(512)
            except OSError:
                return False
        return answer[:2] == b"\x12\x34" and answer[3] & 0x0F == 0  # our id, NOERROR

    def kill(self) -> None:
        """Gone at once: queries time out, as with a DNS server that went away."""
        kill_daemon(self.proc)
        self.proc = None
