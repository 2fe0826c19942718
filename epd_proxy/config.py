"""The one configuration object: every default lives here, and topology rules are checked once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from epd_proxy.extract import MEDIA_HASHES

_DISABLED_PREFILL = {"", "none", "disable", "disabled"}


class ConfigError(ValueError):
    """A configuration that cannot serve traffic; raised at startup, never per request."""


def split_urls(value: str | None) -> tuple[str, ...]:
    if value is None or value.strip().lower() in _DISABLED_PREFILL:
        return ()
    return tuple(url.strip().rstrip("/") for url in value.split(",") if url.strip())


@dataclass(frozen=True, slots=True)
class Config:
    encode_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    host: str = "0.0.0.0"
    port: int = 8000
    decode_retries: int = 1
    rewrite: bool = True
    ec_consumer_zmq_addrs: tuple[str, ...] = ()
    ec_consumer_dp_size: int = 1
    log_requests: bool = False
    # Images per encoder sub-request; 0 means one sub-request per encoder.
    encoder_max_batch_size: int = 0
    # vLLM (uvicorn) closes idle connections after this many seconds; we pool for half of it.
    backend_keep_alive_s: float = 5.0
    # Seconds; None disables the limit. Decode's limit covers the wait for response headers.
    encode_timeout_s: float | None = 300.0
    prefill_timeout_s: float | None = 600.0
    decode_timeout_s: float | None = 600.0
    # Longest silence between two chunks of decode's answer once its headers arrived.
    stream_idle_timeout_s: float | None = 300.0
    connect_timeout_s: float = 10.0
    max_body_bytes: int = 64 * 1024 * 1024
    max_media_items: int = 256
    # Open connections per backend instance; 0 = unlimited (requests queue for a free one).
    max_connections_per_backend: int = 0
    # Requests in flight beyond which new ones get 503 + Retry-After; 0 = unlimited.
    max_inflight: int = 0
    # Client side (nginx's client_header_timeout, client_body_timeout, keepalive_timeout), seconds;
    # header and body 0 = none. Open client connections beyond max_client_connections are refused.
    client_header_timeout_s: float = 60.0
    client_body_timeout_s: float = 60.0
    client_keepalive_timeout_s: float = 75.0
    max_client_connections: int = 1024
    dynamic_registration: bool = False
    admin_api_key: str = ""
    # Health probing of every instance (both modes); interval 0 disables it.
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 2.0
    fail_threshold: int = 3
    # Dynamic mode forgets instances evicted for longer than this; 0 = never.
    evicted_ttl_s: float = 900.0
    # Passive outlier detection: first ejection length, doubled per repeat up to the cap.
    ejection_time_s: float = 30.0
    max_ejection_time_s: float = 300.0
    # Share of a role's instances that outlier detection may eject at once (one always stays).
    max_ejection_percent: int = 50
    # Outlier detection on answers (health.py), 0 = off. 5 is Envoy's default for both: vLLM
    # answers 500 for some single bad inputs, so a lower count would eject healthy instances.
    consecutive_5xx: int = 5
    consecutive_gateway_failure: int = 5
    # Dynamic mode: the roster lives in this store (redis://host:port/db?prefix=...), shared by
    # every proxy process; empty = in-process roster, one worker.
    roster_url: str = ""
    log_format: str = "text"
    # How many other encoders a failed sub-request may be retried on (transport error, timeout, 5xx).
    encoder_failovers: int = 1
    # Honour client uuids, *_embeds parts and ec/kv_transfer_params (only behind a trusted router).
    trust_client_fields: bool = False
    # How media are named for the encoder cache (extract.MEDIA_HASHES): the reference's sha256, or blake3.
    media_hash: str = "sha256"
    encode_policy: str = "round_robin"
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_loaded"
    # Bearer token for every backend call and probe (vLLM started with --api-key).
    backend_api_key: str = ""
    # Bearer token for profiling calls only ($OPENAI_API_KEY, as in the reference proxy).
    profile_api_key: str = ""
    # Clients must present `Authorization: Bearer <api_key>` on /v1/* when set.
    api_key: str = ""

    def __post_init__(self) -> None:
        if self.dynamic_registration:
            if self.encode_urls or self.decode_urls or self.prefill_urls or self.ec_consumer_zmq_addrs:
                raise ConfigError("--dynamic-registration takes instances from POST /instances, not from URL flags")
            if not self.admin_api_key:
                raise ConfigError("--dynamic-registration needs ADMIN_API_KEY in the environment")
        else:
            if not self.decode_urls:
                raise ConfigError("--decode-servers-urls needs at least one URL")
            if not self.encode_urls:
                raise ConfigError("--encode-servers-urls needs at least one URL")
        if self.roster_url:
            if not self.dynamic_registration:
                raise ConfigError("--roster holds the dynamic roster: add --dynamic-registration")
            if self.roster_url.split("://", 1)[0] not in ("redis", "rediss", "unix"):
                raise ConfigError(f"--roster must be a redis://, rediss:// or unix:// URL, got {self.roster_url!r}")
        if self.fail_threshold < 1:
            raise ConfigError(f"--fail-threshold must be >= 1, got {self.fail_threshold}")
        for name in ("consecutive_5xx", "consecutive_gateway_failure"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.ejection_time_s <= 0:
            raise ConfigError(f"--ejection-time must be > 0, got {self.ejection_time_s}")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError(f"--max-ejection-percent must be within 0..100, got {self.max_ejection_percent}")
        if self.media_hash not in MEDIA_HASHES:
            raise ConfigError(f"--media-hash must be one of {', '.join(sorted(MEDIA_HASHES))}, got {self.media_hash!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.max_inflight < 0:
            raise ConfigError(f"--max-inflight must be >= 0, got {self.max_inflight}")
        for name in ("client_header_timeout_s", "client_body_timeout_s", "client_keepalive_timeout_s"):
            if getattr(self, name) < 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{flag} must be >= 0, got {getattr(self, name)}")
        if self.max_client_connections < 0:
            raise ConfigError(
                f"--max-client-connections must be >= 0 (0 = unlimited), got {self.max_client_connections}"
            )
        if self.encoder_max_batch_size < 0:
            raise ConfigError(f"ENCODER_MAX_BATCH_SIZE must be >= 0 (0 = unlimited), got {self.encoder_max_batch_size}")
        if self.ec_consumer_dp_size < 1:
            raise ConfigError(f"--ec-consumer-dp-size must be >= 1, got {self.ec_consumer_dp_size}")
        if self.decode_retries < 0:
            object.__setattr__(self, "decode_retries", 0)
        if self.ec_consumer_zmq_addrs:
            if self.prefill_urls:
                raise ConfigError(
                    "Mooncake EC consumer routing (--ec-consumer-zmq-addrs) supports E+PD only: "
                    "with a separate prefill stage the consumer is the prefill instance"
                )
            expected = len(self.decode_urls) * self.ec_consumer_dp_size
            if len(self.ec_consumer_zmq_addrs) != expected:
                raise ConfigError(
                    f"--ec-consumer-zmq-addrs has {len(self.ec_consumer_zmq_addrs)} addresses; expected "
                    f"{expected} (decode servers {len(self.decode_urls)} x dp size {self.ec_consumer_dp_size}, "
                    "each server's replicas listed consecutively)"
                )
        for name in ("encode_timeout_s", "prefill_timeout_s", "decode_timeout_s", "stream_idle_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                object.__setattr__(self, name, None)

    @property
    def pool_keep_alive_s(self) -> float | None:
        """How long an idle backend connection may stay pooled; None means never reuse."""
        if self.backend_keep_alive_s <= 0:
            return None
        return self.backend_keep_alive_s / 2


def _env_number(env: Mapping[str, str], name: str, default, kind, what: str):
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be {what}, got {raw!r}") from exc


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    return _env_number(env, name, default, int, "an integer")


def env_float(env: Mapping[str, str], name: str, default: float) -> float:
    return _env_number(env, name, default, float, "a number")


def default(name: str):
    """A Config field's default, so flags and code never restate it."""
    return Config.__dataclass_fields__[name].default
