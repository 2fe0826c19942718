"""How many client connections the port holds: the count against `--max-client-connections`
(this process's, or across `--workers` in shared memory), its counters and gauges for /metrics,
and the open-files limit raised so the count, not accept()'s EMFILE, is what refuses a client."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("epd_proxy.server")


class PortConnections:
    """The open client connections of a port that several worker processes serve (--workers).

    Each worker counts its own in a slot of an array in shared memory and admits a connection only
    while all the slots together are under the limit. A worker that dies cannot take its count
    back, so the parent does when it reaps it (`release`). The check holds an flock(2), which the
    kernel drops with a process that dies holding it: a multiprocessing lock taken by a killed
    worker would stay taken, and no worker could admit anyone again.

    Until the parent gets round to reaping, a dead worker's count would still fill the port: a
    supervisor that is slow to wake (a loaded host, or one stopped) refused clients the survivors
    had room for. So each worker also holds an flock on a file of its own slot for as long as it
    lives (`claim`); the kernel drops it in the same exit that closes the worker's connections,
    and a check that finds the port full counts only the slots whose lock is still held."""

    def __init__(self, slots: Any, lock_path: str, slot: int = -1) -> None:
        self._slots = slots
        self._lock_path = lock_path
        self._slot = slot
        self._lock_fd: int | None = None
        self._life_fds: dict[int, int] = {}

    @classmethod
    def create(cls, ctx: Any, workers: int, lock_path: str) -> PortConnections:
        """The parent's view, over a new array of `workers` slots; `ctx` is a multiprocessing context."""
        for path in cls.life_paths(lock_path, workers):
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        return cls(ctx.RawArray("q", workers), lock_path)

    @staticmethod
    def life_paths(lock_path: str, workers: int) -> list[str]:
        """The files whose flock says that a slot's worker is alive, one per slot."""
        return [f"{lock_path}.{slot}" for slot in range(workers)]

    def _life_fd(self, slot: int) -> int:
        fd = self._life_fds.get(slot)
        if fd is None:
            fd = self._life_fds[slot] = os.open(f"{self._lock_path}.{slot}", os.O_RDWR | os.O_CLOEXEC)
        return fd

    def claim(self) -> None:
        """In the worker, before it accepts anyone: hold this slot's life lock until the process
        ends. The slot's previous worker is dead, so what its count still says is stale."""
        fcntl.flock(self._life_fd(self._slot), fcntl.LOCK_EX)
        with self._locked():
            self._slots[self._slot] = 0

    def _alive(self, slot: int) -> bool:
        fd = self._life_fd(slot)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _living_total(self) -> int:
        return sum(
            count for slot, count in enumerate(self._slots) if count and (slot == self._slot or self._alive(slot))
        )

    def worker(self, slot: int) -> PortConnections:
        """The view worker `slot` counts through, handed to its process when it starts."""
        return PortConnections(self._slots, self._lock_path, slot)

    def release(self, slot: int) -> None:
        """Stop counting the connections of worker `slot`, which has exited."""
        self._slots[slot] = 0

    @property
    def total(self) -> int:
        return self._living_total()

    @contextlib.contextmanager
    def _locked(self):
        if self._lock_fd is None:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def enter(self, limit: int) -> bool:
        with self._locked():
            # The life locks are read only when the port looks full: that is when a dead worker's
            # count can refuse someone.
            if limit and sum(self._slots) >= limit and self._living_total() >= limit:
                return False
            self._slots[self._slot] += 1
            return True

    def leave(self) -> None:
        # Only this worker writes its slot while it lives; a check that reads the old value a
        # moment longer only refuses a connection it could have taken.
        self._slots[self._slot] -= 1


class GateCounters:
    """What the gate counts. Prometheus counters, so that with --workers they live in the shared
    files (see metrics.py): /metrics adds every worker's up, a dead one's included."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.refused = Counter(
            "epd_client_connections_refused",
            "Client connections closed at accept by --max-client-connections",
            registry=registry,
        )
        timeouts = Counter(
            "epd_client_timeouts", "Client connections closed by a client-side timeout", ["kind"], registry=registry
        )
        self.timeouts = {kind: timeouts.labels(kind) for kind in ("header", "body", "keepalive")}


class ConnectionGate:
    """Open client connections against a limit: this process's, or with --workers the port's
    (`PortConnections`), so the limit holds for the port whichever worker the kernel picked."""

    def __init__(self, limit: int, shared: PortConnections | None = None, counters: GateCounters | None = None) -> None:
        self.limit = limit
        self._shared = shared
        self._local = 0
        self.counters = counters or GateCounters(None)

    @property
    def open(self) -> int:
        return self._shared.total if self._shared is not None else self._local

    def enter(self) -> bool:
        if self._shared is not None:
            admitted = self._shared.enter(self.limit)
        elif admitted := not self.limit or self._local < self.limit:
            self._local += 1
        if not admitted:
            self.counters.refused.inc()
        return admitted

    def leave(self) -> None:
        if self._shared is not None:
            self._shared.leave()
        else:
            self._local -= 1

    def timed_out(self, kind: str) -> None:
        self.counters.timeouts[kind].inc()


class GateCollector:
    """The open connections and their limit for /metrics, read at scrape time; the same whichever
    worker is asked."""

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate

    def collect(self):
        gate = self._gate
        yield GaugeMetricFamily(
            "epd_client_connections", "Open client connections (all workers of this port)", value=gate.open
        )
        yield GaugeMetricFamily(
            "epd_client_connections_limit", "--max-client-connections (0 = unlimited)", value=gate.limit
        )


def raise_fd_limit(needed: int) -> None:
    """Lift the soft open-files limit toward the hard one, so the connection limit is reached
    before accept() starts failing with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("open-files limit %d is below --max-client-connections plus backend sockets (%d)", target, needed)
