"""The media-fetch microbenchmark runs end to end against its own origin and reports every way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_it_reports_each_way_with_the_fetched_body_carrying_the_bytes():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-m", "epd_proxy_tools.bench.media_fetch", "--sizes", "8", "--rounds", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    rows = {line.split()[1]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"fetched", "cached", "unnamed", "inline"}, out
    size = {way: int(row[3]) for way, row in rows.items()}
    # 8 KB as base64 in the body against a bare URL.
    assert size["fetched"] == size["cached"] > 8 * 1024 > size["unnamed"], out
