"""Fair shares between tenants (fleet/fairness.py) and the encoder queue's order by them."""

from __future__ import annotations

import math
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.fleet.backends import ENCODE, Instance
from epd_proxy.fleet.fairness import (
    CONTENDED_GROUP_ITEMS,
    CONTENDED_INFLIGHT,
    CONTENTION_LINGER_S,
    DEMAND_SLACK,
    DEMAND_WINDOW_S,
    OVER,
    SLACK_S,
    SLACK_TOKENS,
    WITHIN,
    Behind,
    Ledger,
)
from epd_proxy.fleet.lanes import BUSY_INFLIGHT, Lane, Lanes
from epd_proxy.fleet.sharing import take_batch
from tests.unit.fleet.test_lanes import W


def goes_after(behind: Behind, work: W) -> bool:
    """Whether a request goes ahead of `work` queued alone on an encoder (one second an item)."""
    return work in behind([work], 0.0, 1.0)


def served_alike(served: dict[str, float]) -> Ledger:
    """Tenants of weight 1, all active (none lifted by another's count), served these seconds."""
    ledger = Ledger()
    for tenant in served:
        ledger.began(tenant, 1.0)
    for tenant, seconds in served.items():
        ledger.charge_encoder(tenant, seconds)
    return ledger


def test_work_is_counted_against_the_weight_and_totals_stay_raw():
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.began("b", 4.0)
    ledger.charge_encoder("a", 2.0)
    ledger.charge_encoder("b", 2.0)
    ledger.charge_tokens("b", 300, 100)
    assert ledger.rank("a") == 2.0 and ledger.rank("b") == 0.5
    view = ledger.view(("default", "a", "b"))
    assert "default" not in view, "a tenant never served is not shown"
    assert view["b"]["encoder_s"] == 2.0 and (view["b"]["prompt_tokens"], view["b"]["output_tokens"]) == (300, 100)
    assert view["a"]["lead_encoder_s"] == 1.5 and view["b"]["lead_encoder_s"] == 0.0


def test_a_tenant_back_from_idle_starts_just_under_the_active_floor_and_banks_nothing():
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.began("b", 1.0)
    ledger.charge_encoder("b", 1.0)
    ledger.ended("b", 0.0)
    # b idles while a is served a lot.
    ledger.charge_encoder("a", 50.0)
    ledger.began("b", 1.0)
    assert ledger.rank("b") == math.nextafter(50.0, -math.inf), (
        "lifted to under the least-served active tenant, not left at 1"
    )
    # A tenant ahead of the floor when it comes back keeps its lead.
    ledger.ended("a", 0.0)
    ledger.charge_encoder("b", 10.0)
    ledger.began("a", 1.0)
    assert ledger.rank("a") == pytest.approx(60.0)
    assert ledger.lead("b") == pytest.approx((0.0, 0.0))


def test_a_tenant_alone_is_never_over_its_share_however_much_it_is_served():
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.charge_encoder("a", 1000.0)
    ledger.charge_tokens("a", 10**6, 10**6)
    assert ledger.share("a") == WITHIN
    assert ledger.share("new") == WITHIN, "one not seen yet is at the floor"


def ask_steadily(ledger: Ledger, tenant: str, per_s: float, seconds: float, start: float = 0.0) -> float:
    """`tenant` asks `per_s` encoder-seconds each second for `seconds` (ten arrivals a second); the time after."""
    now = start
    for _ in range(int(seconds * 10)):
        now += 0.1
        ledger.asked(tenant, 1.0, per_s / 10, now)
    return now


def test_a_tenant_asking_more_than_its_share_of_the_encoders_is_over_it_though_fair_queueing_keeps_its_counter_level():
    ledger = Ledger()
    ledger.began("flood", 1.0)
    ledger.began("chat", 1.0)
    # Two encoders, two active tenants of equal weight: a share is one encoder-second per second.
    now = ask_steadily(ledger, "flood", 10.0, 3 * DEMAND_WINDOW_S)
    ask_steadily(ledger, "chat", 0.9, 3 * DEMAND_WINDOW_S)
    assert ledger.lead("flood") == (0.0, 0.0)  # served alike
    assert ledger.share("flood", now, encoders=2) == OVER
    assert ledger.share("chat", now, encoders=2) == WITHIN
    # Without a clock, only the counters speak (as before a request's arrival is known).
    assert ledger.share("flood") == WITHIN
    # What it asked fades as it stops asking.
    assert ledger.share("flood", now + 4 * DEMAND_WINDOW_S, encoders=2) == WITHIN


def test_a_tenant_alone_may_ask_for_the_whole_fleet_and_not_more():
    ledger = Ledger()
    ledger.began("a", 1.0)
    now = ask_steadily(ledger, "a", 2 * (1 + DEMAND_SLACK) * 0.9, 3 * DEMAND_WINDOW_S)
    assert ledger.share("a", now, encoders=2) == WITHIN
    now = ask_steadily(ledger, "a", 2 * (1 + DEMAND_SLACK) * 1.2, 3 * DEMAND_WINDOW_S, start=now)
    assert ledger.share("a", now, encoders=2) == OVER
    assert ledger.view(("a",), now, 2)["a"]["share"] == OVER


def test_a_tenant_is_over_once_it_leads_the_least_served_active_one_by_more_than_the_slack():
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.began("b", 1.0)
    ledger.charge_encoder("a", SLACK_S)
    assert ledger.share("a") == WITHIN
    ledger.charge_encoder("a", 0.01)
    assert ledger.share("a") == OVER and ledger.share("b") == WITHIN
    # A weight of 2 halves what the same work counts for.
    heavy = Ledger()
    heavy.began("a", 2.0)
    heavy.began("b", 1.0)
    heavy.charge_encoder("a", 2 * SLACK_S)
    assert heavy.share("a") == WITHIN
    # Tokens count the same way.
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.began("b", 1.0)
    ledger.charge_tokens("a", SLACK_TOKENS, 1)
    assert ledger.share("a") == OVER
    # The other tenant going idle ends it: idle share is the busy one's.
    ledger.ended("b", 0.0)
    assert ledger.share("a") == WITHIN


def test_every_charge_is_told_to_the_metrics():
    told = []
    ledger = Ledger(lambda *charge: told.append(charge))
    ledger.charge_encoder("a", 0.25)
    ledger.charge_tokens("a", 7, 3)
    assert told == [("a", 0.25, 0, 0), ("a", 0.0, 7, 3)]


# -- the encoder queue's order ------------------------------------------------------------------


def test_a_turn_taken_for_a_rider_carries_the_groups_the_rider_waits_for_not_the_owners_others():
    # f1 is the flood's group, which the chat's request waits for (the same image): it goes at
    # the chat's standing, and what goes with it is the chat's, not the flood's other groups.
    ranks = {"flood": 5.0, "chat": 1.0}
    queue = deque(
        [
            W(b"k", 1, "f1", tenant="flood", riders=("chat",)),
            W(b"k", 1, "f2", tenant="flood"),
            W(b"k", 1, "c1", tenant="chat"),
        ]
    )
    assert [w.name for w in take_batch(queue, 8, ranks.__getitem__)] == ["f1", "c1"]
    assert [w.name for w in queue] == ["f2"]


def test_a_request_goes_ahead_of_worse_priorities_and_after_better_ones_whoever_was_served():
    ledger = served_alike({"a": 5.0, "b": 3.0, "c": 1.0})
    ledger.ended("b", 0.0)
    plain, urgent = ledger.behind("b", 0), ledger.behind("b", -1)
    assert not goes_after(plain, W(None, 1, tenant="a", priority=-1)), (
        "a's class group goes first, though a was served more"
    )
    assert goes_after(plain, W(None, 1, tenant="a", priority=0)) and not goes_after(
        plain, W(None, 1, tenant="c", priority=0)
    )
    assert goes_after(urgent, W(None, 1, tenant="c", priority=0)), (
        "b's class request passes c's group, though c was served less"
    )


def test_a_tenant_back_from_idle_goes_before_the_groups_the_tenant_at_the_floor_queued():
    # Lifted to a's counter exactly, b would tie with a and wait behind every group a had queued.
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.charge_encoder("a", 5.0)
    queued = W(None, 1, "a1", tenant="a")
    assert goes_after(ledger.behind("b"), queued), "predicted at arrival: b's group goes ahead of a's"
    ledger.began("b", 1.0)
    queue = deque([queued, W(None, 1, "b1", tenant="b")])
    assert take_batch(queue, 8, ledger.rank)[0].name == "b1"
    assert ledger.lead("a")[0] == pytest.approx(0.0) and ledger.share("a") == WITHIN


def test_within_a_priority_the_least_served_tenants_group_goes_first_with_its_own_alone():
    ranks = {"a": 5.0, "b": 1.0}
    queue = deque(
        [
            W(None, 1, "a1", tenant="a"),
            W(b"k", 1, "a2", tenant="a"),
            W(b"k", 1, "b1", tenant="b"),
            W(b"k", 1, "a3", tenant="a"),
            W(b"k", 1, "b2", tenant="b"),
        ]
    )
    batch = take_batch(queue, 8, ranks.__getitem__)
    assert [w.name for w in batch] == ["b1", "b2"], "b's groups first, and a's images do not ride in b's turn"
    assert [w.name for w in queue] == ["a1", "a2", "a3"]
    ranks["b"] = 9.0
    assert [w.name for w in take_batch(queue, 8, ranks.__getitem__)] == ["a1"]
    assert [w.name for w in take_batch(queue, 8, ranks.__getitem__)] == ["a2", "a3"], "a tenant's own still batch"
    # Without tenants every group of the key rides along, as before.
    queue = deque([W(b"k", 1, "a1", tenant="a"), W(b"k", 1, "b1", tenant="b")])
    assert [w.name for w in take_batch(queue, 8)] == ["a1", "b1"]
    # Ties go in arrival order.
    queue = deque([W(None, 1, "a1", tenant="a"), W(None, 1, "b1", tenant="b")])
    assert take_batch(queue, 8, lambda tenant: 0.0)[0].name == "a1"


def test_a_group_another_tenants_request_waits_for_stands_where_that_tenant_stands():
    ranks = {"a": 5.0, "b": 1.0, "c": 3.0}
    queue = deque([W(None, 1, "c1", tenant="c"), W(None, 1, "a1", tenant="a", riders=("b",))])
    assert take_batch(queue, 8, ranks.__getitem__)[0].name == "a1", "b waits for a1: b's standing, ahead of c"
    ledger = served_alike(ranks)
    goes_after_c = ledger.behind("c")
    assert goes_after(goes_after_c, W(None, 1, "a2", tenant="a"))
    assert not goes_after(goes_after_c, W(None, 1, "a1", tenant="a", riders=("b",)))


def test_fairness_never_jumps_a_priority_class():
    lane = Lane("e")
    lane.queued(W(None, 1, "a-urgent", priority=-1, tenant="a"))
    lane.queued(W(None, 1, "b", priority=0, tenant="b"))
    lane.queued(W(None, 1, "a", priority=0, tenant="a"))
    ranks = {"a": 9.0, "b": 0.0}
    order = [lane.next_batch(0, rank=ranks.__getitem__)[0].name for _ in range(3)]
    assert order == ["a-urgent", "b", "a"]


@settings(max_examples=200, deadline=None)
@given(
    works=st.lists(
        st.tuples(
            st.sampled_from([b"a", b"b", None]),
            st.integers(1, 3),
            st.sampled_from("xyz"),
            st.sampled_from([(), ("x",), ("z",)]),
        ),
        min_size=1,
        max_size=12,
    ),
    ranks=st.fixed_dictionaries({t: st.floats(0, 10) for t in "xyz"}),
    limit=st.integers(0, 8),
)
def test_a_fair_batch_heads_with_the_least_served_tenants_oldest_group_and_loses_nothing(works, ranks, limit):
    queue = deque(
        W(key, size, str(i), tenant=tenant, riders=riders) for i, (key, size, tenant, riders) in enumerate(works)
    )
    before = list(queue)
    batch = take_batch(queue, limit, ranks.__getitem__)
    standing = {id(w): min(ranks[t] for t in w.tenants) for w in before}
    least = min(standing.values())
    assert batch[0] is next(w for w in before if standing[id(w)] == least)
    turn = min(batch[0].tenants, key=ranks.__getitem__)
    assert all(w.key == batch[0].key and turn in w.tenants for w in batch)
    assert len(batch) == 1 or sum(w.size for w in batch) <= limit
    assert sorted(map(id, batch + list(queue))) == sorted(map(id, before))
    assert list(queue) == [w for w in before if w not in batch]


def test_a_sub_request_is_charged_at_the_encoders_speed_with_its_fixed_cost_shared():
    ledger = Ledger()
    lanes = Lanes(ledger)
    lane = lanes.of(Instance("http://e", ENCODE))
    # Before any answer an image-equivalent counts as the prior (placement's own guess).
    lanes.charge(lane, "a", 1.0)
    fixed, per_item = lanes.costs([lane])
    assert ledger.view(("a",))["a"]["encoder_s"] == pytest.approx(fixed[0] + per_item[0], abs=1e-3)
    now = 0.0
    for _ in range(10):
        lane.started(2.0, now)
        lane.finished(2.0, now, now + 0.1)
        now += 1.0
    known = lane.speed.known()
    assert known is not None
    lanes.charge(lane, "b", 2.0, members=2)
    assert ledger.view(("b",))["b"]["encoder_s"] == pytest.approx(known[0] / 2 + known[1] * 2.0, abs=1e-3)
    # Without tenants, or for a request without one, nothing is charged.
    Lanes().charge(lane, "b", 2.0)
    lanes.charge(lane, None, 2.0)
    assert ledger.view(("b",))["b"]["encoder_s"] == pytest.approx(known[0] / 2 + known[1] * 2.0, abs=1e-3)


def test_a_new_request_goes_ahead_of_groups_of_tenants_served_more_than_its_own():
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.began("b", 1.0)
    ledger.charge_encoder("a", 5.0)
    ledger.charge_encoder("b", 1.0)
    behind_b = ledger.behind("b")
    assert goes_after(behind_b, W(None, 1, tenant="a")) and not goes_after(behind_b, W(None, 1, tenant="b"))
    behind_a = ledger.behind("a")
    assert not goes_after(behind_a, W(None, 1, tenant="a")) and not goes_after(behind_a, W(None, 1, tenant="b"))
    # One idle or never seen stands just under the floor (b's 1.0): ahead of a's groups and of b's,
    # which has been served as much.
    behind_new = ledger.behind("c")
    assert goes_after(behind_new, W(None, 1, tenant="a")) and goes_after(behind_new, W(None, 1, tenant="b"))


def test_a_sub_request_carries_a_quantum_while_tenants_compete_and_for_a_while_after():
    ledger = Ledger()
    lanes = Lanes(ledger)
    ledger.began("a", 1.0)
    assert not ledger.competing(10.0) and lanes.group_cap(0, 10.0) == 0 and lanes.group_cap(8, 10.0) == 8
    assert lanes.slots(10.0) == BUSY_INFLIGHT
    ledger.began("b", 1.0)
    assert ledger.contended() and ledger.competing(10.0)
    assert lanes.group_cap(0, 10.0) == CONTENDED_GROUP_ITEMS and lanes.group_cap(1, 10.0) == 1
    assert lanes.slots(10.0) == CONTENDED_INFLIGHT < BUSY_INFLIGHT
    ledger.ended("b", 11.0)
    # b pauses between its questions: its next one must not find a's images in whole sub-requests.
    assert not ledger.contended()
    assert lanes.group_cap(8, 11.0 + CONTENTION_LINGER_S - 0.1) == CONTENDED_GROUP_ITEMS
    assert lanes.slots(11.0 + CONTENTION_LINGER_S - 0.1) == CONTENDED_INFLIGHT
    assert lanes.group_cap(8, 11.0 + CONTENTION_LINGER_S) == 8
    assert lanes.slots(11.0 + CONTENTION_LINGER_S) == BUSY_INFLIGHT
    ledger.began("b", 1.0)
    ledger.began("b", 1.0)
    ledger.ended("b", 20.0)
    assert lanes.group_cap(8, 40.0) == CONTENDED_GROUP_ITEMS, "b still has a request in flight"
    ledger.ended("b", 40.0)
    ledger.ended("a", 41.0)
    assert ledger.competing(42.0), "both asked lately"
    assert not ledger.competing(40.0 + CONTENTION_LINGER_S), "only a asked lately"
    assert Lanes().group_cap(8, 0.0) == 8, "without --tenants nothing changes"
    assert Lanes().slots(0.0) == BUSY_INFLIGHT


def test_a_tenant_served_a_little_less_goes_first_with_only_that_little_of_its_queue():
    # Both backlogged: a's long queue is served only until a's counter passes b's, then b's request.
    ledger = Ledger()
    ledger.began("a", 1.0)
    ledger.began("b", 2.0)
    ledger.charge_encoder("a", 10.0)
    ledger.charge_encoder("b", 21.0)  # 10.5 weighted
    lane = Lane("e")
    queue = [W(None, 1, f"a{n}", tenant="a") for n in range(5)]
    for work in queue:
        lane.queued(work)
    later = ledger.behind("b")(lane.work.waiting, 0.0, 1.0)
    assert [w.name for w in later] == ["a1", "a2", "a3", "a4"], "a0 takes a to 11.0, past b's 10.5"
    assert lane.queued_s(0.0, 1.0, ledger.behind("b")) == pytest.approx(4.0)
    # b's own queued groups go first and raise where its request stands, by their cost over b's weight.
    lane.queued(W(None, 2, "b1", tenant="b"))
    later = ledger.behind("b")(lane.work.waiting, 0.5, 1.0)
    assert [w.name for w in later] == ["a2", "a3", "a4"], "b stands at 10.5 + 2.5 / 2; a's tags 10, 11.5, 13"
    # Weights: the same seconds raise a tenant of weight 4 a quarter as far (a tie goes to the queued).
    ledger = Ledger()
    ledger.began("b", 1.0)
    ledger.began("c", 4.0)
    ledger.charge_encoder("b", 10.5)
    ledger.charge_encoder("c", 4.0 * 10.0)
    lane = Lane("e")
    for n in range(5):
        lane.queued(W(None, 1, f"c{n}", tenant="c"))
    assert [w.name for w in ledger.behind("b")(lane.work.waiting, 0.0, 1.0)] == ["c3", "c4"]


def test_a_group_another_request_waits_for_lifts_that_request_only_until_it_has_paid():
    # a's request X has four 1-image groups queued; b's request waits for X's first image, owing 1.
    ledger = served_alike({"a": 5.0, "b": 1.0, "c": 3.0})
    owed = {"b": 1.0}

    class OfX(W):
        @property
        def owed(self) -> dict[str, float]:
            return owed

    x = [OfX(None, 1, f"x{n}", tenant="a", riders=("b",)) for n in range(4)]
    queue = [*x, W(None, 1, "c1", tenant="c")]
    # x0 goes at b's place (1) and b pays its image; x1-x3 then stand at a's count (6, 7, 8), after
    # c's new request, which stands at c's 3 plus its own queued group.
    assert [w.name for w in ledger.behind("c")(queue, 0.0, 1.0)] == ["x1", "x2", "x3"]
    # b's own new request stands after what b pays for x0 (1 + 1), ahead of c's group (3).
    assert [w.name for w in ledger.behind("b")(queue, 0.0, 1.0)] == ["x1", "x2", "x3", "c1"]
    assert owed == {"b": 1.0}, "the walk leaves the request's debts as they are"
