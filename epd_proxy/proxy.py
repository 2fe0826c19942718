"""The composition root: every part of the proxy built from one Config, started and stopped here.

The registry, health, routing policies, metrics, roster, upstream pools, prober and pipeline are
made and wired together in this one place; the HTTP routes (routes.py) only call them, and
create_app (app.py) ties their lifespan to the server's.
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from epd_proxy.calls.media import FetchRules, MediaFetcher
from epd_proxy.calls.upstream import Timeouts, Upstream, bearer
from epd_proxy.config import MODALITIES, Config
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL
from epd_proxy.fleet.capabilities import MediaProbe
from epd_proxy.fleet.discovery import Discovery
from epd_proxy.fleet.fairness import Ledger
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.kv_holds import KvHolds, MediaDepths
from epd_proxy.fleet.kv_index import KvIndex
from epd_proxy.fleet.kv_sources import KvEvents
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.prober import Prober, check_pool
from epd_proxy.fleet.profiling import Profiling
from epd_proxy.fleet.registry import Registry
from epd_proxy.fleet.replicas import ReplicaChannel
from epd_proxy.fleet.report import HealthReport
from epd_proxy.fleet.roster import open_roster
from epd_proxy.fleet.routing import Policies, RoutingPolicy, make_policy, make_serving_policy
from epd_proxy.fleet.scheduler import ExpectedFinish
from epd_proxy.fleet.siblings import SIBLINGS_ENV, Siblings
from epd_proxy.fleet.windows import Windows
from epd_proxy.journey.admission import Admission, Backlog, Encoder, Wait, predicted_wait
from epd_proxy.journey.extract import ReadOptions
from epd_proxy.journey.pipeline import Pipeline
from epd_proxy.journey.render import Renderer
from epd_proxy.journey.subrequest import EncodeOptions
from epd_proxy.ops import tracing
from epd_proxy.ops.autoscale import Autoscale
from epd_proxy.ops.metrics import Metrics
from epd_proxy.tenants import TenantsFile


def build_pipeline(
    config: Config,
    fleet: Registry,
    health: Health,
    upstream: Upstream,
    policies: Policies,
    metrics: Metrics,
    lanes: Lanes | None = None,
    kv_holds: MediaDepths | None = None,
) -> Pipeline:
    """The pipeline with the options it uses. Encode and prefill answer in one piece, so their
    limit covers the whole exchange; decode's covers the wait for its headers and for a free
    connection under --max-connections-per-backend (behind long streams a request would otherwise
    queue as long as they last), and the idle limit each silence within the stream."""
    connect = config.connect_timeout_s
    return Pipeline(
        fleet,
        health,
        upstream,
        policies,
        metrics,
        encoding=EncodeOptions(
            Timeouts(connect=connect, total=config.encode_timeout_s),
            config.encoder_max_batch_size,
            send_uuid=config.rewrite,
            failovers=config.encoder_failovers,
            coalesce=config.coalesce,
        ),
        prefill_timeouts=Timeouts(connect=connect, total=config.prefill_timeout_s),
        decode_timeouts=Timeouts(
            connect=connect,
            pool=config.decode_timeout_s,
            headers=config.decode_timeout_s,
            idle=config.stream_idle_timeout_s,
        ),
        decode_retries=config.decode_retries,
        rewrite=config.rewrite,
        lanes=lanes,
        reuse=config.reuse,
        consumer_encode=config.consumer_encode,
        consumer_encode_after_s=config.consumer_encode_after_s,
        no_raw_media=frozenset(MODALITIES if config.text_only_consumers else config.no_raw_media),
        kv_holds=kv_holds,
        renderer=Renderer(upstream, config.render_urls, metrics, config.render_timeout_s, config.rewrite)
        if config.render_urls
        else None,
        windows=Windows(config.consumer_window, lanes.fairness)
        if lanes and lanes.fairness and config.consumer_window
        else None,
    )


def encode_policy(config: Config, lanes: Lanes) -> RoutingPolicy:
    if config.encode_policy == "expected_finish":
        return ExpectedFinish(lanes, affinity=config.encoder_affinity, adaptive=config.adaptive_fan_out)
    return make_policy(config.encode_policy)


class ProxyState:
    """Everything that lives as long as the server: the fleet, its health, routing cursors, the pools."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fleet = Registry.from_config(config)
        self.health = Health(
            fail_threshold=config.fail_threshold,
            consecutive_5xx=config.consecutive_5xx,
            consecutive_gateway_failure=config.consecutive_gateway_failure,
            ejection_time_s=config.ejection_time_s,
            max_ejection_time_s=config.max_ejection_time_s,
            max_ejection_percent=config.max_ejection_percent,
            panic_when_all_down=not config.dynamic_registration,
        )
        self.fleet.watch(self.health)
        # What the encoder scheduler knows of each encoder: placement, sending and /status share it.
        # Checked as the Config was made; read again here, and on SIGHUP (reload_tenants).
        self.tenants = TenantsFile(config.tenants_file) if config.tenants_file else None
        # With tenants, the encoder queues serve the least-served tenant first (fairness.py).
        self.lanes = Lanes(Ledger() if self.tenants is not None else None)
        self.fleet.watch(self.lanes)
        # Groups waiting for an encoder health ejects move to another at once.
        self.health.on_ejection(lambda role, url, reason: self.lanes.ejected(url) if role == ENCODE else None)
        self.policies: Policies = {
            ENCODE: encode_policy(config, self.lanes),
            PREFILL: make_serving_policy(config.prefill_policy),
            DECODE: make_serving_policy(config.decode_policy),
        }
        self.metrics = Metrics(self.fleet, self.health)
        self.metrics.watch_lanes(self.lanes)
        if self.lanes.fairness is not None:
            self.lanes.fairness.on_charge = self.metrics.tenant_served
        self.metrics.watch_autoscale(
            Autoscale(
                self.lanes,
                window_s=config.autoscale_window_s,
                utilisation=config.autoscale_utilisation,
                concurrency=config.autoscale_concurrency,
            )
        )
        # Shared membership for replicas and workers; health stays per process.
        self.roster = open_roster(config.roster_url, config.evicted_ttl_s, self.fleet, self.health.in_rotation)
        if self.roster is not None:
            self.metrics.watch_roster(self.roster)
        # Members found through DNS names, owned by their name in the registry (discovery.py).
        self.discovery = Discovery.from_config(
            config, self.fleet, on_failure=lambda name: self.metrics.dns_failures.labels(name).inc()
        )
        if self.discovery is not None:
            self.metrics.watch_dns(self.discovery)
            self.health.on_unreachable(self.discovery.unreachable)
        # What each prefill / PD engine holds, from its KV events: every worker follows every engine.
        self.kv_index: KvIndex | None = None
        self.kv_events: KvEvents | None = None
        if config.kv_events:
            self.kv_index = KvIndex(max_blocks=config.kv_index_max_blocks, stale_after_s=config.kv_events_stale_after_s)
            self.kv_events = KvEvents.from_config(config, self.kv_index)
            self.metrics.watch_kv(self.kv_events)
            self.fleet.watch(self.kv_events)
        self.admission = Admission(config.max_inflight, self.metrics.rejected)
        self.report = HealthReport(config, self.fleet, self.health, self.roster, self.discovery)
        # How every request body is read; fixed for the server's life.
        self.parse_options = ReadOptions(config.trust_client_fields, config.max_media_items, config.media_hash)
        # Media behind http(s) URLs, fetched for every door (journey/remote.py).
        self.media = MediaFetcher(FetchRules.of(config))
        self.upstream: Upstream | None = None
        # Active checks get their own small pool: a backend whose request connections are all busy
        # streaming (--max-connections-per-backend) must still answer its health checks.
        self.probes: Upstream | None = None
        # Asks each consumer where it publishes KV events, on connections of its own as checks do.
        self.kv_pool: Upstream | None = None
        # --workers: the other workers of this port, told what this one sees encoded; --roster:
        # the other replicas, told the same through the store.
        self.siblings: Siblings | None = None
        self.replicas: ReplicaChannel | None = None
        self.prober: Prober | None = None
        self.pipeline: Pipeline | None = None
        self.profiling: Profiling | None = None
        self._background: list[asyncio.Task] = []

    async def start(self) -> None:
        config = self.config
        if config.otlp_traces_endpoint:
            tracing.setup(
                config.otlp_traces_endpoint,
                config.otlp_traces_sample_ratio,
                follow_client=config.otlp_traces_client_context == "follow",
            )
        headers = bearer(config.backend_api_key)
        self.upstream = Upstream(
            keep_alive_s=config.pool_keep_alive_s,
            max_connections_per_backend=config.max_connections_per_backend,
            headers=headers,
            on_refused=lambda stage, reason: self.metrics.backend_refused.labels(stage, reason).inc(),
        )
        self.fleet.watch(self.upstream)
        # Profiling calls carry OPENAI_API_KEY (as in the reference), else the backend key.
        self.profiling = Profiling(
            self.fleet,
            self.health,
            self.upstream,
            api_key=config.profile_api_key or config.backend_api_key,
            by_role=config.dynamic_registration,
        )
        self.pipeline = build_pipeline(
            config,
            self.fleet,
            self.health,
            self.upstream,
            self.policies,
            self.metrics,
            self.lanes,
            KvHolds(self.kv_index, self.kv_events.ranks) if self.kv_index and self.kv_events else None,
        )
        held = self.pipeline.held
        self.siblings = Siblings.join(os.environ.get(SIBLINGS_ENV))
        if self.siblings is not None:
            held.tell_encoded.append(self.siblings.tell)
            await self.siblings.listen(held)
        if self.roster is not None:
            counted = self.metrics.replica_names
            self.replicas = ReplicaChannel(
                config.roster_url, held.encoded_elsewhere, lambda what, n: counted.labels(what).inc(n)
            )
            held.tell_encoded.append(self.replicas.tell)
            # Each waits briefly for the store: a store down at startup costs that wait once.
            await asyncio.gather(self.roster.start(), self.replicas.start())
        if self.discovery is not None:
            await self.discovery.start()
        if self.kv_events is not None:
            self.kv_pool = check_pool(headers)
            await self.kv_events.start(self.kv_pool)
        if self.metrics.multiprocess:
            self._background.append(asyncio.create_task(self._publish_fleet_forever()))
        if config.probe_interval_s > 0:
            self.probes = check_pool(headers)
            self.fleet.watch(self.probes)
            media = MediaProbe(self.probes, self.fleet.all, timeout_s=config.probe_timeout_s)
            self.fleet.watch(media)
            self.prober = Prober(
                self.probes,
                self.health,
                self.fleet.all,
                interval_s=config.probe_interval_s,
                timeout_s=config.probe_timeout_s,
                media=media,
            )
            self._background.append(asyncio.create_task(self.prober.run_forever(self.forget_expired)))
        elif config.dynamic_registration and config.evicted_ttl_s > 0:
            self._background.append(asyncio.create_task(self._forget_expired_forever()))

    def reload_tenants(self) -> None:
        """SIGHUP: the tenants file read again; a bad one keeps the tenants in force (and is logged)."""
        if self.tenants is not None:
            problem = self.tenants.reload()
            self.metrics.tenants_reloads.labels("ok" if problem is None else "refused").inc()

    def wait_at_arrival(self, largest_item: float, tenant: str | None = None, priority: int = 0) -> Wait:
        """The wait a request of `tenant` whose largest media item costs `largest_item` is
        predicted now (admission.predicted_wait), from the encoders' lanes and the consumers in
        rotation. An encoder not yet measured adds nothing: its speed is a guess. With --tenants,
        the queued groups fair queueing sends after it are left out (fairness.Ledger.behind), and
        while tenants compete the consumers' windows count what goes before it there."""
        pipeline = self.pipeline
        assert pipeline is not None, "start() builds the pipeline before the server takes requests"
        encoders: tuple[Encoder, ...] = ()
        if largest_item > 0:
            now = pipeline.encode.clock()
            lanes = [self.lanes.of(encoder) for encoder in pipeline.candidates(ENCODE)]
            known = [(lane, lane.speed.known()) for lane in lanes]
            behind = self.lanes.fairness.behind(tenant, priority) if self.lanes.fairness and tenant else None
            encoders = tuple(
                Encoder(lane.backlog_s(now, *speed), *speed, lane.queued_s(*speed, behind) if behind else 0.0)
                if speed
                else Encoder(0.0, 0.0, 0.0)
                for lane, speed in known
            )
        autoscale, config = self.metrics.autoscale, self.config
        served = autoscale.arrived[DECODE] if autoscale is not None else 0
        windows = pipeline.windows
        window_s = 0.0
        if windows is not None:
            consumers = pipeline.candidates(PREFILL) or pipeline.decoders()
            window_s = windows.wait_s([c.url for c in consumers], tenant, priority)
        backlog = Backlog(
            encoders,
            tuple(consumer.inflight for consumer in pipeline.decoders()),
            config.autoscale_concurrency,
            autoscale.busy_s[DECODE] / served if autoscale is not None and served else 0.0,
            config.consumer_encode_after_s if config.consumer_encode else None,
            window_s,
        )
        return predicted_wait(backlog, largest_item)

    def asked_of_encoders(self, cost: float) -> tuple[float, float]:
        """What a request whose media cost `cost` image-equivalents asks of the encoders in seconds,
        at their mean measured speed (0 before any was measured), and how many of the measured
        encoders this process may count on: with `--workers`, its part of them, as the kernel
        spreads the requests evenly."""
        pipeline = self.pipeline
        assert pipeline is not None, "start() builds the pipeline before the server takes requests"
        known = [speed for speed in (self.lanes.of(e).speed.known() for e in pipeline.candidates(ENCODE)) if speed]
        encoders = len(known) / self.config.workers
        if cost <= 0 or not known:
            return 0.0, encoders
        fixed = sum(f for f, _ in known) / len(known)
        item = sum(i for _, i in known) / len(known)
        return fixed + item * cost, encoders

    def forget_expired(self) -> None:
        """Dynamic mode: instances out of rotation for longer than --evicted-ttl leave the fleet."""
        ttl = self.config.evicted_ttl_s
        if not self.config.dynamic_registration or ttl <= 0:
            return
        if self.roster is not None:
            return  # the store's TTL forgets them, for every process at once (roster.py)
        for url in self.health.out_longer_than(ttl):
            self.fleet.forget(url, f"out of rotation for more than {ttl:g}s")

    async def _forget_expired_forever(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.config.evicted_ttl_s))
            self.forget_expired()

    async def _publish_fleet_forever(self) -> None:
        """--workers: another worker's /metrics shows this one's fleet view at most a second old."""
        while True:
            self.metrics.publish_fleet()
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        if self.siblings is not None:
            self.siblings.close()
        if self.replicas is not None:
            await self.replicas.close()
        if self.roster is not None:
            await self.roster.close()
        if self.discovery is not None:
            await self.discovery.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for pool in (self.upstream, self.probes, self.kv_pool):
            if pool is not None:
                await pool.close()
        await self.media.close()
        if self.config.otlp_traces_endpoint:
            # The last requests' spans are exported before the process goes.
            await asyncio.to_thread(tracing.shutdown)


STATE = web.AppKey("state", ProxyState)
