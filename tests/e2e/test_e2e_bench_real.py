"""The real-engine benchmark, smoke-sized, against the E+PD stack the other e2e tests use: two proxy
arms and the single instance, a few requests each, answers checked against the baseline.

Counts are asserted, never timings: the engines count sub-requests and images themselves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_real_bench_reports_what_the_engines_did_for_each_arm(stack, tmp_path: Path) -> None:
    out = tmp_path / "real"
    cmd = [
        sys.executable,
        "-m",
        "epd_proxy_tools.bench",
        "--encode-urls",
        ",".join(stack.encoder_urls),
        "--decode-urls",
        stack.pd_url,
        "--baseline-url",
        stack.baseline_url,
        "--ec-store",
        str(stack.ec_store),
        "--quick",
        "--concurrency",
        "2",
        "--proxy",
        "batched=epd-proxy serve --encode-policy round_robin",
        "--proxy",
        "per-item=epd-proxy serve --encode-policy round_robin --encoder-max-batch-size 1",
        "--out",
        str(out),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    for name in ("table.md", "chart.png"):
        assert (out / name).stat().st_size > 0, name
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"batched", "per-item", "single-instance"}
    assert result["flagged"] == []
    assert result["caches_reset_between_blocks"], result["notes"]
    for name, row in rows.items():
        assert row["failed"] == 0, (name, row["errors"])
        assert row["exact"] is not None, name
    per_item, batched = rows["per-item"], rows["batched"]
    # One image per sub-request, counted by the encoders themselves.
    assert per_item["images_per_subrequest"]["median"] == 1.0
    assert per_item["encoder_subrequests_per_request"]["median"] > batched["encoder_subrequests_per_request"]["median"]
    # Round robin over 2 encoders: at most 2 sub-requests per request, so several images in each.
    assert batched["encoder_subrequests_per_request"]["median"] <= 2.0
    assert batched["images_per_subrequest"]["median"] > 1.0
    assert "single-instance" in run.stdout and "per-item" in run.stdout
