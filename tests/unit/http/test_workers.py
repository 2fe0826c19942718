"""The `serve --workers` supervisor's restart policy."""

from __future__ import annotations

from epd_proxy.http import workers


def test_a_worker_that_keeps_dying_young_waits_longer_each_time():
    delays, delay = [], 0.0
    for _ in range(9):
        delay = workers.restart_delay(delay, ran_s=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    # One that ran for a good while is replaced at once, and the doubling starts over.
    assert workers.restart_delay(30.0, ran_s=workers.STABLE_RUN_S) == 0.0
    assert workers.restart_delay(0.0, ran_s=1.0) == 0.5
