"""The encoder scheduler's pure core (scheduler.py): speed estimates, placement by expected
finish, load-adaptive fan-out, cache affinity, and which queued groups share a sub-request."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.lanes import Lane
from epd_proxy.fleet.scheduler import AFFINITY_ENTRIES, ExpectedFinish, Key
from epd_proxy.fleet.speed import PRIOR_FIXED_RATIO


def fleet(n: int) -> list[Instance]:
    return [Instance(f"http://e{i}", "encode") for i in range(n)]


def serve(lane: Lane, sizes: list[int], per_item_s: float, *, fixed_ratio: float = PRIOR_FIXED_RATIO) -> None:
    """A serial encoder that takes fixed + per-item time, all sent at once at t=0."""
    done = 0.0
    for size in sizes:
        done += per_item_s * (fixed_ratio + size)
        lane.started(size)
        lane.finished(size, 0.0, done)


def spread(picks: list[Instance]) -> Counter:
    return Counter(p.url for p in picks)


# -- speed estimates ----------------------------------------------------------------------------


def test_idle_encoders_spread_a_request_for_latency():
    policy = ExpectedFinish()
    encoders = fleet(4)
    picks, hits = policy.place(encoders, [Key(f"u{i}") for i in range(8)], 0)
    assert sorted(spread(picks).values()) == [2, 2, 2, 2] and hits == 0


def test_idle_single_image_requests_rotate():
    policy = ExpectedFinish(affinity=False)
    encoders = fleet(3)
    firsts = [policy.place(encoders, [Key(f"u{i}")], 0)[0][0].url for i in range(3)]
    assert sorted(firsts) == ["http://e0", "http://e1", "http://e2"]


def test_queued_encoders_gather_a_request_on_fewer_encoders():
    encoders = fleet(4)
    for adaptive, most_encoders in ((True, 1), (False, 4)):
        policy = ExpectedFinish(adaptive=adaptive, affinity=False)
        for lane in (policy.lanes.of(e) for e in encoders):
            serve(lane, [4] * 10, 0.005)
            for _ in range(20):  # 20 sub-requests of 4 waiting on each
                lane.started(4)
        picks, _ = policy.place(encoders, [Key(f"u{i}") for i in range(4)], 0)
        assert len(spread(picks)) == most_encoders


def test_fan_out_narrows_step_by_step_as_load_grows():
    encoders = fleet(4)
    widths = []
    for outstanding in (0, 1, 3, 6, 12):
        policy = ExpectedFinish(affinity=False)
        for lane in (policy.lanes.of(e) for e in encoders):
            serve(lane, [4] * 10, 0.005)
            for _ in range(outstanding):
                lane.started(4)
        widths.append(len(spread(policy.place(encoders, [Key(f"u{i}") for i in range(8)], 0)[0])))
    assert widths == sorted(widths, reverse=True) and widths[0] == 4 and widths[-1] == 1


def test_a_slow_encoder_gets_less_and_a_busy_one_gets_nothing_new():
    encoders = fleet(4)
    policy = ExpectedFinish(affinity=False)
    lanes = [policy.lanes.of(e) for e in encoders]
    for lane, per_item in zip(lanes, (0.004, 0.004, 0.004, 0.012)):
        serve(lane, [4] * 10, per_item)
    total = Counter()
    for n in range(200):  # requests arrive; nothing finishes in between
        picks, _ = policy.place(encoders, [Key(f"r{n}-{i}") for i in range(4)], 0)
        for pick in picks:
            lane = policy.lanes.of(pick)
            lane.started(1)
            total[pick.url] += 1
    fast = [total[e.url] for e in encoders[:3]]
    assert total["http://e3"] < min(fast) / 2, total
    busy = fleet(2)
    policy = ExpectedFinish(affinity=False)
    for lane in (policy.lanes.of(e) for e in busy):
        serve(lane, [1] * 10, 0.004)
    for _ in range(30):
        policy.lanes.of(busy[0]).started(4)
    assert set(spread(policy.place(busy, [Key("x"), Key("y")], 0)[0])) == {"http://e1"}


def loaded_without_affinity(encoders):
    """A placement whose encoders have answered alike and each hold 30 sub-requests of 4 images."""
    policy = ExpectedFinish(affinity=False)
    for lane in (policy.lanes.of(e) for e in encoders):
        serve(lane, [2] * 10, 0.004)
        for _ in range(30):
            lane.started(4)
    return policy


def test_audio_and_video_cost_a_sub_request_wherever_they_go():
    @dataclass
    class Item:
        uuid: str
        is_image: bool
        cost: float = 1.0

    encoders = fleet(2)
    policy = loaded_without_affinity(encoders)
    # Under load the images gather; the video needs its own sub-request anyway, so it goes where
    # it finishes first: the other encoder.
    picks, _ = policy.place(encoders, [Item("a", True), Item("v", False), Item("b", True)], 0)
    assert picks[0] is picks[2] and picks[1] is not picks[0]


def test_under_load_the_cap_still_splits_a_gathered_request():
    encoders = fleet(2)
    policy = loaded_without_affinity(encoders)
    picks, _ = policy.place(encoders, [Key(f"u{i}") for i in range(4)], 2)
    # The third image would open a second sub-request either way: it goes where it finishes first.
    assert picks[0] is picks[1] and picks[2] is picks[3] and picks[2] is not picks[0]


def test_a_repeat_goes_back_where_it_was_seen():
    encoders = fleet(4)
    policy = ExpectedFinish()
    first, _ = policy.place(encoders, [Key(f"img{i}") for i in range(4)], 0)
    for _ in range(5):
        again, hits = policy.place(encoders, [Key(f"img{i}") for i in range(4)], 0)
        assert again == first and hits == 4


def test_a_repeat_whose_home_is_out_of_rotation_goes_elsewhere():
    encoders = fleet(3)
    policy = ExpectedFinish()
    (home,), _ = policy.place(encoders, [Key("img")], 0)
    rest = [e for e in encoders if e is not home]
    (moved,), hits = policy.place(rest, [Key("img")], 0)
    assert moved in rest and hits == 0
    (back,), hits = policy.place(encoders, [Key("img")], 0)
    assert back is moved and hits == 1, "it was seen last where it moved to"


def test_a_hot_image_cannot_overload_its_home():
    encoders = fleet(4)
    policy = ExpectedFinish()
    for lane in (policy.lanes.of(e) for e in encoders):
        serve(lane, [1] * 10, 0.004)
    homes = Counter()
    for _ in range(400):
        (pick,), _ = policy.place(encoders, [Key("hot")], 0)
        policy.lanes.of(pick).started(1)  # nothing finishes: the backlog only grows
        homes[pick.url] += 1
    assert len(homes) == 4
    load = [policy.lanes.of(e).work.load for e in encoders]
    assert max(load) <= 1.25 * sum(load) / 4 + 2, load


def test_affinity_off_places_repeats_like_new_images():
    encoders = fleet(2)
    policy = ExpectedFinish(affinity=False)
    picks = [policy.place(encoders, [Key("same")], 0) for _ in range(4)]
    assert {p[0][0].url for p in picks} == {"http://e0", "http://e1"} and all(p[1] == 0 for p in picks)


def test_the_affinity_memory_is_bounded():
    policy = ExpectedFinish()
    encoders = fleet(2)
    for i in range(0, AFFINITY_ENTRIES + 100, 50):
        policy.place(encoders, [Key(f"u{j}") for j in range(i, i + 50)], 0)
    assert len(policy._home) == AFFINITY_ENTRIES


def test_choose_serves_the_routing_interface():
    policy = ExpectedFinish()
    encoders = fleet(2)
    assert [e.url for e in policy.choose(encoders, ["a", "b"])] in (
        ["http://e0", "http://e1"],
        ["http://e1", "http://e0"],
    )
    assert policy.choose(encoders[:1], ["a", "b", "c"]) == [encoders[0]] * 3


@settings(max_examples=200, deadline=None)
@given(
    n_encoders=st.integers(1, 5),
    uuids=st.lists(st.sampled_from("ABCDEFGHIJ"), max_size=12),
    images=st.lists(st.booleans(), max_size=12),
    backlogs=st.lists(st.integers(0, 30), min_size=5, max_size=5),
    speeds=st.lists(st.floats(0.001, 0.02), min_size=5, max_size=5),
    cap=st.integers(0, 4),
    affinity=st.booleans(),
    adaptive=st.booleans(),
)
def test_placement_picks_one_live_encoder_per_item(
    n_encoders, uuids, images, backlogs, speeds, cap, affinity, adaptive
):
    encoders = fleet(n_encoders)
    policy = ExpectedFinish(affinity=affinity, adaptive=adaptive)
    for lane, backlog, speed in zip((policy.lanes.of(e) for e in encoders), backlogs, speeds):
        serve(lane, [2, 3], speed)
        for _ in range(backlog):
            lane.started(2)
    items = [Key(u, image) for u, image in zip(uuids, images + [True] * len(uuids))]
    for _ in range(2):  # the second round has homes to follow
        picks, hits = policy.place(encoders, items, cap)
        assert len(picks) == len(items) and all(p in encoders for p in picks)
        assert 0 <= hits <= len(items)
    assert all(policy.lanes.of(e).work.subs >= 0 for e in encoders)


# -- coalescing ---------------------------------------------------------------------------------
