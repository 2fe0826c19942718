"""A bounded fault soak (epd_proxy_tools.testing.soak) as part of the suite: no hangs, only 200s or JSON
errors, and no leaked tasks, sockets, connections or memory."""

from __future__ import annotations

import os

from epd_proxy_tools.testing.soak import run


async def test_fault_soak_leaves_nothing_behind():
    report = await run(float(os.environ.get("EPD_SOAK_SECONDS", "30")), concurrency=64, seed=1)
    print(report)
    assert report["violations"] == []
    assert report["requests"] > 200
    assert sum(report["faults_injected"].values()) > 20
    assert report["outcomes"].get("200", 0) > report["requests"] / 2
    assert report["leaked_tasks"] <= 0 and report["leaked_sockets"] <= 0
    assert report["leaked_inflight_counts"] == 0 and report["backend_connections_still_acquired"] == 0
    # Coalescing is on (the default) and shared sub-requests formed, clients leaving among them.
    assert report["coalesced_subrequests"] > 20 and report["outcomes"].get("client_disconnected", 0) > 20
    assert report["leaked_lane_work"] == 0 and report["leaked_shares"] == 0
    assert report["rss_growth_mb"] < 50
    assert report["ok"]
