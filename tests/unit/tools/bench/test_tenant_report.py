"""The tenants workload's report: the engines' own work counters beside the tenants' times."""

from __future__ import annotations

from types import SimpleNamespace

from epd_proxy_tools.bench import tenant_load, tenant_report
from epd_proxy_tools.bench.real import Arm
from epd_proxy_tools.bench.tenant_load import FLOOD, INTERACTIVE, Sent

PLAN = SimpleNamespace(
    seconds=10.0,
    warm_s=1.0,
    rounds=2,
    flood_rate=4.0,
    capacity_rps=2.0,
    capacity_from="a test",
    interactive_clients=2,
    seed=0,
    backlog_rate=0.0,
    capacity_images_per_s=16.0,
)


def _block(kind: str, engines: dict | None) -> dict:
    sent = [
        Sent(INTERACTIVE, 2.0, 1, ended=2.2, status=200, ttft=0.1, tokens=90),
        Sent(FLOOD, 2.0, 8, ended=3.0, status=200, ttft=0.5, tokens=600),
    ]
    block = {"kind": kind, "round": 0, "sent": sent, "metrics": {}}
    if engines is not None:
        block["engines"] = engines
    return block


def test_real_engine_blocks_report_the_engines_counters_averaged_over_rounds():
    arm = Arm("epd-proxy", ["x"], ours=True)
    arm.blocks = [
        _block("flood", {"encoder_images_per_request": 4.0, "prompt_tokens_computed_per_request": 300.0}),
        _block("flood", {"encoder_images_per_request": 5.0, "prompt_tokens_computed_per_request": 500.0}),
        _block("alone", {"encoder_images_per_request": 1.0, "encoder_queue_ms": None}),
    ]
    result = tenant_report.build([arm], PLAN, tenant_load.new_tenants(1000), mode="real engines")
    flood = result["arms"][0]["blocks"]["flood"]
    assert flood["engines"] == {"encoder_images_per_request": 4.5, "prompt_tokens_computed_per_request": 400.0}
    assert result["arms"][0]["blocks"]["alone"]["engines"] == {"encoder_images_per_request": 1.0}
    table = result["table_md"]
    assert "| epd-proxy | flood | 4.50 | - | - | - | - | - | 400 | - |" in table
    assert "| epd-proxy | alone | 1.00 | - |" in table


def test_fake_blocks_have_no_engine_table():
    arm = Arm("epd-proxy", ["x"], ours=True)
    arm.blocks = [_block("flood", None), _block("alone", None)]
    result = tenant_report.build([arm], PLAN, tenant_load.new_tenants(1000), mode="fake engines")
    assert result["arms"][0]["blocks"]["flood"]["engines"] == {}
    assert "engines' own counters" not in result["table_md"]


def test_the_proxys_own_time_to_a_shed_answer_is_read_from_its_buckets_over_every_reason():
    buckets = {
        **{f"share/{le}": n for le, n in (("0.01", 90.0), ("0.05", 97.0), ("0.1", 99.0), ("+Inf", 100.0))},
        **{f"deadline/{le}": n for le, n in (("0.01", 0.0), ("0.05", 0.0), ("0.1", 0.0), ("+Inf", 100.0))},
    }
    answers = tenant_report.shed_answers(buckets)
    assert answers == {"count": 200.0, "within_promise": 97 / 200, "p99_within_s": float("inf")}
    share_only = tenant_report.shed_answers({k: v for k, v in buckets.items() if k.startswith("share/")})
    assert share_only == {"count": 100.0, "within_promise": 0.97, "p99_within_s": 0.1}
    assert tenant_report.shed_answers({}) is None
    assert tenant_report.shed_answers({"share/+Inf": 0.0}) is None
