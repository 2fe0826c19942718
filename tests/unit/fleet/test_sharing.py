"""The share governor and which queued groups share a sub-request (fleet/sharing.py)."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.fleet.lanes import Lane
from epd_proxy.fleet.sharing import COALESCE_TARGET_ITEMS, PAUSE_FLOOR_S, PAUSE_MAX_S, PROBE_ITEMS, take_batch
from tests.unit.fleet.test_lanes import W
from tests.unit.fleet.test_scheduler import serve


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


def test_a_share_at_fault_halves_to_a_probe_then_pauses_and_recovers_by_itself():
    lane = Lane("e")
    lane.share_failed(8, now=10.0)
    assert (lane.share.merge_limit, lane.share_limit(0, 10.0, None)) == (4, 4)
    lane.share_failed(4, now=10.0)
    lane.share_failed(2, now=10.0)
    # At the probe size, sharing pauses for PAUSE_FLOOR_S, then probes with two again.
    assert lane.share_limit(0, 10.0 + PAUSE_FLOOR_S / 2, None) == 0
    assert lane.share_limit(0, 10.0 + PAUSE_FLOOR_S, None) == PROBE_ITEMS
    lane.share_failed(2, now=11.0)
    assert lane.share.paused_until == 11.0 + 2 * PAUSE_FLOOR_S, "pauses double while probes fail"
    for _ in range(20):
        lane.share_failed(2, now=11.0)
    assert lane.share.paused_until == 11.0 + PAUSE_MAX_S
    # A probe that splits ends the pause; the share doubles back as TCP's slow start does.
    lane.shared_ok(2)
    assert (lane.share.paused_until, lane.share.merge_limit) == (0.0, 4)
    lane.shared_ok(4)
    assert lane.share.merge_limit == COALESCE_TARGET_ITEMS
    assert lane.share.backoffs == 24


def test_a_shared_sub_request_holds_only_what_fits_a_third_of_the_encode_timeout():
    lane = Lane("e")
    serve(lane, [1] * 40, per_item_s=0.1)
    fixed, per_item = lane.speed.fixed_s, lane.speed.item_s
    assert lane.share_limit(0, 0.0, None) == COALESCE_TARGET_ITEMS
    assert lane.share_limit(0, 0.0, 2.4) == int((2.4 / 3 - fixed) / per_item) == 7
    assert lane.share_limit(0, 0.0, 0.45) == 1
    assert lane.share_limit(0, 0.0, 0.1) <= 0, "not even two: the oldest group goes alone"
