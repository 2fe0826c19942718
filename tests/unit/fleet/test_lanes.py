"""The encoder scheduler's pure core (scheduler.py): speed estimates, placement by expected
finish, load-adaptive fan-out, cache affinity, and which queued groups share a sub-request."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.fleet.fairness import Ledger
from epd_proxy.fleet.lanes import SUSPECT_HOLD_S, Lane, Lanes
from epd_proxy.fleet.scheduler import ExpectedFinish, Key
from epd_proxy.fleet.speed import PRIOR_FIXED_RATIO, STALE_S
from epd_proxy.fleet.stalls import OVERDUE_FACTOR, OVERDUE_FLOOR_S, overdue_after
from epd_proxy.journey.subrequest import FORWARDED_FIELDS, coalesce_key
from tests.unit.fleet.test_scheduler import fleet, serve


def test_an_encoder_slow_once_and_left_idle_gets_work_again_and_is_measured_afresh():
    encoders = fleet(2)
    policy = ExpectedFinish(affinity=False)
    fast, slow = (policy.lanes.of(e) for e in encoders)
    serve(fast, [1] * 20, 0.001)
    serve(slow, [1] * 3, 0.300)  # a slow spell: a cold start, a pause
    # Idle, one image at a time: while the slow spell is recent, it all goes to the fast one.
    now = fast.speed.last_done
    assert {policy.place(encoders, [Key(f"a{i}")], 0, now)[0][0] for i in range(4)} == {encoders[0]}
    # Unheard from for STALE_S, the slow one is taken at the others' speed and shares the work...
    later = slow.speed.last_done + STALE_S + 1.0
    fast.speed.last_done = later - 0.5
    picks = {policy.place(encoders, [Key(f"b{i}")], 0, later)[0][0] for i in range(4)}
    assert picks == set(encoders)
    # ...and its next answer starts a new estimate instead of averaging with the old spell.
    slow.started(1, later)
    slow.finished(1, later, later + 0.001)
    assert slow.speed.samples == 1 and slow.speed.item_s == pytest.approx(0.001 / (1 + PRIOR_FIXED_RATIO))


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


@dataclass(eq=False)
class W:
    key: bytes | None
    size: int
    name: str = ""
    priority: int = 0
    moved: bool = False
    tenant: str | None = None
    riders: tuple[str, ...] = ()

    @property
    def tenants(self) -> tuple[str | None, ...]:
        return (self.tenant, *self.riders)

    @property
    def owed(self) -> dict[str, float]:
        return dict.fromkeys(self.riders, float(self.size))

    @property
    def cost(self) -> float:
        return float(self.size)

    def move(self) -> None:
        self.moved = True


def test_lane_batches_count_one_sub_request_and_the_cap_wins():
    lane = Lane("e")
    for size in (2, 2, 2, 2, 2):
        lane.queued(W(b"k", size))
    assert (lane.work.subs, lane.work.load) == (5, 10)
    batch = lane.next_batch(0)
    assert len(batch) == 4 and (lane.work.subs, lane.work.load, lane.work.inflight, lane.work.inflight_load) == (
        2,
        10,
        1,
        8,
    )
    lane.finished(8, 0.0, 1.0)
    assert (lane.work.subs, lane.work.load, lane.work.inflight, lane.work.inflight_load) == (1, 2, 0, 0)
    assert len(lane.next_batch(1)) == 1, "the batch cap wins"


def test_queued_groups_leave_by_priority_then_arrival_as_in_vllm():
    lane = Lane("e")
    for name, priority in (("a", 10), ("b", 10), ("c", 0), ("d", 10), ("e", -5), ("f", 0)):
        lane.queued(W(name.encode(), 1, name, priority))
    order = []
    while lane.work.waiting:
        (work,) = lane.next_batch(0)
        order.append(work.name)
    assert order == ["e", "c", "f", "a", "b", "d"]


def test_an_encoder_that_goes_hands_every_waiting_group_on():
    lanes, (encoder,) = Lanes(), fleet(1)
    lane = lanes.of(encoder)
    works = [W(b"k", 2) for _ in range(3)]
    for work in works:
        lane.queued(work)
    lanes.ejected(encoder.url)
    assert all(work.moved for work in works) and not lane.work.waiting and (lane.work.subs, lane.work.load) == (0, 0)
    lane.queued(W(b"k", 1))
    lanes.left(encoder)
    assert lane.gone and not lane.work.waiting


def test_a_sub_request_far_past_its_expected_time_is_overdue_but_never_during_a_cold_start():
    lane = Lane("e")
    lane.started(1, 0.0)
    assert overdue_after(lane, 1, 300.0) is None, "nothing known of its speed yet"
    lane.finished(1, 0.0, 0.010)
    lane.started(4, 1.0)
    lane.started(4, 1.0)
    expected = lane.speed.fixed_s * 2 + lane.speed.item_s * 8
    assert overdue_after(lane, 4, 300.0) == max(OVERDUE_FLOOR_S, OVERDUE_FACTOR * expected) == OVERDUE_FLOOR_S
    assert overdue_after(lane, 4, 1.0) == 0.75, "always before the encode timeout"
    due = 1.0 + OVERDUE_FLOOR_S
    assert lane.stalled(due) and not lane.stalled(due + 0.5), "suspect once"
    assert lane.avoid(due + 0.5 + SUSPECT_HOLD_S - 0.01) and not lane.avoid(due + 0.5 + SUSPECT_HOLD_S)
    lane.finished(4, 1.0, due + 1.0)
    assert not lane.suspicion.suspect, "it answered"


def test_patience_grows_with_the_backlog_ahead():
    lane = Lane("e")
    short = lane.patience(1, 0.0)
    serve(lane, [2] * 10, 0.01)
    idle = lane.patience(1, 0.0)
    for _ in range(10):
        lane.started(4)
    assert short > 0 and lane.patience(1, 0.0) > idle


def test_the_backlog_is_outstanding_work_less_what_the_encoder_worked_off():
    lane = Lane("e")
    assert lane.backlog_s(0.0, 0.035, 0.1) == 0.0
    lane.started(30, 1.0)
    assert lane.backlog_s(None, 0.035, 0.1) == pytest.approx(3.035)  # no clock: nothing counted done
    assert lane.backlog_s(2.0, 0.035, 0.1) == pytest.approx(2.035)
    # Never measured: once its silence outlasts what the speed it was given says, the silence counts.
    assert lane.backlog_s(3.0, 0.035, 0.1) == pytest.approx(2.0)
    assert lane.backlog_s(11.0, 0.035, 0.1) == pytest.approx(10.0)
    measured = Lane("m")
    serve(measured, [2] * 10, 0.01)
    measured.started(30, 100.0)
    assert measured.backlog_s(100.1, measured.speed.fixed_s, measured.speed.item_s) == pytest.approx(
        measured.speed.fixed_s + measured.speed.item_s * 30 - 0.1
    )
    assert (
        measured.backlog_s(200.0, measured.speed.fixed_s, measured.speed.item_s) == 0.0
    )  # a measured one is overdue instead


def test_a_backlog_without_the_groups_a_request_goes_ahead_of_still_counts_a_hung_encoders_silence():
    lane = Lane("e")
    lane.started(1, 0.0)
    for n in range(9):
        lane.queued(W(None, 1, f"a{n}", tenant="a"))
    ahead_of_all = lambda waiting, fixed_s, item_s: list(waiting)  # noqa: E731
    assert lane.backlog_s(None, 0.0, 1.0, ahead_of_all) == pytest.approx(1.0), "only what runs is before it"
    # Never measured and silent for 6 s: hung, perhaps, so not idle however much it goes ahead of.
    assert lane.backlog_s(6.0, 0.0, 1.0, ahead_of_all) == pytest.approx(6.0)
    assert lane.backlog_s(6.0, 0.0, 1.0) == pytest.approx(6.0)


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


def test_a_request_that_goes_ahead_of_queued_groups_is_placed_by_what_runs_before_it():
    # e0 runs a short sub-request and has a's long queue; e1 runs a longer one and has none.
    encoders = fleet(2)
    policy = ExpectedFinish(affinity=False)
    short, long = (policy.lanes.of(e) for e in encoders)
    for lane in (short, long):
        serve(lane, [2] * 10, 0.004)
    short.started(1)
    long.started(4)
    for n in range(4):
        short.queued(W(b"k", 2, f"a{n}", tenant="a"))
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.charge_encoder("a", 5.0)
    assert policy.place(encoders, [Key("x")], 0)[0] == [encoders[1]], "the shorter backlog, a's queue counted"
    ahead_of_a = ledger.behind("b")
    assert policy.place(encoders, [Key("y")], 0, behind=ahead_of_a)[0] == [encoders[0]], "b goes ahead of a's queue"
    assert policy.place(encoders, [Key("z")], 0, behind=ledger.behind("a"))[0] == [encoders[1]]


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
    from epd_proxy.journey.subrequest import encoder_body

    def written(body, consumer):
        return orjson.dumps(encoder_body(body, [], send_uuid=True, transfer_ids=(), consumer_zmq=consumer))

    same_key = coalesce_key(one, FORWARDED_FIELDS, zmq[0]) == coalesce_key(other, FORWARDED_FIELDS, zmq[1])
    assert same_key == (written(one, zmq[0]) == written(other, zmq[1]))
