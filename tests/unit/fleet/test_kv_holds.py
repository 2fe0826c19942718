"""What the KV index says an instance holds of a request's media (kv_holds.py): over its ranks,
None where the index cannot say."""

from __future__ import annotations

from epd_proxy.fleet.kv_holds import KvHolds, over_ranks
from tests.unit.fleet.test_kv_index import Clock, blocks, fresh_index, stored

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
