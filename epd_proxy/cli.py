"""`epd-proxy serve|up|bench`: flags in, a Config out, then the command runs (`serve`: workers.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from epd_proxy import __version__
from epd_proxy.config import Config, ConfigError, default, env_float, env_int, split_urls
from epd_proxy.extract import MEDIA_HASHES
from epd_proxy.routing import ENCODE_POLICIES, SERVING_POLICIES
from epd_proxy.workers import serve

DESCRIPTION = """\
epd-proxy: an OpenAI-compatible front door for encoder-disaggregated (EPD) multimodal serving on
vLLM. It takes /v1/chat/completions requests, sends their images, audio and video to encoder
instances (batched per encoder), then drives prefill and decode with the encoders' cache handles,
streaming the answer back. A drop-in for vLLM's reference disagg_epd_proxy.py, with health
probing, failover, retries, limits, Prometheus /metrics and a live /status page."""

SERVE_ENV = """\
environment:
  ENCODER_MAX_BATCH_SIZE        images per encoder sub-request when --encoder-max-batch-size is
                                not given (0 = unlimited)
  VLLM_HTTP_TIMEOUT_KEEP_ALIVE  the backends' idle keep-alive in seconds (default 5); pooled
                                connections retire at half of it
  EPD_API_KEY                   bearer token clients must present on /v1/* (--api-key overrides)
  EPD_BACKEND_API_KEY           bearer token sent to every backend (--backend-api-key overrides)
  OPENAI_API_KEY                bearer token for profiling calls to backends, as the reference
  ADMIN_API_KEY                 X-API-Key required by POST/DELETE /instances and, once clients
                                authenticate, by profiling (--dynamic-registration needs it)

endpoints: /v1/chat/completions, /v1/models, /health, /metrics, /status (live page), /status.json,
/start_profile, /stop_profile, /instances (dynamic registration)"""

# The optional extras `up` and `bench` need, as import names (checked without importing them).
EXTRAS = {
    "up": ("local", ("vllm", "PIL", "openai")),
    "bench": ("bench", ("numpy", "PIL")),
}
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def _int_at_least(minimum: int):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
        return number

    return parse


def _seconds(*, allow_zero: bool):
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
        if number < 0 or (number == 0 and not allow_zero) or number != number:
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {value}")
        return number

    return parse


def _port(value: str) -> int:
    number = _int_at_least(0)(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {number}")
    return number


def _url_list(value: str) -> str:
    """Checked here so that a typo is a usage error at startup, not a failure on the first request."""
    for url in split_urls(value):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise argparse.ArgumentTypeError(f"{url!r} is not an http:// or https:// URL with a host")
        try:
            _ = parts.port
        except ValueError:
            raise argparse.ArgumentTypeError(f"{url!r} has an invalid port") from None
    return value


def _seconds_or_none(value: str) -> float | None:
    """A stage limit: 0 turns it off."""
    number = _seconds(allow_zero=True)(value)
    return number if number > 0 else None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    ref = parser.add_argument_group("reference proxy flags (same meaning as vLLM's disagg_epd_proxy.py)")
    ref.add_argument("--host", default=default("host"), help="address to listen on (default: %(default)s)")
    ref.add_argument("--port", type=_port, default=default("port"), help="port to listen on (default: %(default)s)")
    ref.add_argument(
        "--encode-servers-urls", type=_url_list, default="", help="comma-separated encoder (E) URLs (static mode)"
    )
    ref.add_argument(
        "--prefill-servers-urls",
        type=_url_list,
        default="none",
        help="comma-separated prefill (P) URLs; 'none', 'disable' or empty for E+PD (default: none)",
    )
    ref.add_argument(
        "--decode-servers-urls",
        type=_url_list,
        default="",
        help="comma-separated decode (D) or PD URLs (static mode)",
    )
    ref.add_argument(
        "--decode-retries",
        type=int,
        default=default("decode_retries"),
        help="re-encode and resend when the consumer answers HTTP 500 (default: %(default)s; 0 disables)",
    )
    ref.add_argument("--no-rewrite", action="store_true", help="forward raw media to P/D, only attach EC handles")
    ref.add_argument(
        "--ec-consumer-zmq-addrs",
        default="",
        help="Mooncake EC consumer control addresses aligned with --decode-servers-urls (E+PD only)",
    )
    ref.add_argument(
        "--ec-consumer-dp-size",
        type=_int_at_least(1),
        default=default("ec_consumer_dp_size"),
        help="data-parallel replicas per consumer; list each server's addresses consecutively",
    )
    ref.add_argument("--log-requests", action="store_true", help="log every HTTP request at DEBUG level")
    ref.add_argument(
        "--dynamic-registration",
        action="store_true",
        help="start with an empty fleet; instances join via POST /instances (needs $ADMIN_API_KEY)",
    )
    ref.add_argument(
        "--probe-interval",
        type=_seconds(allow_zero=True),
        default=default("probe_interval_s"),
        help="seconds between health probes of every instance, 0 disables (default: %(default)s)",
    )
    ref.add_argument(
        "--probe-timeout",
        type=_seconds(allow_zero=False),
        default=default("probe_timeout_s"),
        help="seconds a health probe may take (default: %(default)s)",
    )
    ref.add_argument(
        "--fail-threshold",
        type=_int_at_least(1),
        default=default("fail_threshold"),
        help="consecutive failed health checks, or transport failures, that take an instance out of rotation "
        "(default: %(default)s)",
    )
    ref.add_argument(
        "--evicted-ttl",
        type=_seconds(allow_zero=True),
        default=default("evicted_ttl_s"),
        help="dynamic mode: forget instances evicted this long, 0 = never (default: %(default)s)",
    )

    ours = parser.add_argument_group("epd-proxy flags")
    ours.add_argument(
        "--ejection-time",
        type=float,
        default=default("ejection_time_s"),
        help="seconds an instance stays out once outlier detection ejects it (--fail-threshold transport "
        "failures, --consecutive-5xx or --consecutive-gateway-failure in a row); doubles per repeat "
        "(default: %(default)s)",
    )
    ours.add_argument(
        "--max-ejection-time",
        type=float,
        default=default("max_ejection_time_s"),
        help="cap on the doubled ejection time (default: %(default)s)",
    )
    ours.add_argument(
        "--max-ejection-percent",
        type=int,
        default=default("max_ejection_percent"),
        help="most of a role's instances outlier detection may eject at once; one always stays (default: %(default)s)",
    )
    ours.add_argument(
        "--consecutive-5xx",
        type=_int_at_least(0),
        default=default("consecutive_5xx"),
        help="answers with a 5xx status in a row on live traffic that eject an instance, 0 = off; 4xx never "
        "counts, and a request's retries count once (default: %(default)s, as Envoy: vLLM answers 500 to some "
        "single bad inputs)",
    )
    ours.add_argument(
        "--consecutive-gateway-failure",
        type=_int_at_least(0),
        default=default("consecutive_gateway_failure"),
        help="gateway failures in a row (502, 503, 504 answers and transport failures alike) that eject an "
        "instance, 0 = off (default: %(default)s)",
    )
    ours.add_argument(
        "--encoder-max-batch-size",
        type=_int_at_least(0),
        default=None,
        help="images per encoder sub-request, 0 = unlimited (default: $ENCODER_MAX_BATCH_SIZE or 0)",
    )
    ours.add_argument(
        "--encode-policy",
        choices=ENCODE_POLICIES,
        default=default("encode_policy"),
        help="how media items are spread over encoders (default: %(default)s)",
    )
    ours.add_argument(
        "--prefill-policy",
        choices=SERVING_POLICIES,
        default=default("prefill_policy"),
        help="how a prefill instance is chosen per request (default: %(default)s)",
    )
    ours.add_argument(
        "--decode-policy",
        choices=SERVING_POLICIES,
        default=default("decode_policy"),
        help="how a decode (or PD) instance is chosen per request (default: %(default)s)",
    )
    ours.add_argument(
        "--encoder-failovers",
        type=_int_at_least(0),
        default=default("encoder_failovers"),
        help="other encoders a failed sub-request is retried on (default: %(default)s)",
    )
    ours.add_argument(
        "--encode-timeout",
        type=_seconds_or_none,
        default=default("encode_timeout_s"),
        help="seconds per encoder sub-request, 0 = none (default: %(default)s)",
    )
    ours.add_argument(
        "--prefill-timeout",
        type=_seconds_or_none,
        default=default("prefill_timeout_s"),
        help="seconds for prefill, 0 = none (default: %(default)s)",
    )
    ours.add_argument(
        "--decode-timeout",
        type=_seconds_or_none,
        default=default("decode_timeout_s"),
        help="seconds until decode's response headers, 0 = none (default: %(default)s)",
    )
    ours.add_argument(
        "--stream-idle-timeout",
        type=_seconds_or_none,
        default=default("stream_idle_timeout_s"),
        help="longest silence between two chunks of decode's answer, 0 = none (default: %(default)s)",
    )
    ours.add_argument(
        "--max-body-bytes",
        type=_int_at_least(1),
        default=default("max_body_bytes"),
        help="largest accepted request body; larger gets 413 (default: %(default)s)",
    )
    ours.add_argument(
        "--max-media-items",
        type=_int_at_least(1),
        default=default("max_media_items"),
        help="media items allowed in one request; more gets 400 (default: %(default)s)",
    )
    ours.add_argument(
        "--max-connections-per-backend",
        type=_int_at_least(0),
        default=default("max_connections_per_backend"),
        help="open connections per backend instance, 0 = unlimited (default: %(default)s)",
    )
    ours.add_argument(
        "--trust-client-fields",
        action="store_true",
        help="accept client uuids, *_embeds parts and ec/kv_transfer_params (trusted callers only)",
    )
    ours.add_argument(
        "--media-hash",
        choices=sorted(MEDIA_HASHES),
        default=default("media_hash"),
        help="how media are named for the encoder cache: sha256 of the URL, as the reference proxy names them "
        "(mixed fleets share cache keys), or blake3, about three times cheaper per request (default: %(default)s)",
    )
    ours.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer <key>' on /v1/* (401 otherwise), as `vllm serve --api-key`; "
        "prefer env EPD_API_KEY, which this flag overrides (a flag shows in the process list)",
    )
    ours.add_argument(
        "--backend-api-key",
        default=None,
        help="bearer token the proxy sends to every backend and health probe (vLLM started with --api-key); "
        "prefer env EPD_BACKEND_API_KEY, which this flag overrides",
    )
    ours.add_argument(
        "--max-inflight",
        type=_int_at_least(0),
        default=default("max_inflight"),
        help="requests in flight beyond which new ones get 503 + Retry-After, 0 = unlimited",
    )
    clients = parser.add_argument_group("client side (slow and greedy clients)")
    clients.add_argument(
        "--client-header-timeout",
        type=_seconds(allow_zero=True),
        default=default("client_header_timeout_s"),
        help="seconds for a whole request head (from accept, or from its first byte on a kept-alive "
        "connection); then 408 and close, 0 = none (default: %(default)s)",
    )
    clients.add_argument(
        "--client-body-timeout",
        type=_seconds(allow_zero=True),
        default=default("client_body_timeout_s"),
        help="seconds allowed between two reads of a request body; then 408 and close, 0 = none (default: %(default)s)",
    )
    clients.add_argument(
        "--client-keepalive-timeout",
        type=_seconds(allow_zero=True),
        default=default("client_keepalive_timeout_s"),
        help="seconds an idle kept-alive client connection stays open (default: %(default)s)",
    )
    clients.add_argument(
        "--max-client-connections",
        type=_int_at_least(0),
        default=default("max_client_connections"),
        help="open client connections (all workers together); more are answered 503 and closed at "
        "accept, 0 = unlimited (default: %(default)s)",
    )
    ours.add_argument(
        "--workers",
        type=_int_at_least(1),
        default=1,
        help="proxy processes sharing the port (SO_REUSEPORT); dynamic mode needs --roster (default: 1)",
    )
    ours.add_argument(
        "--roster",
        default=default("roster_url"),
        metavar="URL",
        help="dynamic mode: keep the roster in this Redis (redis://host:6379/0?prefix=epd), shared by "
        "every worker and replica (default: in-process)",
    )
    ours.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=default("log_format"),
        help="log lines as text or one JSON object each (default: %(default)s)",
    )
    ours.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="proxy log level, any case (default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    max_batch = args.encoder_max_batch_size
    if max_batch is None:
        max_batch = env_int(env, "ENCODER_MAX_BATCH_SIZE", default("encoder_max_batch_size"))
    return Config(
        encode_urls=split_urls(args.encode_servers_urls),
        decode_urls=split_urls(args.decode_servers_urls),
        prefill_urls=split_urls(args.prefill_servers_urls),
        host=args.host,
        port=args.port,
        decode_retries=args.decode_retries,
        rewrite=not args.no_rewrite,
        ec_consumer_zmq_addrs=split_urls(args.ec_consumer_zmq_addrs),
        ec_consumer_dp_size=args.ec_consumer_dp_size,
        log_requests=args.log_requests,
        encoder_max_batch_size=max_batch,
        backend_keep_alive_s=env_float(env, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", default("backend_keep_alive_s")),
        encode_timeout_s=args.encode_timeout,
        prefill_timeout_s=args.prefill_timeout,
        decode_timeout_s=args.decode_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        encode_policy=args.encode_policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        encoder_failovers=args.encoder_failovers,
        max_body_bytes=args.max_body_bytes,
        trust_client_fields=args.trust_client_fields,
        media_hash=args.media_hash,
        api_key=args.api_key if args.api_key is not None else env.get("EPD_API_KEY", ""),
        backend_api_key=args.backend_api_key
        if args.backend_api_key is not None
        else env.get("EPD_BACKEND_API_KEY", ""),
        profile_api_key=env.get("OPENAI_API_KEY", ""),
        max_inflight=args.max_inflight,
        client_header_timeout_s=args.client_header_timeout,
        client_body_timeout_s=args.client_body_timeout,
        client_keepalive_timeout_s=args.client_keepalive_timeout,
        max_client_connections=args.max_client_connections,
        max_media_items=args.max_media_items,
        max_connections_per_backend=args.max_connections_per_backend,
        dynamic_registration=args.dynamic_registration,
        admin_api_key=env.get("ADMIN_API_KEY", ""),
        probe_interval_s=args.probe_interval,
        probe_timeout_s=args.probe_timeout,
        fail_threshold=args.fail_threshold,
        evicted_ttl_s=args.evicted_ttl,
        ejection_time_s=args.ejection_time,
        max_ejection_time_s=args.max_ejection_time,
        max_ejection_percent=args.max_ejection_percent,
        consecutive_5xx=args.consecutive_5xx,
        consecutive_gateway_failure=args.consecutive_gateway_failure,
        roster_url=args.roster,
        log_format=args.log_format,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-proxy", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    serve_help = "run the proxy in front of encoder (E), prefill (P) and decode (D) or combined PD instances"
    add_serve_arguments(
        commands.add_parser(
            "serve",
            help=serve_help,
            description=f"{serve_help}.",
            epilog=SERVE_ENV,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    # `up` and `bench` parse their own flags (see their modules); listed here for the overview.
    commands.add_parser(
        "up", help="start a local E+PD stack on real vLLM behind the proxy (needs the 'local' extra)", add_help=False
    )
    commands.add_parser(
        "bench",
        help="benchmark the proxy on a multi-image load against fakes (needs the 'bench' extra)",
        add_help=False,
    )
    return parser


def missing_extra(command: str) -> str | None:
    """How to install what `up` or `bench` needs, when it is not installed."""
    extra, modules = EXTRAS[command]
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"epd-proxy {command} needs the '{extra}' extra (missing: {', '.join(missing)}); install it with\n"
        f"  pip install 'epd-proxy[{extra}]'    (from a checkout: pip install -e '.[{extra}]')\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] in (["up"], ["bench"]):
        command, rest = argv[0], argv[1:]
        if not {"-h", "--help"} & set(rest) and (problem := missing_extra(command)):
            sys.stderr.write(problem)
            return 2
        if command == "up":
            from epd_proxy.local.up import main as up_main

            return up_main(rest)
        from epd_proxy.bench.runner import main as bench_main

        return bench_main(rest)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, os.environ)
        if config.roster_url:
            from epd_proxy.roster import require_client

            require_client()
        if args.workers > 1 and config.dynamic_registration and not config.roster_url:
            raise ConfigError("--workers > 1 in dynamic mode needs --roster: each worker would hold its own registry")
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        serve(config, args.log_level, args.workers)
    except OSError as exc:  # typically the port is taken: a message, not a traceback
        parser.exit(1, f"epd-proxy serve: cannot serve on {config.host}:{config.port}: {exc}\n")
    return 0
