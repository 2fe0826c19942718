"""Prometheus metrics, owned by the app (one registry per app, so tests never share counters).

With `serve --workers N` every worker writes its counters and histograms to files in a shared
folder (prometheus-client's multiprocess mode, switched on by `PROMETHEUS_MULTIPROC_DIR`, which
`cli.serve` sets before the workers start), and `/metrics` adds them all up, so it shows the same
figures whichever worker answers; series of instances no longer in the fleet are left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from epd_proxy.fleet.backends import DECODE, PREFILL_DECODE, Instance
from epd_proxy.fleet.health import EJECTION_REASONS, Health
from epd_proxy.fleet.kv_events import STREAM_EVENTS, FeedCounts
from epd_proxy.fleet.kv_index import Applied
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.registry import Registry
from epd_proxy.ops import autoscale as scaling
from epd_proxy.ops.collectors import (
    FLEET_GAUGES,
    SCHEDULER_GAUGES,
    CurrentMembersOnly,
    DnsCollector,
    Fixed,
    FleetCollector,
    KvCollector,
    LaneCollector,
    RosterCollector,
    WrittenFiles,
    fleet_rows,
    lane_rows,
)
from epd_proxy.ops.recent import RecentRequests

if TYPE_CHECKING:
    from epd_proxy.fleet.discovery import Discovery
    from epd_proxy.fleet.kv_sources import KvEvents
    from epd_proxy.fleet.roster import Roster


# The kinds of `epd_kv_event_blocks{change}`: fields of kv_index.Applied.
KV_CHANGES = ("stored", "removed", "orphans", "cleared")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITEM_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class _AutoscaleCollector:
    """One process's autoscaling figures (autoscale.py), read at scrape time."""

    def __init__(self, metrics: Metrics, autoscale: scaling.Autoscale) -> None:
        self._metrics = metrics
        self._autoscale = autoscale

    def collect(self) -> Iterator[Metric]:
        autoscale = self._autoscale
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            name: CounterMetricFamily(name, text, labels=["role"]) for name, text in scaling.TOTALS
        }
        families.update({name: GaugeMetricFamily(name, text, labels=["role"]) for name, text in scaling.WINDOW_GAUGES})
        name, text = scaling.ENCODER_BACKLOG
        families[name] = GaugeMetricFamily(name, text, labels=["encoder"])
        loads = {}
        for name, labels, value in scaling.rows(autoscale):
            families[name].add_metric(labels, value)
            if name == "epd_role_offered_load":
                loads[labels[0]] = value
        yield from families.values()
        yield self._metrics.recommended_family(autoscale, loads)


class Metrics:
    def __init__(self, fleet: Registry, health: Health) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "epd_requests",
            "Requests through every door (chat completions, Responses, Messages) by final HTTP status",
            ["status"],
            registry=r,
        )
        self.endpoint_requests = Counter(
            "epd_endpoint_requests",
            "Requests by the API they came in by (chat, responses, messages) and final HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
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
        self.coalesced = Counter(
            "epd_encoder_coalesced_subrequests",
            "Encoder sub-requests that carried items of more than one request, by encoder",
            ["encoder"],
            registry=r,
        )
        self.split_retries = Counter(
            "epd_encoder_split_retries",
            "Coalesced encoder sub-requests that failed and were sent again, each request's items on their own",
            ["encoder"],
            registry=r,
        )
        self.shared_refusals = Counter(
            "epd_encoder_shared_refusals",
            "Shared encoder sub-requests refused or unsplittable, by whom the split retry found at fault: "
            "a member request (charged=request) or the share itself (charged=encoder: the lane backs off)",
            ["encoder", "charged"],
            registry=r,
        )
        self.stalls = Counter(
            "epd_encoder_stalls",
            "Encoder sub-requests far past their expected time (the encoder turns suspect)",
            ["encoder"],
            registry=r,
        )
        self.share_wait = Histogram(
            "epd_encoder_share_wait_seconds",
            "Time an image group waited in the proxy for a busy encoder, to share a sub-request, until it was sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.affinity_hits = Counter(
            "epd_encoder_affinity_hits",
            "Media items sent to the encoder that was last sent the same content (where it is cached)",
            registry=r,
        )
        self.reused = Counter(
            "epd_items_reused",
            "Media items sent raw to a consumer that holds them from an earlier turn, instead of to an encoder; "
            "counted once per request, for the attempt whose answer went to the client",
            registry=r,
        )
        self.consumer_encoded = Counter(
            "epd_items_consumer_encoded",
            "Media items sent raw for the consumer to encode: no encoder in rotation, or all queued past the bound; "
            "counted once per request, for the attempt whose answer went to the client",
            registry=r,
        )
        # Bounded labels: decision in DECISIONS, source index / record / hash (routing.py).
        self.prefix_decisions = Counter(
            "epd_prefix_decisions",
            "Placement and reuse decisions by what decided them: the KV index, this process's record, or the hash",
            ["decision", "source"],
            registry=r,
        )
        self.renders = Counter(
            "epd_render",
            "Prompts rendered before placement (--render-urls), by outcome: rendered; failed, or skipped (the "
            "server failed in the last seconds, or has too many renders in flight): placed as without it",
            ["outcome"],
            registry=r,
        )
        self.retries = Counter(
            "epd_retries", "Whole-pipeline retries after a consumer HTTP 500, by stage", ["stage"], registry=r
        )
        self.failovers = Counter(
            "epd_encoder_failovers", "Encoder sub-requests retried on another encoder", ["from_encoder"], registry=r
        )
        self.ejections = Counter(
            "epd_ejections",
            "Ejections by passive outlier detection, by the signal that ejected the instance: transport, "
            "5xx (5xx answers in a row) or gateway (502/503/504 answers and transport failures in a row)",
            ["role", "instance", "reason"],
            registry=r,
        )
        health.on_ejection(lambda role, url, reason: self.ejections.labels(role, url, reason).inc())
        self.dns_failures = Counter(
            "epd_dns_resolution_failures", "DNS resolutions that got no answer, by name", ["name"], registry=r
        )
        self.rejected = Counter("epd_admission_rejected", "Requests refused with 503 by --max-inflight", registry=r)
        self.shed = Counter(
            "epd_requests_shed",
            "Requests turned away at arrival, by tenant (`default` without --tenants) and why: deadline (503, it "
            "could not start in time), inflight (503, --max-inflight), share (429, its tenant over its share)",
            ["tenant", "reason"],
            registry=r,
        )
        self.shed_answer = Histogram(
            "epd_shed_answer_seconds",
            "Seconds from a request's handler start to its answer when turned away at arrival, by reason",
            ["reason"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_requests = Counter(
            "epd_tenant_requests",
            "Requests by tenant (--tenants: the configured names only) and final HTTP status",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_encoder_s = Counter(
            "epd_tenant_encoder_seconds",
            "Encoder seconds each tenant was served (--tenants: the configured names only), charged as each "
            "sub-request is sent: its media at the encoder's measured speed, and its share of the fixed cost",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "epd_tenant_tokens",
            "Tokens each tenant was served, from the usage its answers carry: prompt (computed, cached ones left "
            "out) and output",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenants_reloads = Counter(
            "epd_tenants_reloads",
            "Readings of the tenants file on SIGHUP, by outcome: ok, or refused (the tenants before stay in force)",
            ["outcome"],
            registry=r,
        )
        self.backend_refused = Counter(
            "epd_backend_answers_refused",
            "Backend answers refused and their connection closed: over a limit (head, header count or "
            "size, body), a second answer after a complete one, bytes on an idle connection, not HTTP",
            ["stage", "reason"],
            registry=r,
        )
        self.kv_batches = Counter(
            "epd_kv_event_batches",
            "KV event batches applied to the index, by prefill / PD instance",
            ["instance"],
            registry=r,
        )
        self.kv_blocks = Counter(
            "epd_kv_event_blocks",
            "KV cache blocks the index learnt of, by instance and change: stored, removed, orphans (stored under a "
            "parent the index does not know: not indexed), cleared (AllBlocksCleared events)",
            ["instance", "change"],
            registry=r,
        )
        self.kv_stream = Counter(
            "epd_kv_event_stream",
            "What happened to an instance's KV event stream: gap_filled (by a replay), gap_lost (the replay no "
            "longer had it: the view was rebuilt), replay (replay requests, heartbeats included), restart (a new "
            "publisher), stale (turns from fresh to stale), undecodable (batches that could not be read)",
            ["instance", "what"],
            registry=r,
        )
        self.replica_names = Counter(
            "epd_replica_names",
            "Names of media seen encoded, exchanged with the other replicas through the --roster store: told, "
            "heard, dropped (never sent: the store was unreachable, or too many waited)",
            ["what"],
            registry=r,
        )
        self.kv_evictions = Counter(
            "epd_kv_index_evictions",
            "Block entries dropped from the KV index at --kv-index-max-blocks, oldest first",
            registry=r,
        )
        parsed = Counter(
            "epd_request_parse",
            "Chat requests by how their body was read: splice (media kept as slices of the client's bytes) "
            "or full (the whole body parsed)",
            ["path"],
            registry=r,
        )
        self.parsed_spliced, self.parsed_full = parsed.labels("splice"), parsed.labels("full")
        self._fleet, self._health = fleet, health
        # Read at scrape time and the same in every worker (read_at_scrape).
        self._shared_collectors: list = []
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            # The hot path never touches these: a timer and each scrape publish this worker's view.
            self._fleet_gauges = [
                Gauge(name, text, ["role", "instance"], multiprocess_mode=mode, registry=None)
                for name, text, mode in FLEET_GAUGES
            ]
        else:
            r.register(FleetCollector(fleet, health))
        self._per_instance = (
            self.encoder_subrequests,
            self.failovers,
            self.coalesced,
            self.split_retries,
            self.stalls,
            self.kv_batches,
        )
        self._lanes: Lanes | None = None
        self.autoscale: scaling.Autoscale | None = None
        self._lane_gauges: list = []
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
        if self.multiprocess:
            return  # the files cannot forget a series; the scrape leaves it out (CurrentMembersOnly)
        labels: list[tuple[Counter, tuple[str, ...]]] = [(family, (inst.url,)) for family in self._per_instance]
        labels += [(self.ejections, (inst.role, inst.url, reason)) for reason in EJECTION_REASONS]
        labels += [(self.shared_refusals, (inst.url, charged)) for charged in ("request", "encoder")]
        labels += [(self.kv_blocks, (inst.url, change)) for change in KV_CHANGES]
        labels += [(self.kv_stream, (inst.url, what)) for what in STREAM_EVENTS]
        for family, values in labels:
            try:
                family.remove(*values)
            except KeyError:
                pass  # never labelled with it (prometheus_client before 0.20 raises for that)

    def decided(self, decision: str, source: str, count: int = 1) -> None:
        """A placement or reuse decision (`epd_prefix_decisions_total`): its kind and what decided it."""
        if count:
            self.prefix_decisions.labels(decision, source).inc(count)

    def tenant_served(self, tenant: str, encoder_s: float, prompt: int, output: int) -> None:
        """A fairness.Ledger charge, counted."""
        if encoder_s:
            self.tenant_encoder_s.labels(tenant).inc(encoder_s)
        if prompt:
            self.tenant_tokens.labels(tenant, "prompt").inc(prompt)
        if output:
            self.tenant_tokens.labels(tenant, "output").inc(output)

    def watch_lanes(self, lanes: Lanes) -> None:
        """The scheduler's per-encoder estimates and queues (see scheduler.py)."""
        self._lanes = lanes
        if self.multiprocess:
            self._lane_gauges = [
                Gauge(name, text, ["encoder"], multiprocess_mode=mode, registry=None)
                for name, text, mode in SCHEDULER_GAUGES
            ]
        else:
            self.registry.register(LaneCollector(lanes))

    def watch_autoscale(self, autoscale: scaling.Autoscale) -> None:
        """Per-role load, backlog and recommended replicas (autoscale.py)."""
        self.autoscale = autoscale
        if self.multiprocess:
            self._scaling_totals = {name: Counter(name, text, ["role"], registry=None) for name, text in scaling.TOTALS}
            self._scaling_published: dict[tuple[str, str], float] = {}
            self._scaling_gauges = {
                name: Gauge(name, text, ["role"], multiprocess_mode="livesum", registry=None)
                for name, text in scaling.WINDOW_GAUGES
            }
            name, text = scaling.ENCODER_BACKLOG
            self._scaling_gauges[name] = Gauge(name, text, ["encoder"], multiprocess_mode="livesum", registry=None)
        else:
            self.registry.register(_AutoscaleCollector(self, autoscale))

    def members(self, role: str) -> int:
        roles = (DECODE, PREFILL_DECODE) if role == DECODE else (role,)
        return sum(len(self._fleet.members(r)) for r in roles)

    def recommended_family(self, autoscale: scaling.Autoscale, loads: dict[str, float]) -> GaugeMetricFamily:
        name, text = scaling.RECOMMENDED
        family = GaugeMetricFamily(name, text, labels=["role"])
        for role, count in scaling.recommendations(autoscale, loads, self.members):
            family.add_metric([role], count)
        return family

    def _publish_scaling(self, autoscale: scaling.Autoscale) -> None:
        for name, labels, value in scaling.rows(autoscale):
            if name in self._scaling_totals:
                # Counters in the shared files only go up: add what grew since the last publish.
                key = (name, labels[0])
                grown = value - self._scaling_published.get(key, 0.0)
                if grown > 0:
                    self._scaling_totals[name].labels(*labels).inc(grown)
                    self._scaling_published[key] = value
            else:
                self._scaling_gauges[name].labels(*labels).set(value)

    def watch_roster(self, roster: Roster) -> None:
        self.read_at_scrape(RosterCollector(roster))

    def watch_kv(self, kv_events: KvEvents) -> None:
        """Each prefill / PD instance's KV event state and index size (kv_sources.py), as the
        answering worker sees them, and the feeds' counters."""
        self.read_at_scrape(KvCollector(kv_events))
        kv_events.counts = FeedCounts(
            applied=self._kv_applied, stream=lambda url, what: self.kv_stream.labels(url, what).inc()
        )

    def _kv_applied(self, url: str, applied: Applied) -> None:
        self.kv_batches.labels(url).inc()
        for change in KV_CHANGES:
            if count := getattr(applied, change):
                self.kv_blocks.labels(url, change).inc(count)
        if applied.evicted:
            self.kv_evictions.inc(applied.evicted)

    def watch_dns(self, discovery: Discovery) -> None:
        self.read_at_scrape(DnsCollector(discovery))

    def read_at_scrape(self, collector) -> None:
        """A collector of figures that are the same whichever worker is asked (state every worker
        reads, such as the shared roster or the port's connection count), so they never go
        through the multiprocess files."""
        self.registry.register(collector)
        self._shared_collectors.append(collector)

    def publish_fleet(self) -> None:
        """Multiprocess mode: write this worker's view of the fleet where every worker's scrape
        reads it."""
        for role, url, values in fleet_rows(self._fleet, self._health):
            for gauge, value in zip(self._fleet_gauges, values):
                gauge.labels(role, url).set(value)
        if self._lanes is not None:
            for url, values in lane_rows(self._lanes):
                for gauge, value in zip(self._lane_gauges, values):
                    if value is not None:
                        gauge.labels(url).set(value)
        if self.autoscale is not None:
            self._publish_scaling(self.autoscale)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.publish_fleet()
        every_worker = CollectorRegistry()
        merged = list(CurrentMembersOnly(WrittenFiles(os.environ["PROMETHEUS_MULTIPROC_DIR"]), self._fleet).collect())
        if self.autoscale is not None:
            # Made from the sum of every worker's load: a sum of each worker's rounded-up count
            # would recommend a replica per worker.
            loads: dict[str, float] = {}
            for family in merged:
                if family.name == "epd_role_offered_load":
                    for sample in family.samples:
                        role = sample.labels["role"]
                        loads[role] = loads.get(role, 0.0) + sample.value
            merged.append(self.recommended_family(self.autoscale, loads))
        every_worker.register(Fixed(merged))
        for collector in self._shared_collectors:
            every_worker.register(collector)
        return generate_latest(every_worker)
