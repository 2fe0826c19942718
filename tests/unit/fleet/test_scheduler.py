"""The encoder scheduler's pure core (scheduler.py): speed estimates, placement by expected
finish, load-adaptive fan-out, cache affinity, and which queued groups share a sub-request."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.scheduler import (
    AFFINITY_ENTRIES,
    PRIOR_FIXED_RATIO,
    STALE_S,
    ExpectedFinish,
    Key,
    Lane,
    Lanes,
    coalesce_key,
    take_batch,
)
from epd_proxy.journey.encode import FORWARDED_FIELDS


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


def test_a_serial_encoder_is_measured_by_the_time_between_its_answers():
    lane = Lane("http://e0")
    serve(lane, [1, 4, 2, 8, 3] * 10, per_item_s=0.010)
    assert lane.item_s == pytest.approx(0.010, rel=1e-6)
    assert lane.fixed_s == pytest.approx(PRIOR_FIXED_RATIO * 0.010, rel=1e-6)
    assert (lane.inflight, lane.subs, lane.items) == (0, 0, 0)


def test_a_three_times_slower_encoder_is_estimated_three_times_slower():
    fast, slow = Lane("f"), Lane("s")
    serve(fast, [3, 5, 1, 4] * 20, per_item_s=0.004)
    serve(slow, [3, 5, 1, 4] * 20, per_item_s=0.012)
    assert slow.item_s / fast.item_s == pytest.approx(3.0, rel=1e-6)


def test_an_answer_after_an_idle_gap_counts_from_when_it_was_sent():
    lane = Lane("e")
    lane.started(2)
    lane.finished(2, 0.0, 1.0)
    lane.started(2)
    lane.finished(2, 5.0, 5.5)  # sent long after the first answer: it held the encoder 0.5 s
    assert lane.item_s == pytest.approx((1.0 + 0.5) / 2 / (2 + PRIOR_FIXED_RATIO))


def test_a_failed_sub_request_teaches_nothing_but_is_counted_out():
    lane = Lane("e")
    lane.started(3)
    lane.finished(3, 0.0, None)
    assert (lane.item_s, lane.samples, lane.inflight, lane.subs, lane.items) == (None, 0, 0, 0, 0)


def test_an_encoder_slow_once_and_left_idle_gets_work_again_and_is_measured_afresh():
    encoders = fleet(2)
    policy = ExpectedFinish(affinity=False)
    fast, slow = (policy.lanes.of(e) for e in encoders)
    serve(fast, [1] * 20, 0.001)
    serve(slow, [1] * 3, 0.300)  # a slow spell: a cold start, a pause
    # Idle, one image at a time: while the slow spell is recent, it all goes to the fast one.
    now = fast.last_done
    assert {policy.place(encoders, [Key(f"a{i}")], 0, now)[0][0] for i in range(4)} == {encoders[0]}
    # Unheard from for STALE_S, the slow one is taken at the others' speed and shares the work...
    later = slow.last_done + STALE_S + 1.0
    fast.last_done = later - 0.5
    picks = {policy.place(encoders, [Key(f"b{i}")], 0, later)[0][0] for i in range(4)}
    assert picks == set(encoders)
    # ...and its next answer starts a new estimate instead of averaging with the old spell.
    slow.started(1, later)
    slow.finished(1, later, later + 0.001)
    assert slow.samples == 1 and slow.item_s == pytest.approx(0.001 / (1 + PRIOR_FIXED_RATIO))


def test_a_call_finishing_on_an_encoder_that_left_does_not_bring_its_lane_back():
    lanes = Lanes()
    gone, staying = fleet(2)
    lane = lanes.of(gone)
    lane.started(2)
    lanes.left(gone)
    lanes.of(gone).finished(2, 0.0, 0.1)
    lanes.of(staying)
    assert [kept.url for kept in lanes.all()] == [staying.url]


def test_unknown_encoders_are_taken_as_fast_as_the_known_mean():
    lanes = Lanes()
    a, b, c = (lanes.of(e) for e in fleet(3))
    serve(a, [2] * 5, 0.002)
    serve(b, [2] * 5, 0.004)
    fixed, item = lanes.costs([a, b, c])
    assert item[2] == pytest.approx((item[0] + item[1]) / 2) and fixed[2] == pytest.approx((fixed[0] + fixed[1]) / 2)
    assert lanes.costs([lanes.of(e) for e in fleet(2)]) == ([PRIOR_FIXED_RATIO] * 2, [1.0] * 2)


def test_a_lane_goes_with_its_encoder():
    lanes = Lanes()
    encoder = fleet(1)[0]
    lane = lanes.of(encoder)
    assert lanes.of(encoder) is lane
    lanes.left(encoder)
    assert lanes.of(encoder) is not lane


# -- placement ----------------------------------------------------------------------------------


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
    load = [policy.lanes.of(e).items for e in encoders]
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
    assert all(policy.lanes.of(e).subs >= 0 for e in encoders)


# -- coalescing ---------------------------------------------------------------------------------


@dataclass(eq=False)
class W:
    key: bytes | None
    size: int
    name: str = ""


@settings(max_examples=300, deadline=None)
@given(
    works=st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), st.integers(1, 5)), min_size=1, max_size=15),
    limit=st.integers(0, 12),
)
def test_a_batch_is_the_oldest_group_and_later_ones_of_its_key_within_the_limit(works, limit):
    queue = deque(W(key, size, str(i)) for i, (key, size) in enumerate(works))
    before = list(queue)
    batch = take_batch(queue, limit)
    assert batch[0] is before[0]
    assert all(w.key == batch[0].key for w in batch)
    assert len(batch) == 1 or sum(w.size for w in batch) <= limit
    # Nothing lost or duplicated, and what stays keeps its order.
    assert sorted(map(id, batch + list(queue))) == sorted(map(id, before))
    assert list(queue) == [w for w in before if w not in batch]
    # Groups in the batch are in arrival order, and none that fitted was passed over for a later one.
    assert [before.index(w) for w in batch] == sorted(before.index(w) for w in batch)


def test_a_group_never_shares_past_the_limit_and_an_unshareable_one_goes_alone():
    queue = deque([W(b"k", 3), W(b"k", 3), W(b"k", 2), W(b"k", 1)])
    assert [w.size for w in take_batch(queue, 6)] == [3, 3]
    assert [w.size for w in take_batch(queue, 6)] == [2, 1]
    queue = deque([W(None, 1), W(None, 1)])
    assert len(take_batch(queue, 8)) == 1


def test_lane_batches_count_one_sub_request_and_halve_after_a_refusal():
    lane = Lane("e")
    for size in (2, 2, 2, 2, 2):
        lane.queued(W(b"k", size))
    assert (lane.subs, lane.items) == (5, 10)
    batch = lane.next_batch(0)
    assert len(batch) == 4 and (lane.subs, lane.items, lane.inflight) == (2, 10, 1)
    lane.finished(8, 0.0, 1.0)
    assert (lane.subs, lane.items, lane.inflight) == (1, 2, 0)
    lane.refused_shared()
    assert lane.merge_limit == 4
    lane.shared_ok(4)
    assert lane.merge_limit == 5
    assert len(lane.next_batch(1)) == 1, "the batch cap wins"
    lane.positions = False
    lane.queued(W(b"k", 1))
    lane.queued(W(b"k", 1))
    assert len(lane.next_batch(0)) == 1, "no sharing with an encoder that reports no positions"


def test_patience_grows_with_the_backlog_ahead():
    lane = Lane("e")
    short = lane.patience(1)
    serve(lane, [2] * 10, 0.01)
    idle = lane.patience(1)
    for _ in range(10):
        lane.started(4)
    assert short > 0 and lane.patience(1) > idle


BASE = {"model": "m", "messages": [], "max_tokens": 3}


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"mm_processor_kwargs": {"size": {"shortest_edge": 8}}},
        {"media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}}},
        {"priority": 1},
        {"session_id": "s2"},
        {"priority": None},
    ],
)
def test_requests_differing_in_anything_the_encoder_sees_never_share(change):
    assert coalesce_key({**BASE, **change}, FORWARDED_FIELDS, None) != coalesce_key(BASE, FORWARDED_FIELDS, None)


def test_the_consumer_address_and_key_order_are_part_of_the_key():
    assert coalesce_key(BASE, FORWARDED_FIELDS, "tcp://c:0") != coalesce_key(BASE, FORWARDED_FIELDS, "tcp://c:1")
    one = {**BASE, "mm_processor_kwargs": {"a": 1, "b": 2}}
    other = {**BASE, "mm_processor_kwargs": {"b": 2, "a": 1}}
    assert coalesce_key(one, FORWARDED_FIELDS, None) != coalesce_key(other, FORWARDED_FIELDS, None)


def test_what_the_encoder_never_sees_does_not_split_requests():
    other = {
        **BASE,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 99,
        "temperature": 0.3,
        "stream": True,
        "cache_salt": "x",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert coalesce_key(other, FORWARDED_FIELDS, None) == coalesce_key(BASE, FORWARDED_FIELDS, None)


def test_an_unwritable_body_is_not_shared():
    deep: dict = {}
    for _ in range(300):
        deep = {"x": deep}
    assert coalesce_key({**BASE, "mm_processor_kwargs": deep}, FORWARDED_FIELDS, None) is None


def test_work_an_encoder_has_done_on_its_oldest_sub_request_counts_as_done():
    encoders = fleet(2)
    policy = ExpectedFinish(affinity=False)
    a, b = (policy.lanes.of(e) for e in encoders)
    for lane in (a, b):
        serve(lane, [4] * 10, 0.010)
    # The same queue on both, but a's oldest sub-request has been running for 40 ms.
    a.started(4, now=10.0)
    b.started(4, now=10.04)
    (pick,), _ = policy.place(encoders, [Key("x")], 0, now=10.04)
    assert pick is encoders[0]
    # Without a clock both look alike, and the rotation decides.
    assert {policy.place(encoders, [Key(f"y{i}")], 0)[0][0].url for i in range(2)} == {"http://e0", "http://e1"}


VALUES = st.one_of(
    st.none(),
    st.integers(-2, 2),
    st.sampled_from(["a", "b"]),
    st.dictionaries(st.sampled_from(["x", "y"]), st.integers(0, 1), max_size=2),
)
BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "n"]), "messages": st.just([])},
    optional={
        **{name: VALUES for name in FORWARDED_FIELDS},
        "max_tokens": st.integers(1, 3),
        "temperature": st.floats(0, 1),
        "cache_salt": st.sampled_from(["s", "t"]),
    },
)


@settings(max_examples=500, deadline=None)
@given(
    one=BODIES, other=BODIES, zmq=st.lists(st.sampled_from([None, "tcp://c:0", "tcp://c:1"]), min_size=2, max_size=2)
)
def test_two_groups_share_exactly_when_their_encoder_bodies_match_but_for_the_media(one, other, zmq):
    from epd_proxy.journey.encode import encoder_body

    def written(body, consumer):
        return orjson.dumps(encoder_body(body, [], send_uuid=True, transfer_ids=(), consumer_zmq=consumer))

    same_key = coalesce_key(one, FORWARDED_FIELDS, zmq[0]) == coalesce_key(other, FORWARDED_FIELDS, zmq[1])
    assert same_key == (written(one, zmq[0]) == written(other, zmq[1]))
