"""Metrics with `--workers`: what /metrics shows when every worker writes to shared files."""

from __future__ import annotations

import warnings

import pytest
from prometheus_client import values

from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry
from epd_proxy.ops.metrics import Metrics

X, Y = "http://x:1", "http://y:1"


@pytest.fixture
def multiprocess(tmp_path, monkeypatch):
    """prometheus-client's multiprocess mode, as `serve --workers` switches it on, for this test."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())


def fleet_metrics() -> tuple[Registry, Metrics]:
    fleet, health = Registry(dynamic=True), Health()
    fleet.watch(health)
    metrics = Metrics(fleet, health)
    assert metrics.multiprocess
    return fleet, metrics


def lines_naming(metrics: Metrics, url: str) -> list[str]:
    return sorted(line for line in metrics.render().decode().splitlines() if url in line and not line.startswith("#"))


def test_an_instance_that_left_is_not_reported(multiprocess):
    fleet, metrics = fleet_metrics()
    fleet.register({"role": "encode", "url": X})
    fleet.register({"role": "encode", "url": Y})
    metrics.encoder_subrequests.labels(X).inc()
    metrics.failovers.labels(X).inc()
    assert len(lines_naming(metrics, X)) == 6  # four instance gauges and two counters
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # prometheus-client warns on removing labels in this mode
        fleet.unregister(X)
    assert lines_naming(metrics, X) == []
    assert lines_naming(metrics, Y) != []


def test_an_instance_back_in_another_role_is_reported_in_that_role_only(multiprocess):
    fleet, metrics = fleet_metrics()
    fleet.register({"role": "encode", "url": X})
    metrics.encoder_subrequests.labels(X).inc()
    metrics.render()
    fleet.unregister(X)
    fleet.register({"role": "prefill_decode", "url": X})
    lines = lines_naming(metrics, X)
    assert lines and all('role="prefill_decode"' in line for line in lines), lines


@pytest.mark.parametrize("workers", [False, True], ids=["one process", "workers"])
def test_ejections_are_counted_by_reason_and_go_with_their_instance(workers, request):
    if workers:
        request.getfixturevalue("multiprocess")
    fleet, health = Registry(dynamic=True), Health(fail_threshold=1, ejection_time_s=1)
    fleet.watch(health)
    metrics = Metrics(fleet, health)
    for url in (X, Y, "http://z:1", "http://w:1"):  # a budget of two ejections
        fleet.register({"role": "encode", "url": url})
    x = next(inst for inst in fleet.all() if inst.url == X)
    health.failed(x, "refused")
    for _ in range(5):
        health.answered(next(inst for inst in fleet.all() if inst.url == Y), 500)
    text = metrics.render().decode()
    assert f'epd_ejections_total{{instance="{X}",reason="transport",role="encode"}} 1.0' in text
    assert f'epd_ejections_total{{instance="{Y}",reason="5xx",role="encode"}} 1.0' in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fleet.unregister(X)
    assert lines_naming(metrics, X) == []


def test_a_file_a_worker_has_created_but_not_yet_sized_is_skipped(multiprocess, tmp_path):
    """prometheus-client creates a worker's file empty and sizes it a moment later; a scrape in
    that moment, or ever after if the worker was killed then, must not fail."""
    fleet, metrics = fleet_metrics()
    fleet.register({"role": "encode", "url": X})
    metrics.encoder_subrequests.labels(X).inc()
    (tmp_path / "counter_999999.db").touch()
    assert f'epd_encoder_subrequests_total{{encoder="{X}"}} 1.0' in metrics.render().decode()
