"""`epd-proxy bench --workload tenants --quick` end to end against the fakes: the flood tenant is
turned away at arrival (503, counted by tenant on /metrics) while the interactive one is served.

No timing assertions beyond an order: a shed answer comes before an encoded one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from epd_proxy.tenants import parse_tenants


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
    assert arm["interactive_ttft_p99_ratio"] > 0
    assert "| epd-proxy | flood | flood |" in run.stdout
