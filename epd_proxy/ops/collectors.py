"""What /metrics reads at scrape time rather than counts as it goes: each instance's and encoder
lane's gauges, the other workers' files, the roster store's and the DNS names' state."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Literal

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from epd_proxy.fleet.backends import ENCODE
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.registry import Registry

if TYPE_CHECKING:
    from epd_proxy.fleet.discovery import Discovery
    from epd_proxy.fleet.kv_sources import KvEvents
    from epd_proxy.fleet.roster import Roster
# Per-instance gauges: name, help, how workers' values combine in multiprocess mode (in-flight
# counts add up, an instance is up only while every worker routes to it, failures show the worst).
# How a gauge's values from several worker processes combine (prometheus_client's modes).
Mode = Literal["livesum", "livemin", "livemax"]

FLEET_GAUGES: tuple[tuple[str, str, Mode], ...] = (
    (
        "epd_instance_inflight",
        "Requests holding each backend instance, from routing's choice (prefill: until its call ends)",
        "livesum",
    ),
    ("epd_instance_up", "1 while the instance is in rotation, 0 while ejected or down", "livemin"),
    ("epd_instance_consecutive_failures", "Consecutive failed health checks or transport errors", "livemax"),
    ("epd_instance_ejections", "Times passive outlier detection ejected the instance", "livesum"),
)


# Per-encoder gauges of the scheduler (lanes.Lane), read at scrape time like the fleet's.
SCHEDULER_GAUGES: tuple[tuple[str, str, Mode], ...] = (
    (
        "epd_encoder_estimated_seconds_per_item",
        "The scheduler's estimate of an encoder's time per media item, learnt from its answers",
        "livemax",
    ),
    (
        "epd_encoder_estimated_seconds_per_subrequest",
        "The scheduler's estimate of an encoder's fixed time per sub-request",
        "livemax",
    ),
    ("epd_encoder_queued_items", "Media items waiting in the proxy to share an encoder sub-request", "livesum"),
    (
        "epd_encoder_share_limit",
        "Items a shared encoder sub-request may hold now (0 while sharing pauses after a back-off)",
        "livemin",
    ),
    ("epd_encoder_suspect", "1 while a sub-request to the encoder is far overdue", "livemax"),
)


def lane_rows(lanes: Lanes):
    """(encoder url, values in SCHEDULER_GAUGES order, None where not known yet)."""
    for lane in lanes.all():
        yield lane.url, lane.gauges()


class LaneCollector:
    def __init__(self, lanes: Lanes) -> None:
        self._lanes = lanes

    def collect(self):
        families = [GaugeMetricFamily(name, text, labels=["encoder"]) for name, text, _ in SCHEDULER_GAUGES]
        for url, values in lane_rows(self._lanes):
            for family, value in zip(families, values):
                if value is not None:
                    family.add_metric([url], value)
        yield from families


def fleet_rows(registry: Registry, health: Health):
    """(role, url, values in FLEET_GAUGES order) for every current member."""
    for view in health.snapshot(registry.all()):
        values = (view["inflight"], 1 if view["in_rotation"] else 0, view["consecutive_failures"], view["ejections"])
        yield view["role"], view["url"], values


class FleetCollector:
    """Per-instance gauges read at scrape time, so the hot path never updates them; only current
    members are reported, so an instance's series vanish when it leaves."""

    def __init__(self, registry: Registry, health: Health) -> None:
        self._registry = registry
        self._health = health

    def collect(self):
        families = [GaugeMetricFamily(name, text, labels=["role", "instance"]) for name, text, _ in FLEET_GAUGES]
        for role, url, values in fleet_rows(self._registry, self._health):
            for family, value in zip(families, values):
                family.add_metric([role, url], value)
        yield from families


# Labels that name a backend instance, and the role a series with only that label implies.
INSTANCE_LABELS = {"instance": None, "encoder": ENCODE, "from_encoder": ENCODE}


class WrittenFiles:
    """prometheus-client's MultiProcessCollector over the files that hold something. A worker
    creates its file empty and sizes it a moment later; read in that moment, the empty file fails
    the whole scrape (prometheus/client_python#1199), and for good if the worker was killed then."""

    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self):
        files = []
        for name in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(name):
                    files.append(name)
            except OSError:
                pass  # a dead worker's live gauges, removed meanwhile (mark_process_dead)
        return MultiProcessCollector.merge(files, accumulate=True)


class CurrentMembersOnly:
    """Every worker's figures (multiprocess files) without the series of instances that left.

    The files outlive the instances they name and prometheus-client cannot delete a series from
    them, so this drops them at scrape time instead, as `Metrics.left` does in one process: a
    series stays only if its instance is a member now, in the role the series names."""

    def __init__(self, every_worker: WrittenFiles, fleet: Registry) -> None:
        self._every_worker = every_worker
        self._fleet = fleet

    def collect(self):
        roles = {inst.url: inst.role for inst in self._fleet.all()}

        def current(labels: dict[str, str]) -> bool:
            for name, implied_role in INSTANCE_LABELS.items():
                url = labels.get(name)
                if url is None:
                    continue
                role = implied_role or labels.get("role")
                if url not in roles or (role is not None and roles[url] != role):
                    return False
            return True

        for family in self._every_worker.collect():
            family.samples = [sample for sample in family.samples if current(sample.labels)]
            yield family


class Fixed:
    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return self._families


class RosterCollector:
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


class DnsCollector:
    """Each DNS name's last resolution (see discovery.py), read at scrape time: the answering
    worker's, which resolves on its own like every other."""

    def __init__(self, discovery: Discovery) -> None:
        self._discovery = discovery

    def collect(self):
        up = GaugeMetricFamily(
            "epd_dns_up",
            "1 while the name's last resolution got an answer, 0 while the last good set is kept",
            labels=["name"],
        )
        addresses = GaugeMetricFamily("epd_dns_addresses", "Addresses the name resolved to last", labels=["name"])
        since = GaugeMetricFamily(
            "epd_dns_seconds_since_success", "Seconds since the name last resolved", labels=["name"]
        )
        for name, ok, count, seconds in self._discovery.figures():
            up.add_metric([name], 1 if ok else 0)
            addresses.add_metric([name], count)
            if seconds is not None:
                since.add_metric([name], seconds)
        yield from (up, addresses, since)


class KvCollector:
    """Each prefill / PD instance's KV event state and how many blocks the index holds for it
    (see kv_sources.py), read at scrape time: the answering worker's, which follows every engine
    on its own like every other."""

    def __init__(self, kv_events: KvEvents) -> None:
        self._kv = kv_events

    def collect(self):
        state = GaugeMetricFamily(
            "epd_kv_events_state",
            "1 for the instance's KV event state: fresh (every engine's view is up to date), stale (some engine's "
            "is not: routing falls back to its guesses), none (no events followed)",
            labels=["instance", "state"],
        )
        blocks = GaugeMetricFamily(
            "epd_kv_index_blocks", "KV cache blocks the index holds for the instance", labels=["instance"]
        )
        for url in self._kv.urls():
            view = self._kv.view(url)
            if view is None:
                continue
            for name in ("fresh", "stale", "none"):
                state.add_metric([url, name], 1 if view["state"] == name else 0)
            blocks.add_metric([url], view["blocks"])
        capacity = GaugeMetricFamily(
            "epd_kv_index_capacity", "Block entries the KV index keeps at most (--kv-index-max-blocks)"
        )
        capacity.add_metric([], self._kv.index.max_blocks)
        yield from (state, blocks, capacity)
