"""An encoder's speed estimate (fleet/speed.py), fed as a lane feeds it."""

from __future__ import annotations

import pytest

from epd_proxy.fleet.lanes import Lane
from epd_proxy.fleet.speed import PRIOR_FIXED_RATIO, STALE_S, Speed
from tests.unit.fleet.test_scheduler import serve


def test_a_serial_encoder_is_measured_by_the_time_between_its_answers():
    lane = Lane("http://e0")
    serve(lane, [1, 4, 2, 8, 3] * 10, per_item_s=0.010)
    assert lane.speed.item_s == pytest.approx(0.010, rel=1e-6)
    assert lane.speed.fixed_s == pytest.approx(PRIOR_FIXED_RATIO * 0.010, rel=1e-6)
    assert (lane.work.inflight, lane.work.subs, lane.work.load) == (0, 0, 0)


def test_a_three_times_slower_encoder_is_estimated_three_times_slower():
    fast, slow = Lane("f"), Lane("s")
    serve(fast, [3, 5, 1, 4] * 20, per_item_s=0.004)
    serve(slow, [3, 5, 1, 4] * 20, per_item_s=0.012)
    assert slow.speed.item_s / fast.speed.item_s == pytest.approx(3.0, rel=1e-6)


def test_an_answer_after_an_idle_gap_counts_from_when_it_was_sent():
    lane = Lane("e")
    lane.started(2)
    lane.finished(2, 0.0, 1.0)
    lane.started(2)
    lane.finished(2, 5.0, 5.5)  # sent long after the first answer: it held the encoder 0.5 s
    assert lane.speed.item_s == pytest.approx((1.0 + 0.5) / 2 / (2 + PRIOR_FIXED_RATIO))


def test_a_failed_sub_request_teaches_nothing_but_is_counted_out():
    lane = Lane("e")
    lane.started(3)
    lane.finished(3, 0.0, None)
    assert (lane.speed.item_s, lane.speed.samples, lane.work.inflight, lane.work.subs, lane.work.load) == (
        None,
        0,
        0,
        0,
        0,
    )


def test_an_estimate_goes_stale_unheard_from_and_a_restart_forgets_its_samples():
    speed = Speed()
    assert not speed.measured and not speed.stale(100.0)
    speed.observe(1, 0.0, 0.5)
    assert speed.measured and speed.item_s == pytest.approx(0.5 / (1 + PRIOR_FIXED_RATIO))
    assert not speed.stale(0.5 + STALE_S) and speed.stale(0.5 + STALE_S + 0.01)
    speed.restart()
    assert speed.samples == 0 and speed.measured  # the old figure stands until the next answer
    speed.observe(1, 10.0, 10.1)
    assert speed.item_s == pytest.approx(0.1 / (1 + PRIOR_FIXED_RATIO))
