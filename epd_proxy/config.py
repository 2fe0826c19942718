"""`serve`'s options, each declared once on a field of `Config` or of the reference proxy's flags it
extends (reference_flags.py; options.py says how); the rules
across the instance options are addresses.py's `check_topology`. `python -m epd_proxy_tools.flag_tables
serve` prints their table in docs/serve.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from epd_proxy import options as options_module
from epd_proxy.addresses import CommaList, KvEndpoints, Server, check_topology
from epd_proxy.fetch_flags import MEDIA
from epd_proxy.options import Choice, Choices, ConfigError, Count, Kind, Number, Option, Real, Seconds, Switch, Text  # noqa: F401 (ConfigError: callers catch it from here)
from epd_proxy.reference_flags import OURS, REFERENCE
from epd_proxy.reference_flags import ours_option as option
from epd_proxy.tenants import TenantFlags

# Names a user may pick, here so that the configuration needs no component (which keys them by these).
MEDIA_HASH_NAMES = ("sha256", "blake3")
ENCODE_POLICIES = ("expected_finish", "round_robin", "least_loaded", "content_affinity", "random", "power_of_two")
SERVING_POLICIES = ("prefix_affinity", "least_loaded", "power_of_two", "round_robin", "random")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
ROSTER_SCHEMES = ("redis", "rediss", "unix")
MODALITIES = ("image", "audio", "video")  # vLLM's names, as in --limit-mm-per-prompt
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
CLIENTS = "client side (slow and greedy clients)"
GROUPS = (REFERENCE, OURS, CLIENTS, MEDIA)  # the sections of `epd-proxy serve --help`, in this order


@dataclass(frozen=True, slots=True)
class Config(TenantFlags):
    """`serve`'s whole configuration: the reference proxy's flags (`ReferenceFlags`), then ours."""

    ejection_time_s: float = option(
        30.0,
        Seconds(positive=True),
        "seconds an instance stays ejected by outlier detection (transport, 5xx or gateway failures in a row); "
        "doubles per repeat without a success in between",
        flag="--ejection-time",
    )
    max_ejection_time_s: float = option(
        300.0, Seconds(), "cap on the doubled ejection time", flag="--max-ejection-time"
    )
    max_ejection_percent: int = option(
        50,
        Count(0, 100),
        "most of a role's instances outlier detection may eject at once; one always stays",
        flag="--max-ejection-percent",
    )
    # 5 is Envoy's default for both: vLLM answers 500 for some single bad inputs, so a lower count
    # would eject healthy instances.
    consecutive_5xx: int = option(
        5,
        Count(0),
        "5xx answers in a row that eject an instance (Envoy's `consecutive_5xx`); 0 = off; see [Health](health.md)",
        flag="--consecutive-5xx",
    )
    consecutive_gateway_failure: int = option(
        5,
        Count(0),
        "502/503/504 answers and transport failures in a row that eject an instance; 0 = off; see [Health](health.md)",
        flag="--consecutive-gateway-failure",
    )
    encoder_max_batch_size: int = option(
        0,
        Count(0),
        "images per encoder sub-request, 0 = unlimited (one sub-request per encoder)",
        flag="--encoder-max-batch-size",
        env="ENCODER_MAX_BATCH_SIZE",
    )
    encode_policy: str = option(
        "expected_finish",
        Choice(ENCODE_POLICIES),
        "how items are spread over encoders: `expected_finish` (see [Encoder scheduling](scheduling.md)), "
        "`round_robin` (the reference's), `least_loaded`, `content_affinity`, `random`, `power_of_two`",
        flag="--encode-policy",
    )
    encoder_affinity: bool = option(
        True,
        Switch(False),
        "`expected_finish` without cache affinity: a repeated image is placed like a new one",
        flag="--no-encoder-affinity",
    )
    adaptive_fan_out: bool = option(
        True,
        Switch(False),
        "`expected_finish` without load-adaptive fan-out: a request's items spread over encoders however busy they are",
        flag="--no-adaptive-fan-out",
    )
    coalesce: bool = option(
        True,
        Switch(False),
        "send every image group as its own sub-request: no sharing of one encoder sub-request by requests queued "
        "for the same busy encoder (see [Encoder scheduling](scheduling.md))",
        flag="--no-coalescing",
    )
    prefill_policy: str = option(
        "prefix_affinity",
        Choice(SERVING_POLICIES),
        "how a prefill instance is chosen per request: `prefix_affinity` (where the conversation's last turn "
        "ran), `least_loaded`, `power_of_two`, `round_robin`, `random`; see [Conversations](prefix-routing.md)",
        flag="--prefill-policy",
    )
    decode_policy: str = option(
        "prefix_affinity",
        Choice(SERVING_POLICIES),
        "how a PD (or decode) instance is chosen per request, as `--prefill-policy`; split decode instances, "
        "whose KV comes from prefill, go by load under `prefix_affinity`",
        flag="--decode-policy",
    )
    reuse: bool = option(
        True,
        Switch(False),
        "encode every image again, those the fleet already holds (an earlier turn's, a popular one) included, "
        "instead of sending them raw for the consumer to reuse (see [Conversations](prefix-routing.md))",
        flag="--no-reuse",
    )
    consumer_encode: bool = option(
        True,
        Switch(False),
        "fail a request with media when no encoder can take it instead of sending the media raw for the consumer "
        "to encode itself (see [Conversations](prefix-routing.md))",
        flag="--no-consumer-encode",
    )
    consumer_encode_after_s: float = option(
        10.0,
        Seconds(positive=True),
        "seconds of this proxy's work queued on every encoder past which media go raw for the consumer to encode "
        "instead (see [Conversations](prefix-routing.md))",
        flag="--consumer-encode-after",
    )
    text_only_consumers: bool = option(
        False,
        Switch(True),
        "the prefill / PD instances run with vLLM's `--language-model-only`: never send them raw media, as "
        "`--no-raw-media` with every modality",
        flag="--text-only-consumers",
    )
    no_raw_media: tuple[str, ...] = option(
        (),
        Choices(MODALITIES),
        "modalities the prefill / PD instances take no raw media of (vLLM's `--limit-mm-per-prompt` 0); the checks "
        "also ask them, see [Conversations](prefix-routing.md#what-a-consumer-takes-raw)",
        flag="--no-raw-media",
        shown="none",
    )
    kv_events: bool = option(
        True,
        Switch(False),
        "do not follow the prefill / PD instances' KV events (vLLM's `--kv-events-config`); see "
        "[How the proxy knows what each engine holds](prefix-routing.md#how-the-proxy-knows-what-each-engine-holds)",
        flag="--no-kv-events",
    )
    kv_events_endpoints: tuple[str, ...] = option(
        (),
        KvEndpoints(),
        "where the prefill / PD instances publish KV events, instead of asking each its `/kv_event_sources`: "
        "`PUB[+REPLAY]` ZMQ endpoints, one per listed prefill server then decode server, or one template holding "
        "`{host}`; data-parallel rank r on each port + r",
        flag="--kv-events-endpoints",
        shown="asked of each instance",
    )
    render_urls: tuple[str, ...] = option(
        (),
        CommaList(dns=False),
        "vLLM render servers (`vllm launch render`, or a `vllm serve --enable-scale-out`) asked for each request's "
        "token ids before placement, so the KV index is asked about every block of its prompt, not only the ones "
        "through its images (needs `prefix_affinity` and KV events); costs a render per request on that server, see "
        "[exact matching](prefix-routing.md#exact-matching-through-a-render-server)",
        flag="--render-urls",
        shown="none: the prompt is estimated",
    )
    render_timeout_s: float = option(
        0.5,
        Seconds(positive=True),
        "seconds a render (`--render-urls`) may take before the request is placed without it",
        flag="--render-timeout",
    )
    kv_events_stale_after_s: float = option(
        15.0,
        Seconds(positive=True),
        "seconds an engine's KV events may go unconfirmed (no batch, no replay answer) before its state is stale "
        "and routing falls back to its guesses for it",
        flag="--kv-events-stale-after",
    )
    kv_index_max_blocks: int = option(
        250_000,
        Count(1),
        "KV cache blocks the proxy tracks over all engines, in each worker (about 0.7 KB each); beyond it the "
        "oldest go first",
        flag="--kv-index-max-blocks",
    )
    encoder_failovers: int = option(
        1,
        Count(0),
        "other encoders a failed encoder sub-request is retried on; see [Failure behaviour](failures.md)",
        flag="--encoder-failovers",
    )
    connect_timeout_s: float = option(
        10.0,
        Seconds(positive=True),
        "seconds to open a connection to an encoder, prefill or decode instance, within the stage's own limit",
        flag="--connect-timeout",
    )
    encode_timeout_s: float | None = option(
        300.0,
        Seconds(zero_is_none=True),
        "seconds per encoder sub-request (0 = none); 504 naming the stage",
        flag="--encode-timeout",
    )
    prefill_timeout_s: float | None = option(
        600.0, Seconds(zero_is_none=True), "seconds for prefill (0 = none)", flag="--prefill-timeout"
    )
    decode_timeout_s: float | None = option(
        600.0,
        Seconds(zero_is_none=True),
        "seconds until decode's response headers, and separately the longest wait for a free decode connection "
        "under `--max-connections-per-backend` (0 = none)",
        flag="--decode-timeout",
    )
    stream_idle_timeout_s: float | None = option(
        300.0,
        Seconds(zero_is_none=True),
        "longest silence between two chunks of decode's answer once its headers arrived (0 = none)",
        flag="--stream-idle-timeout",
    )
    # vLLM (uvicorn) closes idle connections after this many seconds; we pool for half of it.
    backend_keep_alive_s: float = option(
        5.0,
        Number(),
        "the backends' keep-alive in seconds; idle pooled connections retire after half of it (`<= 0`: no reuse)",
        env="VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    )
    max_inflight: int = option(
        0,
        Count(0),
        "requests in flight beyond which new ones get 503 with `Retry-After: 1` (0 = unlimited); a request counts "
        "once its body is read and validated",
        flag="--max-inflight",
    )
    max_body_bytes: int = option(64 * 1024 * 1024, Count(1), "larger request bodies get 413", flag="--max-body-bytes")
    # nginx's client_header_timeout, client_body_timeout and keepalive_timeout.
    client_header_timeout_s: float = option(
        60.0,
        Seconds(),
        "seconds for a whole request head (from accept, or from its first byte on a kept-alive connection); then "
        "408 and close; 0 = none",
        flag="--client-header-timeout",
        group=CLIENTS,
    )
    client_body_timeout_s: float = option(
        60.0,
        Seconds(),
        "seconds allowed between two reads of a request body (nginx's meaning); then 408 and close; 0 = none",
        flag="--client-body-timeout",
        group=CLIENTS,
    )
    client_keepalive_timeout_s: float = option(
        75.0,
        Seconds(),
        "seconds an idle kept-alive client connection stays open",
        flag="--client-keepalive-timeout",
        group=CLIENTS,
    )
    max_client_connections: int = option(
        1024,
        Count(0),
        "open client connections, all workers together; more are answered 503 and closed at accept (0 = unlimited)",
        flag="--max-client-connections",
        group=CLIENTS,
    )
    max_media_items: int = option(256, Count(1), "more media items in one request get 400", flag="--max-media-items")
    max_connections_per_backend: int = option(
        0,
        Count(0),
        "open connections per backend instance (0 = unlimited); requests queue for a free one",
        flag="--max-connections-per-backend",
    )
    media_hash: str = option(
        "sha256",
        Choice(MEDIA_HASH_NAMES),
        "how media are named for the encoder cache, from their bytes and kind: `sha256` (an image's `data:` URL is "
        "named as the reference proxy names it) or `blake3`, about three times cheaper; see "
        "[Media names](security.md#media-names)",
        flag="--media-hash",
    )
    trust_client_fields: bool = option(
        False,
        Switch(),
        "accept client `uuid`s, `*_embeds` parts and `ec_transfer_params`/`kv_transfer_params` (only behind a "
        "trusted router); parts naming two kinds stay a 400",
        flag="--trust-client-fields",
    )
    api_key: str = option(
        "",
        Text(),
        "clients must send `Authorization: Bearer <key>` on `/v1/*` (401 otherwise), as `vllm serve --api-key`; "
        "prefer the env, as a flag shows in the process list",
        flag="--api-key",
        env="EPD_API_KEY",
        metavar="KEY",
    )
    backend_api_key: str = option(
        "",
        Text(),
        "bearer token sent to every backend call and health probe (vLLM started with `--api-key`)",
        flag="--backend-api-key",
        env="EPD_BACKEND_API_KEY",
        metavar="KEY",
    )
    profile_api_key: str = option(
        "",
        Text(),
        "bearer token for profiling calls only (as in the reference); falls back to the backend key",
        env="OPENAI_API_KEY",
    )
    workers: int = option(
        1,
        Count(1),
        "proxy processes sharing the port (`SO_REUSEPORT`); a worker that dies is replaced; in dynamic mode only "
        "with `--roster`; see [Scaling out](scaling.md)",
        flag="--workers",
    )
    roster_url: str = option(
        "",
        Text(ROSTER_SCHEMES),
        "dynamic mode: keep the roster in Redis, `redis://host:6379/0?prefix=epd` (also `rediss://`, `unix://`), "
        "shared by every worker and replica; see [Scaling out](scaling.md)",
        flag="--roster",
        metavar="URL",
    )
    dns_refresh_s: float = option(
        5.0,
        Seconds(positive=True),
        "seconds between resolutions of each DNS name (sooner after a failed one, or when one of its instances "
        "fails); a failed resolution keeps the last good set",
        flag="--dns-refresh",
    )
    dns_server: str = option(
        "",
        Server(),
        "the DNS server to ask (Consul's agent: `127.0.0.1:8600`); empty = the system's (`/etc/resolv.conf`, search "
        "domains included)",
        flag="--dns-server",
    )
    otlp_traces_endpoint: str = option(
        "",
        Text(),
        "export OpenTelemetry traces of every chat request there (vLLM's flag); empty = off; needs the `otel` "
        "extra; see [Observability](observability.md)",
        flag="--otlp-traces-endpoint",
        metavar="URL",
    )
    otlp_traces_sample_ratio: float | None = option(
        None,
        Real("RATIO", 0, maximum=1),
        "share of new traces sampled; a client's `traceparent` decides for its own (unless "
        "`--otlp-traces-client-context ignore`); unset = the SDK's sampler; see [Observability](observability.md)",
        flag="--otlp-traces-sample-ratio",
        shown="unset",
    )
    otlp_traces_client_context: str = option(
        "follow",
        Choice(("follow", "ignore")),
        "`ignore`: a client's `traceparent` neither starts a trace nor becomes a parent, and engines never get it; "
        "see [Observability](observability.md)",
        flag="--otlp-traces-client-context",
    )
    autoscale_utilisation: float = option(
        0.7,
        Real("RATIO", 0, exclusive=True, maximum=1),
        "target utilisation of a replica for `epd_role_recommended_replicas`; see `docs/observability.md`",
        flag="--autoscale-utilisation",
    )
    autoscale_concurrency: int = option(
        16,
        Count(1),
        "requests one prefill or decode replica serves at once at full load, for `epd_role_recommended_replicas`; "
        "see [Observability](observability.md)",
        flag="--autoscale-concurrency",
    )
    autoscale_window_s: float = option(
        60.0,
        Seconds(positive=True),
        "seconds of arrivals and busy time the autoscaling figures average over",
        flag="--autoscale-window",
    )
    log_format: str = option(
        "text",
        Choice(LOG_FORMATS),
        "`text` or `json` (one object per line; the request line carries its fields)",
        flag="--log-format",
    )
    log_level: str = option(
        "INFO",
        Choice(LOG_LEVELS, upper=True),
        "proxy log level, any case; one line per request at INFO",
        flag="--log-level",
    )

    def __post_init__(self) -> None:
        options_module.check(self)
        check_topology(self)
        check_tenancy(self)
        if self.render_urls and (
            not self.kv_events or "prefix_affinity" not in (self.prefill_policy, self.decode_policy)
        ):
            # Only prefix_affinity asks the KV index what a rendered prompt's blocks are held.
            raise ConfigError("--render-urls sharpens prefix_affinity from the KV events: it needs both")

    @property
    def pool_keep_alive_s(self) -> float | None:
        """How long an idle backend connection may stay pooled; None means never reuse."""
        return self.backend_keep_alive_s / 2 if self.backend_keep_alive_s > 0 else None


def check_tenancy(config: Config) -> None:
    """A tenant header needs tenants to name and a source to trust it from."""
    if config.tenant_header and not config.tenants_file:
        raise ConfigError("--tenant-header names a tenant of the --tenants file: give one")
    if config.tenant_header and not config.trusted_proxies.networks:
        raise ConfigError("--tenant-header is trusted only from --trusted-proxies: give the gateways' addresses")
    if config.trusted_proxies.networks and not config.tenant_header:
        raise ConfigError("--trusted-proxies is what --tenant-header is trusted from: give the header's name")
    if config.tenant_header and not HEADER_NAME.fullmatch(config.tenant_header):
        raise ConfigError(f"--tenant-header: {config.tenant_header!r} is not an HTTP header name")


def options() -> list[tuple[str, Any, Option]]:
    """Every option of `serve` as (field name, default, declaration), in the order of the fields."""
    return options_module.options(Config)
