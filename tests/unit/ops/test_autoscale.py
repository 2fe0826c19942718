"""The autoscaling figures (ops/autoscale.py) on a driven clock: Little's law over busy time, the
backlog's growth counted as arriving work, and the recommendation's rounding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.journey.reuse import swamped
from epd_proxy.ops.autoscale import ENCODER_BACKLOG, Autoscale, recommended, rows


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(items=0, prefill_s=None, ttfb_s=0.0, relay_s=0.0):
    return SimpleNamespace(
        items=items,
        encoder_requests=1 if items else 0,
        prefill_url="http://p:1" if prefill_s is not None else None,
        prefill_s=prefill_s or 0.0,
        decode_url="http://d:1",
        decode_ttfb_s=ttfb_s,
        relay_s=relay_s,
    )


def test_offered_load_is_busy_seconds_arriving_per_second():
    clock = Clock()
    autoscale = Autoscale(Lanes(), window_s=10, clock=clock)
    autoscale.sample()
    for _ in range(20):  # 20 requests in 10 s, each holding decode 1.5 s and prefill 0.25 s
        autoscale.finished(request(items=2, prefill_s=0.25, ttfb_s=0.5, relay_s=1.0))
    clock.now += 10
    figures = autoscale.figures()
    assert figures["decode"].arrival_rate == pytest.approx(2.0) and figures["decode"].offered_load == pytest.approx(3.0)
    assert figures["prefill"].offered_load == pytest.approx(0.5)
    assert figures["encode"].arrival_rate == pytest.approx(4.0)  # items per second


def test_the_window_forgets_what_is_older_than_it():
    clock = Clock()
    autoscale = Autoscale(Lanes(), window_s=10, clock=clock)
    autoscale.sample()
    for _ in range(10):
        autoscale.finished(request(ttfb_s=1.0))
    for _ in range(3):
        clock.now += 10
        autoscale.sample()
    assert autoscale.figures()["decode"].offered_load == 0.0


def test_encoder_busy_time_and_backlog_growth_come_from_the_lanes():
    clock = Clock()
    lanes = Lanes()
    encoder = Instance("http://e:1", "encode")
    lane = lanes.of(encoder)
    autoscale = Autoscale(lanes, window_s=10, clock=clock)
    autoscale.sample()
    # Five sub-requests of 4 items, each held 0.4 s: 2 s of encoder time in 10 s.
    for n in range(5):
        lane.started(4, clock.now + n)
        lane.finished(4, clock.now + n, clock.now + n + 0.4)
    # And a sub-request of 30 items sent at the end, not yet worked off: work that arrived, not yet done.
    clock.now += 10
    lane.started(30, clock.now)
    figures = autoscale.figures()["encode"]
    backlog = figures.backlog_s
    assert backlog == pytest.approx(lane.speed.fixed_s + lane.speed.item_s * 30) and backlog > 0
    assert figures.offered_load == pytest.approx((2.0 + backlog) / 10)
    # An encoder that leaves keeps its busy time in the total, which only grows.
    lanes.left(encoder)
    assert lanes.worked_s() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("load", "capacity", "utilisation", "members", "want"),
    [
        (0.0, 1, 0.7, 0, 0),  # no members, nothing to do
        (0.0, 1, 0.7, 2, 1),  # idle, but a role in use keeps one
        (0.7, 1, 0.7, 1, 1),  # exactly at the target: not one more
        (0.71, 1, 0.7, 1, 2),
        (10.0, 16, 0.5, 1, 2),  # batching replicas: 16 at once each
    ],
)
def test_recommended_rounds_up_to_whole_replicas(load, capacity, utilisation, members, want):
    assert recommended(load, capacity, utilisation, members) == want


def test_scrapes_cost_no_memory_that_grows_with_their_rate():
    clock = Clock()
    autoscale = Autoscale(Lanes(), window_s=60, clock=clock)
    autoscale.sample()
    for _ in range(20):
        autoscale.finished(request(ttfb_s=3.0))
    for _ in range(3000):  # 3,000 scrapes in 3 s
        clock.now += 0.001
        autoscale.figures()
    assert autoscale.kept() <= autoscale.max_kept
    for _ in range(3000):  # and ten minutes of a scrape every 0.2 s
        clock.now += 0.2
        autoscale.figures()
    assert autoscale.kept() <= autoscale.max_kept
    assert autoscale.max_kept < 1000


def test_frequent_scrapes_keep_the_window_and_the_timeline_what_they_mean():
    clock = Clock()
    autoscale = Autoscale(Lanes(), window_s=10, clock=clock)
    autoscale.sample()
    for _ in range(20):  # 20 requests holding decode 1.5 s each, then scrapes every 10 ms for 10 s
        autoscale.finished(request(ttfb_s=1.5))
    for _ in range(1000):
        clock.now += 0.01
        autoscale.figures()
    figures = autoscale.figures()["decode"]
    assert figures.offered_load == pytest.approx(3.0) and figures.arrival_rate == pytest.approx(2.0)
    # Once they are a window old, the window forgets them, however many scrapes came between.
    for _ in range(1100):
        clock.now += 0.01
        autoscale.figures()
    assert autoscale.figures()["decode"].offered_load == 0.0
    # The status page's timeline still reaches back its whole span, not the last few scrapes.
    timeline = autoscale.backlog_timeline(span_s=300.0)
    assert timeline[0]["ago_s"] >= 20.0 and len(timeline) <= 25


def test_the_backlog_gauge_is_what_the_consumers_last_resort_decides_on():
    """`epd_encoder_backlog_seconds` and `--consumer-encode-after` read one quantity: what an
    encoder worked off counts as done, and one that never answered is behind by its silence."""
    clock = Clock()
    lanes = Lanes()
    measured, working, hung = (Instance(f"http://e{n}:1", "encode") for n in range(3))
    for encoder in (measured, working):
        lane = lanes.of(encoder)
        lane.started(4, clock.now)
        lane.finished(4, clock.now, clock.now + 0.4)
        lane.started(30, clock.now + 1.0)
    lanes.of(hung).started(1, clock.now + 1.0)
    autoscale = Autoscale(lanes, clock=clock)
    clock.now += 3.0  # two seconds into the 30-item sub-requests and the hung one's silence
    gauge = {labels[0]: value for name, labels, value in rows(autoscale) if name == ENCODER_BACKLOG[0]}
    lane = lanes.of(measured)
    assert gauge[measured.url] == pytest.approx(lane.speed.fixed_s + lane.speed.item_s * 30 - 2.0)
    assert gauge[hung.url] == pytest.approx(2.0)
    for encoder in (measured, working, hung):
        seconds = gauge[encoder.url]
        assert swamped(lanes, [encoder], seconds - 0.01, clock.now)
        assert not swamped(lanes, [encoder], seconds + 0.01, clock.now)
