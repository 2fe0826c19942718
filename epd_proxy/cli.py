"""`epd-proxy serve|up|bench`: flags in, a Config out; nothing else lives here."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import Any

from epd_proxy import __version__
from epd_proxy.config import (
    GROUPS,
    Config,
    ConfigError,
    Kind,
    Option,
    Switch,
    from_sources,
    options,
    plain,
    shown_default,
)

DESCRIPTION = """\
epd-proxy: an OpenAI-compatible front door for encoder-disaggregated (EPD) multimodal serving on
vLLM. It takes /v1/chat/completions requests, sends their images, audio and video to encoder
instances (batched per encoder), then drives prefill and decode with the encoders' cache handles,
streaming the answer back. A drop-in for vLLM's reference disagg_epd_proxy.py, with health
probing, failover, retries, limits, Prometheus /metrics and a live /status page."""

ENDPOINTS = """\
endpoints: /v1/chat/completions, /v1/models, /health, /metrics, /status (live page), /status.json,
/start_profile, /stop_profile, /instances (dynamic registration)"""

# The optional extras `up` and `bench` need, as import names (checked without importing them).
EXTRAS = {
    "up": ("local", ("vllm", "PIL", "openai")),
    "bench": ("bench", ("numpy", "PIL")),
}

log = logging.getLogger("epd_proxy.workers")


def _flag_help(default: Any, declared: Option) -> str:
    text = plain(declared.help)
    if not isinstance(declared.kind, Switch):
        shown, _ = shown_default(default, declared)
        text += f" (default: ${declared.env} or {shown})" if declared.env else f" (default: {shown})"
    return text.replace("%", "%%")


def _environment() -> str:
    """The variables `serve` reads, for the end of its --help."""
    lines = ["environment:"]
    for _, default, declared in options():
        if declared.env is None:
            continue
        if declared.flag:
            text = f"{declared.flag} when the flag is not given"
        else:
            text = f"{plain(declared.help)} (default: {shown_default(default, declared)[0]})"
        first, *rest = textwrap.wrap(text, 64)
        lines.append(f"  {declared.env:<30}{first}")
        lines.extend(" " * 32 + line for line in rest)
    return "\n".join(lines)


def _argument_type(kind: Kind):
    """The option's own parse, its complaint shown as argparse shows a bad value."""

    def parse(text: str) -> Any:
        try:
            return kind.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per declared option. A flag not given stays out of the namespace, so that its
    environment variable, then its default, apply (config.from_sources)."""
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for name, default, declared in options():
        if declared.flag is None:
            continue
        common = {"dest": name, "default": argparse.SUPPRESS, "help": _flag_help(default, declared)}
        if isinstance(declared.kind, Switch):
            groups[declared.group].add_argument(
                declared.flag, action="store_const", const=declared.kind.value, **common
            )
        else:
            metavar = declared.metavar or declared.kind.metavar
            groups[declared.group].add_argument(
                declared.flag, type=_argument_type(declared.kind), metavar=metavar, **common
            )


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    flags = {name for name, _, declared in options() if declared.flag}
    return from_sources({name: value for name, value in vars(args).items() if name in flags}, env)


def _run_worker(config: Config, log_level: str, reuse_port: bool, connections=None) -> None:
    from epd_proxy import server
    from epd_proxy.app import create_app
    from epd_proxy.logs import configure_logging

    configure_logging(log_level, config.log_format, config.log_requests)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    app = create_app(config)
    # Request bodies are trees of dicts freed by reference counting; the cyclic collector only
    # burns CPU walking them (about a tenth of the proxy's time under load). Freeze what startup
    # allocated and collect the young generation far less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    server.run(app, config, reuse_port=reuse_port, shared=connections)


# The exit status of a worker that could not open the port: another would fail the same way.
CANNOT_SERVE = 3
RESTART_DELAY_S = 0.5
RESTART_DELAY_MAX_S = 30.0
# A worker that dies after running this long is replaced at once.
STABLE_RUN_S = 60.0


def restart_delay(previous_s: float, ran_s: float) -> float:
    """Seconds before replacing a worker that died after running `ran_s`, when its predecessor in
    the same place waited `previous_s` (0 for the first): doubling while each dies young, so a
    worker that crashes on every start costs a start every 30 s, not a spinning core."""
    if ran_s >= STABLE_RUN_S:
        return 0.0
    return min(max(2 * previous_s, RESTART_DELAY_S), RESTART_DELAY_MAX_S)


def _worker(config: Config, log_level: str, connections) -> None:
    """The body of one `serve --workers` process."""
    try:
        _run_worker(config, log_level, True, connections)
    except OSError as exc:
        logging.getLogger("epd_proxy").error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        sys.exit(CANNOT_SERVE)


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class _Supervisor:
    """`serve --workers N`: keeps N workers running until SIGTERM or SIGINT. A worker that dies is
    replaced (after `restart_delay`), and what it held is given back: its client connections in
    the port's count, its live gauges in the multiprocess files."""

    def __init__(self, ctx, config: Config, log_level: str, workers: int, connections) -> None:
        self._ctx, self._config, self._log_level = ctx, config, log_level
        self._connections = connections
        self._procs: list = [None] * workers
        self._started = [0.0] * workers
        self._delays = [0.0] * workers
        self._due: dict[int, float] = {}
        self._stopping = self._failed = False
        self._wake_r, self._wake_w = os.pipe()

    def stop(self, signum=None, frame=None) -> None:
        if not self._stopping:
            self._stopping = True
            os.write(self._wake_w, b"\0")  # wakes run() whatever it waits for (once: run closes the pipe)

    def run(self) -> None:
        """Returns once every worker has exited; raises OSError if one could not open the port."""
        from multiprocessing.connection import wait

        try:
            for slot in range(len(self._procs)):
                self._start(slot)
            while not self._stopping:
                timeout = max(0.0, min(self._due.values()) - time.monotonic()) if self._due else None
                wait([p.sentinel for p in self._procs if p is not None] + [self._wake_r], timeout)
                for slot, proc in enumerate(self._procs):
                    if proc is not None and proc.exitcode is not None:
                        self._died(slot, proc)
                now = time.monotonic()
                for slot, when in list(self._due.items()):
                    if when <= now and not self._stopping:
                        del self._due[slot]
                        self._start(slot)
                        log.info("worker %d restarted (pid %d)", slot, self._procs[slot].pid)
            for proc in self._procs:
                if proc is not None and proc.is_alive():
                    proc.terminate()
            for slot, proc in enumerate(self._procs):
                if proc is not None:
                    proc.join()
                    self._reap(slot, proc)
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self._failed:
            raise OSError("a worker could not open the port (its error is logged above)")

    def _start(self, slot: int) -> None:
        worker = self._connections.worker(slot)
        proc = self._ctx.Process(target=_worker, args=(self._config, self._log_level, worker), daemon=False)
        proc.start()
        self._procs[slot], self._started[slot] = proc, time.monotonic()

    def _reap(self, slot: int, proc) -> None:
        from prometheus_client import multiprocess

        self._procs[slot] = None
        self._connections.release(slot)
        multiprocess.mark_process_dead(proc.pid)

    def _died(self, slot: int, proc) -> None:
        self._reap(slot, proc)
        if self._stopping:
            return
        if proc.exitcode == CANNOT_SERVE:
            self._failed = True
            self.stop()
            return
        ran = time.monotonic() - self._started[slot]
        delay = self._delays[slot] = restart_delay(self._delays[slot], ran)
        log.warning(
            "worker %d (pid %d) %s after %.1f s; starting another in %.1f s",
            slot,
            proc.pid,
            _how_it_ended(proc.exitcode),
            ran,
            delay,
        )
        self._due[slot] = time.monotonic() + delay


def serve(config: Config, log_level: str, workers: int = 1) -> None:
    if workers <= 1:
        _run_worker(config, log_level, reuse_port=False)
        return
    import multiprocessing
    import shutil
    import tempfile

    from epd_proxy.logs import configure_logging
    from epd_proxy.server import PortConnections

    configure_logging(log_level, config.log_format, config.log_requests)
    # Each worker owns its own state (cursor, pools); the kernel spreads connections. Metrics are
    # shared through files (prometheus-client's multiprocess mode), so /metrics is one view.
    metrics_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="epd-proxy-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    # --max-client-connections counts the port's connections, whichever worker the kernel picked.
    lock_fd, lock_path = tempfile.mkstemp(prefix="epd-proxy-connections-")
    os.close(lock_fd)
    supervisor = _Supervisor(ctx, config, log_level, workers, PortConnections.create(ctx, workers, lock_path))
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    try:
        supervisor.run()
    finally:
        os.unlink(lock_path)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


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
        epilog=f"{_environment()}\n\n{ENDPOINTS}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(serve_parser)
    # A configuration the options' checks refuse is a usage error of `serve`, shown with its usage.
    serve_parser.set_defaults(usage_error=serve_parser.error)
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
    except ConfigError as exc:
        args.usage_error(str(exc))
    try:
        serve(config, config.log_level, config.workers)
    except OSError as exc:  # typically the port is taken: a message, not a traceback
        parser.exit(1, f"epd-proxy serve: cannot serve on {config.host}:{config.port}: {exc}\n")
    return 0
