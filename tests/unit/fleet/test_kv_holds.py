"""What the KV index says an instance holds of a request's media (kv_holds.py): over its ranks,
None where the index cannot say."""

from __future__ import annotations

from epd_proxy.fleet.kv_holds import KvHolds, over_ranks
from epd_proxy.fleet.rendered import Item, Rendered
from tests.unit.fleet.test_kv_index import BS, Clock, blocks, fresh_index, stored

URL = "http://pd-a:8000"


def test_an_instance_answers_over_its_ranks():
    assert over_ranks([[0, 2], [3, 0]], 2) == [3, 2]
    assert over_ranks([[0, 2], None], 2) == [None, 2]  # a stale rank may hold what the fresh one lacks
    assert over_ranks([None], 2) == [None, None]
    assert over_ranks([[0, 0]], 2) == [0, 0]


def test_a_rank_holding_an_image_in_a_whole_prefix_answers_for_the_instance():
    clock = Clock()
    index = fresh_index((URL, 0), (URL, 1), clock=clock)
    # Rank 1 holds a prefix through image "img" (blocks 1 and 2), closed by block 3.
    prompt = blocks(4, media={1: [["img", 2]], 2: [["img", -2]]})
    index.apply((URL, 1), [stored([1, 2, 3, 4], prompt)])
    holds = KvHolds(index, lambda url: (0, 1) if url == URL else ())
    assert holds(URL, ["img", "other"]) == [3, 0]
    # Asked of the pinned rank only, the one that holds nothing.
    assert holds(URL, ["img"], ranks=[0]) == [0]
    # An instance whose ranks nobody follows: the index cannot say.
    assert holds("http://pd-b:8000", ["img"]) == [None]
    assert holds(URL, []) == []


def test_a_rendered_prompt_is_held_as_far_as_its_blocks_lie_on_a_rank():
    index = fresh_index((URL, 0), (URL, 1))
    # Rank 1 stored a prompt of 4 blocks with an image over blocks 1-2; rank 0 only its first 2.
    prompt = blocks(4, media={1: [["img", 2]], 2: [["img", -BS + 2]]})
    index.apply((URL, 1), [stored([1, 2, 3, 4], prompt)])
    index.apply((URL, 0), [stored([7, 8], prompt[:2])])
    holds = KvHolds(index, lambda url: (0, 1) if url == URL else ())
    tokens = [t for block, _ in prompt for t in block]
    # The next turn: the same 4 blocks, then new tokens.
    turn = Rendered([*tokens, *range(900, 900 + BS + 5)], [Item("img", BS + 2, BS)])
    assert holds.prefix_tokens(URL, turn) == 4 * BS
    # Another image at the same place matches only the text before it.
    other = Rendered(tokens, [Item("other", BS + 2, BS)])
    assert holds.prefix_tokens(URL, other) == BS
    assert holds.prefix_tokens("http://pd-b:8000", turn) is None
    # A stale rank may hold more than the fresh one shows: unless the fresh one holds some, no answer.
    index.stale((URL, 1), "test")
    assert holds.prefix_tokens(URL, turn) == 2 * BS
    assert holds.prefix_tokens(URL, Rendered(list(range(5000, 5000 + 2 * BS)))) is None


def test_a_model_names_an_adapter_only_once_an_engine_stored_its_blocks():
    index = fresh_index(("http://pd:1", 0))
    holds = KvHolds(index, lambda url: (0,))
    index.apply(("http://pd:1", 0), [stored([1], blocks(1), lora="ada")])
    assert holds.adapter("ada") == "ada" and holds.adapter("base") is None
    # A client's `model` of any JSON type is asked about without harm.
    assert holds.adapter(["ada"]) is None and holds.adapter({"a": 1}) is None and holds.adapter(None) is None
