"""`epd-proxy serve|up|bench`: flags in, a Config out, then the command runs (`serve`: workers.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

from epd_proxy import __version__
from epd_proxy import options as options_module
from epd_proxy.config import GROUPS, Config, ConfigError, options
from epd_proxy.http.workers import hold_hangups, release_hangups, serve

DESCRIPTION = """\
epd-proxy: an OpenAI-compatible front door for encoder-disaggregated (EPD) multimodal serving on
vLLM. It takes OpenAI chat completions and Responses and Anthropic Messages requests, sends their
images, audio and video to encoder instances (batched per encoder), then drives prefill and decode
with the encoders' cache handles, streaming the answer back. A drop-in for vLLM's reference disagg_epd_proxy.py, with health
probing, failover, retries, limits, Prometheus /metrics and a live /status page."""

ENDPOINTS = """\
endpoints: /v1/chat/completions, /v1/responses, /v1/messages (and /v1/messages/count_tokens),
/v1/models, /health, /metrics, /status (live page), /status.json,
/start_profile, /stop_profile, /instances (dynamic registration)"""

# `up` and `bench` are tooling: the epd-proxy-tools distribution (tools/ in a checkout) with the
# extra each needs, as import names (checked without importing them).
TOOLS = "epd_proxy_tools"
EXTRAS = {
    "up": ("local", ("vllm", "PIL", "openai")),
    "bench": ("bench", ("numpy", "PIL")),
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    options_module.add_arguments(parser, [Config], GROUPS)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    flags = {name for name, _, declared in options() if declared.flag}
    return options_module.from_sources(
        Config, {name: value for name, value in vars(args).items() if name in flags}, env
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-proxy", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    serve_help = "run the proxy in front of encoder (E), prefill (P) and decode (D) or combined PD instances"
    serve_parser = commands.add_parser(
        "serve",
        help=serve_help,
        description=f"{serve_help}.",
        epilog=f"{options_module.environment_help(Config)}\n\n{ENDPOINTS}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(serve_parser)
    # A configuration the options' checks refuse is a usage error of `serve`, shown with its usage.
    serve_parser.set_defaults(usage_error=serve_parser.error)
    # `up` and `bench` parse their own flags (see their modules); listed here for the overview.
    commands.add_parser(
        "up",
        help="start a local E+PD stack on real vLLM behind the proxy (needs epd-proxy-tools[local])",
        add_help=False,
    )
    commands.add_parser(
        "bench",
        help="benchmark the proxy on a multi-image load against fakes, or real vLLM engines with --stack "
        "(needs epd-proxy-tools[bench])",
        add_help=False,
    )
    return parser


def missing_tools(command: str, helping: bool) -> str | None:
    """How to install what `up` or `bench` needs, when it is not installed (its help needs only
    the tools themselves)."""
    extra, modules = EXTRAS[command]
    missing = [name for name in (TOOLS, *(() if helping else modules)) if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"epd-proxy {command} is tooling: it needs epd-proxy-tools with its '{extra}' extra "
        f"(missing: {', '.join(missing)}); install it with\n"
        f"  pip install 'epd-proxy-tools[{extra}]'    (from a checkout: pip install -e './tools[{extra}]')\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] in (["up"], ["bench"]):
        command, rest = argv[0], argv[1:]
        if problem := missing_tools(command, helping=bool({"-h", "--help"} & set(rest))):
            sys.stderr.write(problem)
            return 2
        if command == "up":
            from epd_proxy_tools.local.up import main as up_main

            return up_main(rest)
        from epd_proxy_tools.bench.runner import main as bench_main

        return bench_main(rest)
    hold_hangups()  # `serve` reads the tenants file again on SIGHUP: one sent while it starts must wait, not kill it
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, os.environ)
        if config.roster_url:
            from epd_proxy.fleet.roster import require_client

            require_client()
        if config.otlp_traces_endpoint:
            from epd_proxy.ops.tracing import require_sdk

            require_sdk()
    except ConfigError as exc:
        args.usage_error(str(exc))
    if not config.tenants_file:
        release_hangups()
    try:
        serve(config)
    except OSError as exc:  # typically the port is taken: a message, not a traceback
        parser.exit(1, f"epd-proxy serve: cannot serve on {config.host}:{config.port}: {exc}\n")
    return 0
