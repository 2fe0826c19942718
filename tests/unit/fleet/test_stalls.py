"""When an encoder's silence means it stalls (stalls.py): lagging behind the fleet, and what
counts against its health."""

from __future__ import annotations

from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.stalls import LAG_FLOOR_S, laggards, progressed_elsewhere
from tests.unit.fleet.test_scheduler import fleet


def warmed(n: int):
    """`n` lanes that each answered one image in 50 ms at t=0."""
    lanes = Lanes()
    encoders = fleet(n)
    for lane in map(lanes.of, encoders):
        lane.started(1.0, 0.0)
        lane.finished(1.0, 0.0, 0.05)
    return lanes, [lanes.of(e) for e in encoders]


def test_a_silent_encoder_lags_once_another_answers_later_work():
    lanes, (stuck, other) = warmed(2)
    stuck.started(1.0, 1.0)
    other.started(1.0, 1.5)
    assert not laggards(lanes, [stuck, other], 1.0 + LAG_FLOOR_S), "both busy, neither answered: a slow fleet"
    assert not progressed_elsewhere([stuck, other], stuck)
    other.finished(1.0, 1.5, 1.55)  # sent after the stuck one, answered
    assert progressed_elsewhere([stuck, other], stuck)
    assert not laggards(lanes, [stuck, other], 1.0 + LAG_FLOOR_S - 0.01), "not within the floor"
    assert laggards(lanes, [stuck, other], 1.0 + LAG_FLOOR_S) == [stuck]
    stuck.stalled(2.0)
    assert not laggards(lanes, [stuck, other], 2.5), "already suspect"


def test_an_idle_trusted_encoder_is_enough_to_find_a_staller_that_attracts_all_work():
    lanes, (stuck, idle) = warmed(2)
    for _ in range(10):
        stuck.started(1.0, 1.0)
    assert laggards(lanes, [stuck, idle], 1.0 + LAG_FLOOR_S) == [stuck]
    # Not one that never answered: it might be no better.
    cold = Lanes()
    stuck2, new = cold.of(fleet(2)[0]), cold.of(fleet(2)[1])
    stuck2.started(1.0, 0.0)
    stuck2.finished(1.0, 0.0, 0.05)
    stuck2.started(1.0, 1.0)
    assert not laggards(cold, [stuck2, new], 1.0 + LAG_FLOOR_S)


def test_an_encoder_busy_with_a_heavy_item_is_given_its_expected_time():
    lanes, (busy, idle) = warmed(2)
    busy.started(64.0, 1.0)  # a long video: about 64 images' time
    expected = busy.speed.fixed_s + busy.speed.item_s * 64.0
    assert not laggards(lanes, [busy, idle], 1.0 + 2.9 * expected)
    assert laggards(lanes, [busy, idle], 1.0 + 3.1 * expected) == [busy]


def test_an_encoder_that_answers_again_is_no_laggard():
    lanes, (lane, other) = warmed(2)
    lane.started(1.0, 1.0)
    lane.started(1.0, 1.0)
    lane.finished(1.0, 1.0, 1.9)  # one answer: its silence starts again from there
    assert not laggards(lanes, [lane, other], 1.0 + LAG_FLOOR_S)
    # Slower now by its own answer's measure: its silence is judged against that.
    silence = max(LAG_FLOOR_S, 3 * (lane.speed.fixed_s + lane.speed.item_s))
    assert not laggards(lanes, [lane, other], 1.9 + silence - 0.01)
    assert laggards(lanes, [lane, other], 1.9 + silence + 0.01) == [lane]
