"""A finished request's accounting: the access log line, the status count and the stage histograms."""

from __future__ import annotations

import logging

from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry
from epd_proxy.journey.trace import Trace, account
from epd_proxy.ops.metrics import Metrics


def metrics() -> Metrics:
    fleet, health = Registry(dynamic=True), Health()
    fleet.watch(health)
    return Metrics(fleet, health)


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_a_request_is_counted_by_status_and_its_stages_timed(caplog):
    m = metrics()
    trace = Trace(
        "req-1",
        items=2,
        encoder_requests=1,
        encode_s=0.004,
        decode_ttfb_s=0.002,
        outcome="complete",
        decode_url="http://pd",
    )
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        account(m, trace, 200)
    assert sample(m, "epd_requests_total", status="200") == 1
    assert sample(m, "epd_stage_seconds_count", stage="encode") == 1
    assert sample(m, "epd_stage_seconds_count", stage="decode_ttfb") == 1
    assert sample(m, "epd_stage_seconds_count", stage="total") == 1
    # A stage the request never reached is not observed as a zero.
    assert not sample(m, "epd_stage_seconds_count", stage="prefill")
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    assert record.fields["request_id"] == "req-1" and record.fields["decode"] == "http://pd"
    assert record.fields["prefill"] is None and record.fields["encode_ms"] == 4.0
    assert "request_id=req-1 status=200 items=2" in record.getMessage() and "prefill=-" in record.getMessage()


def test_a_request_refused_before_routing_is_counted_without_a_route(caplog):
    m = metrics()
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        account(m, Trace("req-2"), 503)
    assert sample(m, "epd_requests_total", status="503") == 1
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    assert record.fields["decode"] is None and record.fields["status"] == 503


def test_an_answer_cut_off_after_it_began_is_counted_as_aborted():
    m = metrics()
    account(m, Trace("req-3", outcome="aborted"), "aborted")
    assert sample(m, "epd_requests_total", status="aborted") == 1


def test_a_tenants_request_names_its_tenant_in_the_log_line_the_root_span_and_its_counter(caplog):
    m = metrics()
    trace = Trace("req-4", tenant="acme")
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        account(m, trace, 200)
    [record] = [r for r in caplog.records if r.name == "epd_proxy.request"]
    assert record.fields["tenant"] == "acme" and "tenant=acme" in record.getMessage()
    assert trace.span_attributes()["epd.tenant"] == "acme"
    assert sample(m, "epd_tenant_requests_total", tenant="acme", status="200") == 1


def test_without_tenants_no_tenant_is_counted():
    m = metrics()
    account(m, Trace("req-5"), 200)
    assert m.registry.get_sample_value("epd_tenant_requests_total", {"tenant": "default", "status": "200"}) is None
