from __future__ import annotations

import random

import pytest

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.routing import (
    SERVING,
    ContentAffinity,
    LeastLoaded,
    PowerOfTwo,
    PrefixAffinity,
    RandomChoice,
    RoundRobin,
    bounded_pick,
    index_pick,
    make_policy,
    make_serving_policy,
)


def fleet(n):
    return [Instance(f"http://e{i}", "encode") for i in range(n)]


def test_round_robin_cursor_is_shared_across_requests():
    encoders = fleet(3)
    rr = RoundRobin()
    singles = [rr.choose(encoders, ["k"])[0].url for _ in range(4)]
    assert singles == ["http://e0", "http://e1", "http://e2", "http://e0"]
    # item k of the next request goes to (cursor + k) mod n
    assert [e.url for e in rr.choose(encoders, ["a", "b", "c", "d"])] == [
        "http://e1",
        "http://e2",
        "http://e0",
        "http://e1",
    ]
    assert rr.choose(encoders, ["z"])[0].url == "http://e2"


def test_least_loaded_prefers_idle_and_counts_its_own_picks():
    encoders = fleet(3)
    encoders[0].inflight = 5
    picks = LeastLoaded().choose(encoders, ["a", "b", "c", "d"])
    assert [p.url for p in picks].count("http://e0") == 0
    assert {p.url for p in picks} == {"http://e1", "http://e2"}


def test_least_loaded_rotates_ties():
    encoders = fleet(3)
    policy = LeastLoaded()
    assert [policy.choose(encoders, ["k"])[0].url for _ in range(3)] == ["http://e0", "http://e1", "http://e2"]


def test_power_of_two_never_picks_the_busier_of_its_two():
    encoders = fleet(2)
    encoders[1].inflight = 3
    policy = PowerOfTwo(random.Random(1))
    assert all(policy.choose(encoders, ["k"])[0] is encoders[0] for _ in range(20))


def test_random_stays_within_candidates():
    encoders = fleet(2)
    assert set(p.url for p in RandomChoice(random.Random(0)).choose(encoders, ["k"] * 20)) <= {"http://e0", "http://e1"}


def test_unknown_policy_is_rejected_by_name():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="unknown prefill/decode routing policy 'content_affinity'"):
        make_serving_policy("content_affinity")  # it needs a key for every request


def test_a_serving_policy_takes_requests_without_a_key():
    pds = fleet(3)
    for name in SERVING:
        assert len(make_serving_policy(name).choose(pds, [None, "k"])) == 2, name


def test_content_affinity_sends_the_same_content_to_the_same_encoder():
    encoders = fleet(4)
    policy = ContentAffinity()
    homes = {key: policy.choose(encoders, [key])[0].url for key in (f"img{i}" for i in range(40))}
    assert len(set(homes.values())) > 1, "keys should spread over the fleet"
    again = {key: policy.choose(encoders, [key])[0].url for key in homes}
    assert again == homes


def test_content_affinity_bounds_the_load_of_a_hot_key():
    encoders = fleet(4)
    policy = ContentAffinity(load_factor=1.25)
    picks = policy.choose(encoders, ["hot"] * 8)
    counts = {e.url: sum(p is e for p in picks) for e in encoders}
    assert max(counts.values()) <= 3, counts


def test_content_affinity_keeps_most_homes_when_an_encoder_leaves():
    encoders = fleet(4)
    policy = ContentAffinity()
    keys = [f"img{i}" for i in range(200)]
    before = {k: policy.choose(encoders, [k])[0].url for k in keys}
    survivors = [e for e in encoders if e.url != "http://e3"]
    after = {k: policy.choose(survivors, [k])[0].url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "http://e3" for k in moved)


# -- where a conversation's last turn ran -------------------------------------------------------------


def pds(n):
    return [Instance(f"http://pd{i}", "prefill_decode") for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_conversation_that_spilled_stays_where_its_last_turn_ran():
    members = pds(3)
    policy = PrefixAffinity()
    home = policy.choose(members, ["conv"])[0]
    home.inflight = 5  # far over 1.25x the mean: turn 2 spills
    spilled = policy.choose(members, ["conv"])[0]
    assert spilled is not home
    home.inflight = 0
    # Turn 3: its prefix is where turn 2 ran, not at the idle home.
    assert [policy.choose(members, ["conv"])[0] for _ in range(3)] == [spilled] * 3


def test_the_last_turns_instance_is_left_over_its_load_bound_or_out_of_rotation():
    members = pds(3)
    policy = PrefixAffinity()
    first = policy.choose(members, ["conv"])[0]
    first.inflight = 5
    second = policy.choose(members, ["conv"])[0]
    assert second is not first
    # Out of rotation (not a candidate): the key's own walk round the ring decides.
    rest = [m for m in members if m is not second]
    first.inflight = 0
    assert policy.choose(rest, ["conv"])[0] is first


def test_a_remembered_placement_is_bounded_and_ages():
    members = pds(2)
    clock = Clock()
    policy = PrefixAffinity(remember=2, ttl_s=60.0, clock=clock)
    home = policy.choose(members, ["conv"])[0]
    other = next(m for m in members if m is not home)
    home.inflight = 4
    assert policy.choose(members, ["conv"])[0] is other
    home.inflight = 0
    clock.now = 61.0
    assert policy.choose(members, ["conv"])[0] is home  # forgotten: back to the key's home
    home.inflight = 4
    policy.choose(members, ["conv"])  # spills to `other` again, remembered
    home.inflight = 0
    policy.choose(members, ["a"]), policy.choose(members, ["b"])  # two newer keys push it out
    assert len(policy.last_turns) == 2 and policy.choose(members, ["conv"])[0] is home


def test_a_bounded_pick_takes_the_preferred_under_the_bound_else_walks_the_ring():
    assert bounded_pick([0, 0, 0], [2, 0, 1], bound=1, preferred=1) == 1
    assert bounded_pick([0, 1, 0], [2, 0, 1], bound=1, preferred=1) == 2
    assert bounded_pick([1, 1, 0], [0, 1, 2], bound=1) == 2
    assert bounded_pick([1, 1, 1], [1, 0, 2], bound=1, preferred=2) == 1  # all at the bound: the home


def test_the_index_picks_the_deepest_holder_under_the_bound():
    assert index_pick([0, 3, 5], [0, 0, 0], bound=2) == 2
    assert index_pick([0, 3, 5], [0, 0, 2], bound=2) == 1  # the deepest is at the bound
    assert index_pick([4, 4, 0], [1, 0, 0], bound=2) == 1  # equals: the less loaded
    assert index_pick([0, 0, 0], [0, 0, 0], bound=2) is None  # none holds any (or none fresh)
    assert index_pick([3, 0], [2, 0], bound=2) is None


class Holds:
    """What a KV index would answer, per instance URL and media uuid (absent: not fresh)."""

    def __init__(self, depths: dict[str, dict[str, int]]) -> None:
        self.depths = depths

    def __call__(self, url, media, ranks):
        known = self.depths.get(url)
        return [None if known is None else known.get(m, 0) for m in media]


def test_a_conversation_goes_where_the_index_says_its_images_are_within_the_bound():
    members = pds(3)
    decided: list[str] = []
    home = PrefixAffinity().choose(members, ["conv"])[0]
    holder = next(m for m in members if m is not home)
    policy = PrefixAffinity()
    policy.decided = decided.append
    policy.holds = Holds({m.url: ({"img-1": 4} if m is holder else {}) for m in members})
    # A new process: no record, the hash says `home`; the index knows where the prefix is.
    assert policy.choose(members, ["conv"], ["img-1", "img-2"])[0] is holder
    # Past the bound the holder is left, and the record (where the last turn ran) is too.
    holder.inflight = 5
    assert policy.choose(members, ["conv"], ["img-1"])[0] is home
    holder.inflight = 0
    # Not fresh anywhere, or held nowhere: today's rule (the record: the last turn ran at home).
    policy.holds = Holds({})
    assert policy.choose(members, ["conv"], ["img-1"])[0] is home
    policy.holds = Holds({m.url: {} for m in members})
    assert policy.choose(members, ["conv"], ["img-1"])[0] is home
    assert PrefixAffinity().choose(members, ["other"], ["img-1"])  # no index: as before
    assert decided == ["index", "hash", "record", "record"]
