"""`serve`: the proxy's processes. One serves in this process; `--workers N` runs N of them on
the same port under a supervisor that replaces those that die."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import time

from epd_proxy.config import Config

log = logging.getLogger("epd_proxy.workers")


def hold_hangups() -> None:
    """Keep a SIGHUP pending instead of letting its default action end a process still starting:
    a tenants file reload asked for before the handler exists happens once it does
    (`release_hangups`). Processes forked meanwhile inherit the hold, so a worker is covered from
    its first instruction."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})


def release_hangups() -> None:
    """Deliver a held SIGHUP to whatever handles it now (the default action, without a tenants file)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


def _run_worker(config: Config, reuse_port: bool, connections=None) -> None:
    # Here, not at the top: cli.py imports this module, and `--help`, `up` and `bench` need none of it.
    from epd_proxy.http import server
    from epd_proxy.http.app import create_app
    from epd_proxy.ops.logs import configure_logging

    configure_logging(config.log_level, config.log_format, config.log_requests)
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
    limits = server.ClientLimits.from_config(config)
    # A SIGHUP held since the command line was read (cli.main) is a reload from here on.
    server.run(
        app,
        limits,
        signals_ready=release_hangups,
        host=config.host,
        port=config.port,
        reuse_port=reuse_port,
        shared=connections,
    )


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


def _worker(config: Config, connections) -> None:
    """The body of one `serve --workers` process."""
    try:
        _run_worker(config, True, connections)
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

    def __init__(self, ctx, config: Config, connections) -> None:
        self._ctx, self._config = ctx, config
        self._connections = connections
        self._procs: list = [None] * config.workers
        self._started = [0.0] * config.workers
        self._delays = [0.0] * config.workers
        self._due: dict[int, float] = {}
        self._stopping = self._failed = False
        self._wake_r, self._wake_w = os.pipe()

    def stop(self, signum=None, frame=None) -> None:
        if not self._stopping:
            self._stopping = True
            os.write(self._wake_w, b"\0")  # wakes run() whatever it waits for (once: run closes the pipe)

    def reload(self, signum=None, frame=None) -> None:
        """SIGHUP: each worker reads the tenants file again itself."""
        for proc in self._procs:
            if proc is not None and proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGHUP)

    def run(self) -> None:
        """Returns once every worker has exited; raises OSError if one could not open the port."""
        from multiprocessing.connection import wait

        try:
            for slot in range(len(self._procs)):
                self._start(slot)
            # Held since the command line was read (cli.main): now each worker exists to pass it on to.
            release_hangups()
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
        proc = self._ctx.Process(target=_worker, args=(self._config, worker), daemon=False)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            proc.start()  # the worker holds SIGHUP until its own handler is in place (server.run)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
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


def refuse_a_taken_port(host: str, port: int) -> None:
    """Raise OSError (EADDRINUSE) if anything listens on host:port. Workers listen with
    SO_REUSEPORT, and the kernel lets any process of the same user that sets it too join a port:
    a second multi-worker proxy would silently take a share of this one's clients. A plain bind,
    without SO_REUSEPORT, fails on a port such listeners hold."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own bind
        probe.bind(address)


def serve(config: Config) -> None:
    """`serve`: one process, or `--workers` of them under a supervisor."""
    from epd_proxy.fleet.siblings import SIBLINGS_ENV

    workers = config.workers
    if workers <= 1:
        os.environ.pop(SIBLINGS_ENV, None)  # a process that serves alone has no siblings
        _run_worker(config, reuse_port=False)  # its plain bind fails on a taken port itself
        return
    refuse_a_taken_port(config.host, config.port)
    import multiprocessing
    import shutil
    import tempfile

    from epd_proxy.http.limits import PortConnections
    from epd_proxy.ops.logs import configure_logging

    configure_logging(config.log_level, config.log_format, config.log_requests)
    # Each worker owns its own state (cursor, pools); the kernel spreads connections. Metrics are
    # shared through files (prometheus-client's multiprocess mode), so /metrics is one view.
    metrics_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="epd-proxy-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    # Each worker tells the others the media it sees encoded (fleet/siblings.py), through sockets
    # in a directory of this user's only.
    siblings_dir = tempfile.mkdtemp(prefix="epd-proxy-siblings-")
    os.environ[SIBLINGS_ENV] = siblings_dir
    ctx = multiprocessing.get_context("spawn")
    # --max-client-connections counts the port's connections, whichever worker the kernel picked.
    lock_fd, lock_path = tempfile.mkstemp(prefix="epd-proxy-connections-")
    os.close(lock_fd)
    supervisor = _Supervisor(ctx, config, PortConnections.create(ctx, workers, lock_path))
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    if config.tenants_file:
        signal.signal(signal.SIGHUP, supervisor.reload)
    try:
        supervisor.run()
    finally:
        for path in (lock_path, *PortConnections.life_paths(lock_path, workers)):
            os.unlink(path)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(siblings_dir, ignore_errors=True)
