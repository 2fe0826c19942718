from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.errors import ProxyError
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.match import Matches, match_group, split_params
from tests.media import chat, image, video


def items_of(*parts, **fields):
    return normalise_request(chat(*parts, **fields)).items


def meta(h, w):
    return {"image_grid_thw": [[1, h, w]]}


def test_repeated_image_with_derived_hashes_maps_by_position_in_any_key_order():
    items = items_of(image("A"), image("B"), image("A"))
    entries = {
        "derivedA": {"metadata": meta(4, 6), "item_indices": [0, 2], "peer_host": "10.0.0.1", "peer_port": 7},
        "derivedB": {"metadata": meta(2, 2), "item_indices": [1]},
    }
    results = []
    for order in itertools.permutations(entries):
        matches = Matches()
        match_group(items, ["t0", "t1", "t2"], {k: entries[k] for k in order}, matches)
        results.append(matches)
    first = results[0]
    assert all(r.items == first.items and r.handles == first.handles for r in results)
    assert [first.items[i].ec_mm_hash for i in range(3)] == ["derivedA", "derivedB", "derivedA"]
    assert [first.items[i].transfer_id for i in range(3)] == ["t0", "t1", "t2"]
    # handles stay under the engine-reported hash, verbatim, because consumers look them up by it
    assert first.handles["derivedA"]["peer_host"] == "10.0.0.1"


@pytest.mark.parametrize("bad", [[True], [0.0], [-1], [2], "0", [None]])
def test_invalid_indices_are_502(bad):
    items = items_of(image("A"), image("B"))
    with pytest.raises(ProxyError, match="Invalid encoder item index") as err:
        match_group(items, ["a", "b"], {"h": {"metadata": meta(1, 1), "item_indices": bad}}, Matches())
    assert err.value.status == 502


def test_duplicate_index_is_502():
    items = items_of(image("A"), image("B"))
    params = {"h1": {"metadata": {}, "item_indices": [0]}, "h2": {"metadata": {}, "item_indices": [0, 1]}}
    with pytest.raises(ProxyError, match="Duplicate encoder item index") as err:
        match_group(items, ["a", "b"], params, Matches())
    assert err.value.status == 502


def test_encoders_without_positions_fall_back_to_uuid_or_the_single_entry():
    a, b = items_of(image("A"), image("B"))
    matches = Matches()
    match_group([a, b], ["ta", "tb"], {b.uuid: {"metadata": meta(1, 1)}, a.uuid: {"metadata": meta(2, 2)}}, matches)
    assert matches.items[0].ec_mm_hash == a.uuid and matches.items[1].ec_mm_hash == b.uuid

    [single] = items_of(image("A"))
    matches = Matches()
    match_group([single], ["t"], {"derived-by-options": {"metadata": meta(2, 2)}}, matches)
    assert matches.items[0].ec_mm_hash == "derived-by-options"


def test_ambiguous_batch_is_502_never_a_guess():
    items = items_of(image("A"), image("B"))
    params = {"d1": {"metadata": meta(1, 1)}, "d2": {"metadata": meta(2, 2)}}
    with pytest.raises(ProxyError, match="cannot be matched") as err:
        match_group(items, ["a", "b"], params, Matches())
    assert err.value.status == 502


def test_single_item_groups_ignore_indices():
    [item] = items_of(image("A"))
    matches = Matches()
    match_group([item], ["t"], {"h": {"metadata": meta(1, 1), "item_indices": [5]}}, matches)
    assert matches.items[0].ec_mm_hash == "h"


def test_empty_params_match_nothing_and_non_dict_values_are_skipped():
    items = items_of(image("A"))
    matches = Matches()
    match_group(items, ["t"], None, matches)
    match_group(items, ["t"], {}, matches)
    assert matches.items == {}
    match_group(items, ["t"], {"ec_items": [1, 2], "h": {"metadata": meta(1, 1)}}, matches)
    assert matches.items[0].ec_mm_hash == "h" and "ec_items" not in matches.handles


def test_video_with_audio_stays_raw_only_without_handles():
    [item] = items_of(video("v"), mm_processor_kwargs={"use_audio_in_video": True})
    two = {"hv": {"metadata": {"video_grid_thw": [[2, 4, 4]]}}, "ha": {"metadata": {}}}
    matches = Matches()
    match_group([item], ["t"], two, matches, audio_in_video=True)
    assert matches.items == {}
    with pytest.raises(ProxyError, match="cannot be matched"):
        match_group([item], ["t"], two, Matches(), audio_in_video=True, push_mode=True)
    with_handles = {k: {**v, "peer_host": "h"} for k, v in two.items()}
    with pytest.raises(ProxyError, match="cannot be matched"):
        match_group([item], ["t"], with_handles, Matches(), audio_in_video=True)


def test_only_non_dict_values_leave_the_group_raw_instead_of_failing():
    # An older encoder reports a bare list and no per-hash entries: nothing to map, nothing wrong.
    items = items_of(image("A"), image("B"))
    matches = Matches()
    match_group(items, ["ta", "tb"], {"ec_items": [{"mm_hash": "x"}, {"mm_hash": "y"}]}, matches)
    assert matches.items == {} and matches.handles == {}


def test_unmatched_items_keep_their_transfer_ids_in_push_mode():
    a, b, a2 = items_of(image("A"), image("B"), image("A"))
    matches = Matches()
    match_group(
        [a, a2], ["t0", "t2"], {"hA": {"metadata": meta(1, 1), "item_indices": [0, 1]}}, matches, push_mode=True
    )
    match_group([b], ["t1"], {"ec_items": ["legacy"]}, matches, push_mode=True)
    assert [(matches.items[i].ec_mm_hash, matches.items[i].transfer_id) for i in range(3)] == [
        ("hA", "t0"),
        (None, "t1"),
        ("hA", "t2"),
    ]
    assert matches.items[1].metadata == {}


# -- a coalesced sub-request's answer, cut back into its requests' shares ------------------------


def encoder_answer(names: list[str]) -> dict:
    """What an encoder reports for media named `names` in this order (vLLM's
    collect_ec_item_metadata: one entry per identifier, every occurrence's position)."""
    params: dict = {}
    for position, name in enumerate(names):
        entry = params.setdefault(f"hash-{name}", {"metadata": meta(len(name), 2), "peer_port": 7})
        entry.setdefault("item_indices", []).append(position)
    return params


@settings(max_examples=300, deadline=None)
@given(groups=st.lists(st.lists(st.sampled_from("ABCDE"), min_size=1, max_size=4), min_size=1, max_size=5))
def test_each_request_matches_a_shared_answer_as_if_it_had_been_sent_alone(groups):
    combined = [name for group in groups for name in group]
    shares = split_params(encoder_answer(combined), [len(group) for group in groups], "http://e")
    for group, share in zip(groups, shares):
        items = items_of(*(image(name) for name in group))
        ids = [f"t{i}" for i in range(len(group))]
        shared, alone = Matches(), Matches()
        match_group(items, ids, share, shared)
        match_group(items, ids, encoder_answer(group), alone)
        assert shared.items == alone.items
        assert shared.handles == alone.handles


def test_a_shared_answer_without_positions_or_with_bad_ones_is_502():
    good = encoder_answer(["A", "B", "A"])
    for params in (
        {"hash-A": {"metadata": {}}, "hash-B": {"metadata": {}}},
        {**good, "hash-A": {**good["hash-A"], "item_indices": [0, 3]}},
        {**good, "hash-A": {**good["hash-A"], "item_indices": [0, 1]}},
        {**good, "hash-A": {**good["hash-A"], "item_indices": [0]}},
        {**good, "hash-A": {**good["hash-A"], "item_indices": [True, 2]}},
    ):
        with pytest.raises(ProxyError) as err:
            split_params(params, [2, 1], "http://e")
        assert (err.value.status, err.value.stage) == (502, "match")


def test_a_shared_answer_with_nothing_usable_leaves_every_request_raw():
    assert split_params(None, [1, 2]) == [None, None]
    assert split_params({"ec_items": [{"mm_hash": "x"}]}, [1, 1]) == [None, None]
