from __future__ import annotations

import random

import pytest

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.prefill_cost import FIXED_TOKENS, Prompt
from epd_proxy.fleet.rendered import Rendered
from epd_proxy.fleet.routing import (
    SERVING,
    SPECULATIVE_S,
    ContentAffinity,
    LeastLoaded,
    PowerOfTwo,
    PrefixAffinity,
    RandomChoice,
    RoundRobin,
    bounded_pick,
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


def place(policy, members, key, tokens=1000.0, media=(), prefilled=True):
    """A turn placed and, unless told, run to its first token at once."""
    placement = policy.place(members, key, Prompt(tokens, media))
    if prefilled:
        placement.turn.prefilled_at = policy.clock()
    return placement


def test_a_conversation_stays_with_its_prefix_until_the_work_queued_there_outweighs_it():
    members = pds(3)
    policy = PrefixAffinity()
    home = place(policy, members, "conv").instance
    home.prefill_queue = 900.0  # less than the 1,000 tokens it holds: the conversation stays
    assert place(policy, members, "conv").instance is home
    home.prefill_queue = 1200.0  # more: recomputing the prompt elsewhere is sooner
    spilled = place(policy, members, "conv")
    assert spilled.instance is not home and spilled.source == "load"
    assert spilled.claim == FIXED_TOKENS + 1000.0  # it holds none of the prompt
    home.prefill_queue = 0.0
    # Turn 3: its prefix (turn 2's 1,000 tokens) is where turn 2 ran, not at the idle home.
    turn = place(policy, members, "conv", tokens=1100.0)
    assert (turn.instance, turn.source, turn.claim) == (spilled.instance, "record", FIXED_TOKENS + 100.0)
    assert [place(policy, members, "conv", tokens=1200.0).instance for _ in range(3)] == [spilled.instance] * 3


def test_requests_sent_at_once_with_one_opening_spread_until_the_first_has_its_first_token():
    members = pds(2)
    policy = PrefixAffinity()
    first = place(policy, members, "conv", prefilled=False)
    first.instance.prefill_queue += first.claim
    # A sibling with the same opening: nothing of it is cached yet, so it goes by load.
    sibling = place(policy, members, "conv", prefilled=False)
    assert sibling.instance is not first.instance and sibling.claim == FIXED_TOKENS + 1000.0
    sibling.instance.prefill_queue += sibling.claim
    # Once a turn has its first token, the next turn finds its prompt where it ran.
    sibling.turn.prefilled_at = policy.clock()
    follows = place(policy, members, "conv", tokens=1100.0)
    assert (follows.instance, follows.claim) == (sibling.instance, FIXED_TOKENS + 100.0)


def test_a_crowded_holder_keeps_its_conversation_from_a_slightly_less_busy_instance_not_from_an_idle_one():
    members = pds(3)
    policy = PrefixAffinity()
    holder = place(policy, members, "conv", tokens=1800.0).instance
    busy, idle = (m for m in members if m is not holder)
    holder.inflight, holder.prefill_queue = 6, 2000.0
    busy.inflight, idle.inflight = 5, 5
    # Recomputing 1,800 tokens beside 5 running requests costs more than waiting behind 2,000.
    assert place(policy, members, "conv", tokens=2000.0).instance is holder
    idle.inflight = 0
    assert place(policy, members, "conv", tokens=2000.0).instance is idle


def test_a_slower_consumer_is_left_when_recomputing_elsewhere_is_sooner():
    members = pds(2)
    clock = Clock()
    policy = PrefixAffinity(clock=clock)
    clock.now = 19991.0
    holder = place(policy, members, "conv").instance
    other = next(m for m in members if m is not holder)
    # Measured over many first tokens: the holder takes 10 ms per token, the other 1 ms.
    for n in range(1000):
        holder.prefill_speed.observe(1000.0, 20.0 * n, 20.0 * n + 10.0)
        other.prefill_speed.observe(1000.0, 20.0 * n + 9.0, 20.0 * n + 10.0)
    # 100 new tokens on the holder: 1.64 s; all 1,100 on the other: 1.16 s.
    assert place(policy, members, "conv", tokens=1100.0).instance is other


def test_the_last_turns_instance_out_of_rotation_leaves_the_key_to_its_home():
    members = pds(3)
    policy = PrefixAffinity()
    first = place(policy, members, "conv").instance
    first.prefill_queue = 5000.0
    second = place(policy, members, "conv").instance
    assert second is not first
    # Out of rotation (not a candidate): the key's own home round the ring holds it.
    rest = [m for m in members if m is not second]
    first.prefill_queue = 0.0
    assert place(policy, rest, "conv").instance is first


def test_a_remembered_placement_is_bounded_and_ages():
    members = pds(2)
    clock = Clock()
    policy = PrefixAffinity(remember=2, ttl_s=60.0, clock=clock)
    home = place(policy, members, "conv").instance
    other = next(m for m in members if m is not home)
    home.prefill_queue = 5000.0
    assert place(policy, members, "conv").instance is other
    home.prefill_queue = 0.0
    clock.now = 61.0
    assert place(policy, members, "conv").instance is home  # forgotten: back to the key's home
    home.prefill_queue = 5000.0
    place(policy, members, "conv")  # spills to `other` again, remembered
    home.prefill_queue = 0.0
    place(policy, members, "a"), place(policy, members, "b")  # two newer keys push it out
    assert len(policy.last_turns) == 2 and place(policy, members, "conv").instance is home


def test_a_bounded_pick_takes_the_preferred_under_the_bound_else_walks_the_ring():
    assert bounded_pick([0, 0, 0], [2, 0, 1], bound=1, preferred=1) == 1
    assert bounded_pick([0, 1, 0], [2, 0, 1], bound=1, preferred=1) == 2
    assert bounded_pick([1, 1, 0], [0, 1, 2], bound=1) == 2
    assert bounded_pick([1, 1, 1], [1, 0, 2], bound=1, preferred=2) == 1  # all at the bound: the home


class Holds:
    """What a KV index would answer, per instance URL and media uuid (absent: not fresh)."""

    def __init__(self, depths: dict[str, dict[str, int]]) -> None:
        self.depths = depths

    def __call__(self, url, media, ranks):
        known = self.depths.get(url)
        return [None if known is None else known.get(m, 0) for m in media]

    def block_size(self, url):
        return 16

    def holding(self, media):
        return {url for url, known in self.depths.items() if any(known.get(m) for m in media)}


def test_a_conversation_goes_where_the_index_says_its_images_are_unless_queued_work_outweighs_them():
    members = pds(3)
    decided: list[str] = []
    home = PrefixAffinity().choose(members, ["conv"])[0]
    holder = next(m for m in members if m is not home)
    clock = Clock()
    policy = PrefixAffinity(clock=clock)
    policy.decided = decided.append
    policy.holds = Holds({m.url: ({"img-1": 20} if m is holder else {}) for m in members})
    # A new process: no record, the hash says `home`; the index knows where the prefix is:
    # 20 blocks of 16 tokens.
    first = place(policy, members, "conv", 1000.0, ["img-1", "img-2"])
    assert (first.instance, first.claim) == (holder, FIXED_TOKENS + 1000.0 - 320.0)
    clock.now += SPECULATIVE_S + 1  # the index has not shown that turn there
    # Work queued on the holder past what it holds moves the request; the index still says where
    # the prefix is, so the home gets no credit: the least queued of the others.
    holder.prefill_queue = 400.0
    home.prefill_queue = 10.0
    moved = place(policy, members, "conv", 1000.0, ["img-1"]).instance
    assert moved is not holder and moved is not home
    holder.prefill_queue = home.prefill_queue = 0.0
    # Not fresh anywhere, or held nowhere: where the last turn ran (recorded) holds it.
    policy.holds = Holds({})
    assert place(policy, members, "conv", 1000.0, ["img-1"]).instance is moved
    policy.holds = Holds({m.url: {} for m in members})
    assert place(policy, members, "conv", 1000.0, ["img-1"]).instance is moved
    assert PrefixAffinity().choose(members, ["other"], Prompt(10.0, ["img-1"]))  # no index: as before
    assert decided == ["index", "load", "record", "record"]


def test_a_turn_just_placed_counts_as_held_where_it_went_until_the_index_could_show_it():
    members = pds(3)
    clock = Clock()
    policy = PrefixAffinity(clock=clock)
    holder, other, _ = members
    policy.holds = Holds({m.url: ({"img-1": 20} if m is holder else {}) for m in members})
    holder.prefill_queue = 5000.0
    moved = place(policy, members, "conv", 1000.0, ["img-1"])
    assert moved.instance is not holder
    holder.prefill_queue = 0.0
    # The next turn, sent before the moved one's blocks reached the index: where that one went.
    clock.now += 2.0
    follows = place(policy, members, "conv", 1100.0, ["img-1", "img-2"])
    assert (follows.instance, follows.source, follows.claim) == (moved.instance, "record", FIXED_TOKENS + 100.0)
    # Long after, with the index still showing nothing there (evicted, or it never ran): the index.
    clock.now += SPECULATIVE_S + 1
    assert place(policy, members, "conv", 1200.0, ["img-1", "img-2"]).instance is holder


class ExactHolds(Holds):
    """Holds, and per instance URL the tokens of any rendered prompt it holds (absent: not fresh)."""

    def __init__(self, tokens: dict[str, int], depths: dict[str, dict[str, int]] | None = None) -> None:
        super().__init__(depths or {})
        self.tokens = tokens

    def prefix_tokens(self, url, prompt):
        return self.tokens.get(url)


def rendered_prompt(tokens: int, media=()) -> Prompt:
    return Prompt(float(tokens), media, Rendered(list(range(tokens))))


def test_a_rendered_prompt_goes_where_the_index_holds_most_of_it_text_and_images_alike():
    members = pds(3)
    decided: list[str] = []
    policy = PrefixAffinity()
    policy.decided = decided.append
    # A text-only conversation: no image to ask about, yet the index knows who holds its blocks.
    policy.holds = ExactHolds({members[0].url: 64, members[1].url: 960, members[2].url: 0})
    chosen = policy.place(members, "conv", rendered_prompt(1000))
    assert (chosen.instance, chosen.source, chosen.claim) == (members[1], "exact", FIXED_TOKENS + 40.0)
    # The images' answer is not asked when the blocks answered; when they show nothing held, it is.
    policy.holds = ExactHolds({m.url: 0 for m in members}, {members[2].url: {"img": 10}})
    assert policy.place(members, "conv", rendered_prompt(1000, ["img"])).instance is members[2]
    assert decided == ["exact", "index"]


def test_new_conversations_that_share_a_preamble_every_engine_holds_still_spread_round_the_ring():
    members = pds(4)
    policy = PrefixAffinity()
    policy.holds = ExactHolds({m.url: 512 for m in members})
    homes = {PrefixAffinity().choose(members, [f"conv-{n}"])[0].url for n in range(40)}
    placed = {policy.place(members, f"conv-{n}", rendered_prompt(600)).instance.url for n in range(40)}
    assert placed == homes and len(placed) > 1
