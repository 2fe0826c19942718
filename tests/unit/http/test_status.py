"""The operator's view (status.py): the roster in the page's words, the snapshot and the page's CSP."""

from __future__ import annotations

import base64
import hashlib
import re

from epd_proxy.config import Config
from epd_proxy.fleet.backends import ENCODE
from epd_proxy.http.status import _load_page, roster, scheduler, snapshot
from epd_proxy.proxy import ProxyState


def state_of(**overrides) -> ProxyState:
    config = Config(
        encode_urls=("http://e1", "http://e0"), decode_urls=("http://pd",), prefill_urls=("http://p",), **overrides
    )
    return ProxyState(config)


def test_the_roster_is_ordered_by_stage_then_url_in_the_pages_words():
    state = state_of(fail_threshold=2)
    rows = roster(state)
    assert [(row["role"], row["url"]) for row in rows] == [
        ("encode", "http://e0"),
        ("encode", "http://e1"),
        ("prefill", "http://p"),
        ("decode", "http://pd"),
    ]
    assert {row["state"] for row in rows} == {"in rotation"}
    e0 = next(inst for inst in state.fleet.all() if inst.url == "http://e0")
    state.health.checked(e0, "refused")
    assert roster(state)[0]["state"] == "failing", "healthy, but failures are piling up"
    state.health.checked(e0, "refused")
    row = roster(state)[0]
    assert row["state"] == "down" and row["last_problem"] == "refused"


async def test_the_scheduler_section_says_what_is_on():
    for overrides, expected in (
        ({}, (True, True, True)),
        ({"encoder_affinity": False, "coalesce": False}, (False, True, False)),
        ({"encode_policy": "round_robin"}, (False, False, True)),
    ):
        state = state_of(probe_interval_s=0, **overrides)
        await state.start()
        try:
            section = scheduler(state)
        finally:
            await state.close()
        assert (section["affinity"], section["adaptive_fan_out"], section["coalescing"]) == expected, overrides
        assert section["policy"] == state.config.encode_policy


async def test_the_snapshot_counts_from_the_metrics_collectors():
    state = state_of(probe_interval_s=0, max_inflight=7)
    await state.start()
    try:
        state.metrics.requests.labels("200").inc(3)
        state.metrics.requests.labels("503").inc()
        data = snapshot(state)
    finally:
        await state.close()
    assert data["proxy"]["mode"] == "static" and data["proxy"]["max_inflight"] == 7
    assert data["totals"]["requests"] == 4 and data["totals"]["status"] == {"200": 3, "503": 1}
    assert data["totals"]["images_per_subrequest"] is None
    assert len(data["roster"]) == 4 and {"policy", "encoders"} <= set(data["scheduler"])
    assert state.policies[ENCODE] is not None


def test_the_page_loads_nothing_from_outside_and_its_csp_allows_exactly_its_inline_code():
    page, csp = _load_page()
    html = page.decode()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        assert blocks
        for block in blocks:
            digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
            assert f"'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
