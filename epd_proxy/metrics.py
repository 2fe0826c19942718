"""Prometheus metrics, owned by the app (one registry per app, so tests never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from epd_proxy.registry import Registry

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITEM_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class _FleetCollector:
    """Per-instance gauges read at scrape time, so the hot path never updates them."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self):
        inflight = GaugeMetricFamily(
            "epd_instance_inflight", "Requests in flight per backend instance", labels=["role", "instance"]
        )
        up = GaugeMetricFamily(
            "epd_instance_up", "1 while the instance is in rotation, 0 once evicted", labels=["role", "instance"]
        )
        failures = GaugeMetricFamily(
            "epd_instance_consecutive_failures",
            "Consecutive failed probes or transport errors",
            labels=["role", "instance"],
        )
        for inst in self._registry.all():
            inflight.add_metric([inst.role, inst.url], inst.inflight)
            up.add_metric([inst.role, inst.url], 1 if inst.live else 0)
            failures.add_metric([inst.role, inst.url], inst.consecutive_failures)
        yield from (inflight, up, failures)


class Metrics:
    def __init__(self, fleet: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("epd_requests", "Chat completion requests by final HTTP status", ["status"], registry=r)
        self.stage_seconds = Histogram(
            "epd_stage_seconds",
            "Time per stage: encode (fan-out to all encoders), prefill, decode_ttfb (until decode's "
            "response headers), total (until the last byte was relayed)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.encoder_subrequests = Counter(
            "epd_encoder_subrequests", "Encoder sub-requests sent, by encoder", ["encoder"], registry=r
        )
        self.items_per_subrequest = Histogram(
            "epd_encoder_items_per_subrequest", "Media items per encoder sub-request", buckets=ITEM_BUCKETS, registry=r
        )
        self.retries = Counter(
            "epd_retries", "Whole-pipeline retries after a consumer HTTP 500, by stage", ["stage"], registry=r
        )
        self.failovers = Counter(
            "epd_encoder_failovers", "Encoder sub-requests retried on another encoder", ["from_encoder"], registry=r
        )
        self.rejected = Counter("epd_admission_rejected", "Requests refused with 503 by --max-inflight", registry=r)
        r.register(_FleetCollector(fleet))
        # Bound once: a label lookup takes a lock and a dict probe on every request otherwise.
        self.stage = {name: self.stage_seconds.labels(name) for name in ("encode", "prefill", "decode_ttfb", "total")}

    def render(self) -> bytes:
        return generate_latest(self.registry)
