"""The reference proxy's flags (vLLM's `disagg_epd_proxy.py`), with the same meaning: the first
part of `serve`'s configuration, which `config.Config` extends with ours. Declared as every option
is (options.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_proxy import options as options_module
from epd_proxy.addresses import CommaList
from epd_proxy.options import Count, Kind, Seconds, Switch, Text

# Sections of `epd-proxy serve --help` (config.GROUPS orders them).
REFERENCE = "reference proxy flags (same meaning as vLLM's disagg_epd_proxy.py)"
OURS = "epd-proxy flags"


def reference_option(default: Any, kind: Kind, help: str, **declaration: Any) -> Any:  # in `REFERENCE` unless told
    return options_module.option(default, kind, help, **{"group": REFERENCE, **declaration})


def ours_option(default: Any, kind: Kind, help: str, **declaration: Any) -> Any:  # in `OURS` unless told
    return options_module.option(default, kind, help, **{"group": OURS, **declaration})


@dataclass(frozen=True, slots=True)
class ReferenceFlags:
    host: str = reference_option(
        "0.0.0.0", Text(), "address to listen on", flag="--host", group=REFERENCE, metavar="HOST"
    )
    port: int = reference_option(8000, Count(0, 65535), "port to listen on", flag="--port", group=REFERENCE)
    encode_urls: tuple[str, ...] = reference_option(
        (),
        CommaList(),
        "comma list of encoder (E) URLs or DNS names (`dns://host:port`, `dns+srv://name`: see [DNS](scaling.md#finding-instances-through-dns)); "
        "required in static mode",
        flag="--encode-servers-urls",
        group=REFERENCE,
    )
    prefill_urls: tuple[str, ...] = reference_option(
        (),
        CommaList(),
        "comma list of prefill (P) URLs or DNS names; `none`, `disable` or empty = E+PD",
        flag="--prefill-servers-urls",
        group=REFERENCE,
        shown="none",
    )
    decode_urls: tuple[str, ...] = reference_option(
        (),
        CommaList(),
        "comma list of decode (D) or PD URLs or DNS names; required in static mode",
        flag="--decode-servers-urls",
        group=REFERENCE,
    )
    decode_retries: int = reference_option(
        1,
        Count(0),
        "on a consumer's HTTP 500, or an error event before decode's first generated text, re-encode and resend; "
        "0 disables; see [Failure behaviour](failures.md)",
        flag="--decode-retries",
        group=REFERENCE,
    )
    rewrite: bool = reference_option(
        True,
        Switch(False),
        "forward raw media to P/D and attach only the EC handles",
        flag="--no-rewrite",
        group=REFERENCE,
    )
    ec_consumer_zmq_addrs: tuple[str, ...] = reference_option(
        (),
        CommaList(http_urls=False),
        "Mooncake EC consumer control addresses, aligned with `--decode-servers-urls` (E+PD only)",
        flag="--ec-consumer-zmq-addrs",
        group=REFERENCE,
        metavar="ADDRS",
    )
    ec_consumer_dp_size: int = reference_option(
        1,
        Count(1),
        "data-parallel replicas per consumer; list each server's addresses consecutively",
        flag="--ec-consumer-dp-size",
        group=REFERENCE,
    )
    log_requests: bool = reference_option(
        False, Switch(), "log every HTTP request at DEBUG level", flag="--log-requests", group=REFERENCE
    )
    dynamic_registration: bool = reference_option(
        False,
        Switch(),
        "start with an empty fleet; instances join and leave via `/instances` (needs env `ADMIN_API_KEY`; "
        "listed URLs are then refused, DNS names are not)",
        flag="--dynamic-registration",
        group=REFERENCE,
    )
    admin_api_key: str = reference_option(
        "",
        Text(),
        "dynamic mode: required in `X-API-Key` on `POST`/`DELETE /instances` (constant-time compare); once "
        "clients authenticate, on profiling too",
        env="ADMIN_API_KEY",
        group=OURS,
    )
    probe_interval_s: float = reference_option(
        5.0,
        Seconds(),
        "seconds between active `GET /health` checks of every instance (both modes, own connections); 0 disables",
        flag="--probe-interval",
        group=REFERENCE,
    )
    probe_timeout_s: float = reference_option(
        2.0, Seconds(positive=True), "seconds a check may take", flag="--probe-timeout", group=REFERENCE
    )
    fail_threshold: int = reference_option(
        3,
        Count(1),
        "consecutive failed checks (down), or consecutive transport failures on live traffic (ejected), that take "
        "an instance out of rotation; see [Health](health.md)",
        flag="--fail-threshold",
        group=REFERENCE,
    )
    evicted_ttl_s: float = reference_option(
        900.0,
        Seconds(),
        "dynamic mode: forget instances out of rotation (no success since) for this long; 0 = never",
        flag="--evicted-ttl",
        group=REFERENCE,
    )
