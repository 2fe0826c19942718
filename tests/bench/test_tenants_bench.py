"""`epd-proxy bench --workload tenants --quick` end to end against the fakes: the flood tenant is
turned away at arrival (503, counted by tenant on /metrics) while the interactive one is served.

No timing assertions beyond an order: a shed answer comes before an encoded one."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from epd_proxy.tenants import parse_tenants
from epd_proxy_tools.bench import tenant_load


def test_quick_tenants_bench_reports_per_tenant_figures_and_sheds(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "epd_proxy_tools.bench", "--workload", "tenants", "--quick", "--out", str(out)]
    cmd += ["--block-seconds", "4", "--no-pin"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "tenants.json").read_text())
    assert parse_tenants((out / "tenants.toml").read_text()).by_name("flood").deadline_s == 1.0
    (arm,) = result["arms"]
    assert arm["name"] == "epd-proxy" and arm["tenants_file"]
    alone, flood = arm["blocks"]["alone"], arm["blocks"]["flood"]
    assert alone["tenants"]["flood"]["sent"] == 0
    chat_alone = alone["tenants"]["interactive"]
    assert chat_alone["answered"] == chat_alone["sent"] > 0 and chat_alone["encoder_share"] == 1.0
    flooded, chat = flood["tenants"]["flood"], flood["tenants"]["interactive"]
    # Ten times its share: most of the flood is turned away at once (over its share, or past its
    # deadline), none of the interactive tenant.
    sheds = [flooded["shed"][status] for status in ("429", "503") if flooded["shed"][status]["count"]]
    assert sheds and all(shed["retry_after"] for shed in sheds)
    assert all(shed["answer_ms_p50"] < 1000 * flooded["ttft_s_p50"] for shed in sheds)
    assert chat["answered"] > 0 and chat["shed"]["503"]["count"] == chat["shed"]["429"]["count"] == 0
    assert abs(flooded["encoder_share"] + chat["encoder_share"] - 1.0) < 1e-9
    # The proxy counts each tenant's encoder seconds itself (its fair queueing's ledger).
    assert flood["encoder_share_from"] == "proxy counters"
    counted = sum(n for key, n in flood["proxy_shed"].items() if key.startswith("flood/"))
    assert counted >= sum(shed["count"] for shed in sheds)
    # The proxy's own clock on each of those answers, by its histogram.
    assert flood["proxy_shed_answers"]["count"] == counted
    assert "sheds answered within 50 ms" in run.stdout
    assert arm["interactive_ttft_p99_ratio"] > 0
    assert "| epd-proxy | flood | flood |" in run.stdout


def test_a_capacity_nothing_answered_ends_the_run_with_why() -> None:
    # A proxy that fails every request measured a capacity of 0, and every figure after it was
    # against that: the run ends instead.
    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        flood, chat = tenant_load.new_tenants(None)
        requests = tenant_load.requests_for(tenant_load.FLOOD, 3, model="m", seed=1, tiny=True)
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
        with pytest.raises(SystemExit, match=r"answered none of the 3 capacity requests \(HTTP 500\)"):
            tenant_load.capacity(url, chat, requests, 2)
    finally:
        server.shutdown()
