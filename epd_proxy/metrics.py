"""Prometheus metrics, owned by the app (one registry per app, so tests never share counters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from epd_proxy.backends import Instance
from epd_proxy.health import Health
from epd_proxy.recent import RecentRequests
from epd_proxy.registry import Registry

if TYPE_CHECKING:
    from epd_proxy.roster import Roster

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITEM_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class _FleetCollector:
    """Per-instance gauges read at scrape time, so the hot path never updates them; only current
    members are reported, so an instance's series vanish when it leaves."""

    def __init__(self, registry: Registry, health: Health) -> None:
        self._registry = registry
        self._health = health

    def collect(self):
        labels = ["role", "instance"]
        inflight = GaugeMetricFamily("epd_instance_inflight", "Requests in flight per backend instance", labels=labels)
        up = GaugeMetricFamily(
            "epd_instance_up", "1 while the instance is in rotation, 0 while ejected or down", labels=labels
        )
        failures = GaugeMetricFamily(
            "epd_instance_consecutive_failures",
            "Consecutive failed health checks or transport errors",
            labels=labels,
        )
        ejections = GaugeMetricFamily(
            "epd_instance_ejections", "Times passive outlier detection ejected the instance", labels=labels
        )
        for view in self._health.snapshot(self._registry.all()):
            key = [view["role"], view["url"]]
            inflight.add_metric(key, view["inflight"])
            up.add_metric(key, 1 if view["in_rotation"] else 0)
            failures.add_metric(key, view["consecutive_failures"])
            ejections.add_metric(key, view["ejections"])
        yield from (inflight, up, failures, ejections)


class _RosterCollector:
    """The shared roster store's state (see roster.py), read at scrape time."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster

    def collect(self):
        up = GaugeMetricFamily(
            "epd_roster_up", "1 while the shared roster store answers; 0 while routing on the last roster read"
        )
        up.add_metric([], 1 if self._roster.up else 0)
        since = GaugeMetricFamily("epd_roster_seconds_since_sync", "Seconds since the roster was last read")
        seconds = self._roster.seconds_since_sync()
        if seconds is not None:
            since.add_metric([], seconds)
        yield from (up, since)


class Metrics:
    def __init__(self, fleet: Registry, health: Health) -> None:
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
        r.register(_FleetCollector(fleet, health))
        self._per_instance = (self.encoder_subrequests, self.failovers)
        fleet.watch(self)
        # The status page's sliding window of recent requests.
        self.recent = RecentRequests()
        # Bound once: a label lookup takes a lock and a dict probe on every request otherwise.
        self.stage = {name: self.stage_seconds.labels(name) for name in ("encode", "prefill", "decode_ttfb", "total")}

    # -- membership events: label series of an instance that left are dropped, so they stay bounded
    def joined(self, inst: Instance) -> None:
        pass

    def rejoined(self, inst: Instance) -> None:
        pass

    def left(self, inst: Instance) -> None:
        for family in self._per_instance:
            try:
                family.remove(inst.url)
            except KeyError:
                pass  # never labelled with it (prometheus_client before 0.20 raises for that)

    def watch_roster(self, roster: Roster) -> None:
        self.registry.register(_RosterCollector(roster))

    def render(self) -> bytes:
        return generate_latest(self.registry)
