"""The port's connection count (this process's and across workers) and the open-files limit."""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import threading
import time

from prometheus_client import CollectorRegistry

from epd_proxy.http.limits import ConnectionGate, GateCollector, GateCounters, PortConnections, raise_fd_limit


def refused(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("epd_client_connections_refused_total")


def test_the_gate_admits_up_to_its_limit_and_counts_refusals():
    registry = CollectorRegistry()
    gate = ConnectionGate(2, counters=GateCounters(registry))
    assert [gate.enter() for _ in range(3)] == [True, True, False]
    assert (gate.open, refused(registry)) == (2, 1)
    gate.leave()
    assert gate.enter() and gate.open == 2


def port_connections(tmp_path, workers: int) -> PortConnections:
    lock = tmp_path / "lock"
    lock.touch()
    return PortConnections.create(multiprocessing.get_context("spawn"), workers, str(lock))


def test_workers_share_the_limit_and_a_dead_workers_connections_are_released(tmp_path):
    port = port_connections(tmp_path, 2)
    registry = CollectorRegistry()
    views = [port.worker(0), port.worker(1)]
    for view in views:
        view.claim()
    first = ConnectionGate(3, views[0], GateCounters(registry))
    second = ConnectionGate(3, views[1])
    assert first.enter() and first.enter() and second.enter()
    # The port is full, whichever worker is asked.
    assert not first.enter() and not second.enter()
    assert first.open == second.open == port.total == 3 and refused(registry) == 1
    second.leave()
    assert first.enter()
    # The first worker died holding three: once the parent releases its slot they no longer count.
    port.release(0)
    assert second.open == 0
    assert [second.enter() for _ in range(4)] == [True, True, True, False]


@contextlib.contextmanager
def worker_killed_afterwards(target, *args):
    """A spawned process running `target(*args, holding)`, once it has set `holding`; killed with
    SIGKILL when the block ends."""
    ctx = multiprocessing.get_context("spawn")
    holding = ctx.Event()
    worker = ctx.Process(target=target, args=(*args, holding))
    worker.start()
    try:
        assert holding.wait(30), f"{target.__name__} did not get going"
        yield
    finally:
        worker.kill()
        worker.join(30)


def serve_until_killed(port: PortConnections, connections: int, holding) -> None:
    port.claim()
    gate = ConnectionGate(connections, port)
    assert all(gate.enter() for _ in range(connections))
    holding.set()
    time.sleep(600)


def test_a_killed_workers_connections_stop_counting_before_the_parent_reaps_it(tmp_path):
    port = port_connections(tmp_path, 2)
    survivor_view = port.worker(1)
    survivor_view.claim()
    survivor = ConnectionGate(3, survivor_view)
    with worker_killed_afterwards(serve_until_killed, port.worker(0), 3):
        assert not survivor.enter(), "a live worker's connections fill the port"
    # The parent has not released slot 0 (it may be slow to wake, or stopped): the dead worker's
    # three connections are closed all the same, so the port has room for three.
    assert [survivor.enter() for _ in range(4)] == [True, True, True, False]
    assert survivor.open == 3
    # Its replacement starts from nothing, whatever the slot still said.
    replacement = port.worker(0)
    replacement.claim()
    assert survivor.open == 3 and replacement.total == 3


def hold_the_lock_until_killed(port: PortConnections, holding) -> None:
    with port._locked():
        holding.set()
        time.sleep(600)


def test_a_worker_killed_during_the_check_does_not_lock_the_others_out(tmp_path):
    port = port_connections(tmp_path, 2)
    with worker_killed_afterwards(hold_the_lock_until_killed, port.worker(0)):
        pass
    survivor = port.worker(1)
    survivor.claim()
    gate = ConnectionGate(1, survivor)
    admitted = []
    # In a thread: a lock that stayed taken would block this test instead of failing it.
    checking = threading.Thread(target=lambda: admitted.append(gate.enter()), daemon=True)
    checking.start()
    checking.join(10)
    assert admitted == [True], "the check still waits for the dead worker's lock"


def test_an_unlimited_gate_still_counts():
    registry = CollectorRegistry()
    gate = ConnectionGate(0, counters=GateCounters(registry))
    assert all(gate.enter() for _ in range(5)) and gate.open == 5 and refused(registry) == 0


def test_the_collector_reads_the_open_count_and_the_limit_at_scrape_time():
    gate = ConnectionGate(7)
    collector = GateCollector(gate)
    gate.enter()
    gate.enter()
    values = {family.name: family.samples[0].value for family in collector.collect()}
    assert values == {"epd_client_connections": 2, "epd_client_connections_limit": 7}


def test_the_open_files_limit_rises_toward_what_is_needed_and_never_past_the_hard_one(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    raise_fd_limit(2048)
    raise_fd_limit(100_000)
    raise_fd_limit(512)  # already enough: untouched
    assert calls == [(2048, 4096), (4096, 4096)]
