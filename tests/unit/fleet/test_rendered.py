"""A rendered prompt's block chain, keyed as vLLM keys the blocks it stores (rendered.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epd_proxy.fleet.kv_names import block_name
from epd_proxy.fleet.rendered import Item, Rendered, parse_render
from epd_proxy_tools.testing.fake_kv_events import Feature, block_extra_keys


def test_an_image_is_keyed_in_every_block_it_overlaps_by_where_it_starts_relative_to_the_block():
    # What vLLM 0.32 published for 64 image tokens at 45 in a 144-token prompt, 32-token blocks
    # (shared/notes/kv-events.md): only the 4 full blocks, the image's offset from each block's start.
    rendered = Rendered(list(range(144)), [Item("img-8152", 45, 64)])
    extras = [extra for _, extra in rendered.blocks(32)]
    assert extras == [None, (("img-8152", 13),), (("img-8152", -19),), (("img-8152", -51),)]
    assert [len(tokens) for tokens, _ in rendered.blocks(32)] == [32] * 4


def test_two_items_in_one_block_and_the_salt_on_the_first_block_only():
    rendered = Rendered(list(range(64)), [Item("a", 2, 4), Item("b", 6, 30)], cache_salt="tenant-x")
    assert [extra for _, extra in rendered.blocks(32)] == [(("a", 2), ("b", 6), "tenant-x"), (("b", -26),)]


def test_a_lora_adapters_name_leads_every_blocks_keys_as_vllm_published_them():
    # What vLLM 0.32 published for a request of the adapter `ada` (--enable-lora --lora-modules
    # ada=...): 256 prompt tokens, 4 image tokens at 241, 32-token blocks; the pair is a list as
    # msgpack decodes it. The base model's request of the same prompt had None, ..., (pair,).
    rendered = Rendered(list(range(256)), [Item("img-one", 241, 4)], lora_name="ada")
    published = [("ada",)] * 7 + [("ada", ["img-one", 17])]
    assert [extra for _, extra in rendered.blocks(32)] == [("ada",)] * 7 + [("ada", ("img-one", 17))]
    parent = None
    for name, (tokens, _), extra in zip(rendered.names(32), rendered.blocks(32), published, strict=True):
        parent = block_name(parent, tokens, extra)
        assert name == parent
    base = Rendered(list(range(256)), [Item("img-one", 241, 4)])
    assert not set(base.names(32)) & set(rendered.names(32))


def test_names_chain_each_block_to_its_parent_and_are_made_once_per_block_size():
    rendered = Rendered(list(range(100)), [Item("a", 40, 10)])
    names = rendered.names(32)
    blocks = list(rendered.blocks(32))
    parent = None
    for name, (tokens, extra) in zip(names, blocks, strict=True):
        assert name == block_name(parent, tokens, extra)
        parent = name
    assert rendered.names(32) is names
    assert len(rendered.names(16)) == 6 and rendered.names(0) == []


items = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 80)), max_size=6)


@given(items, st.integers(1, 64), st.sampled_from([None, "s"]), st.sampled_from([None, "ada"]))
def test_the_keys_agree_with_the_fake_consumers_blocks(spans, block_size, salt, lora):
    # The fake PD (fake_kv_events.py) stores its blocks under these keys, written apart from
    # rendered.py; items do not overlap one another in a prompt.
    spans = sorted(spans)
    features, end = [], 0
    for n, (gap, length) in enumerate(spans):
        features.append(Feature(f"m{n}", end + gap, length))
        end += gap + length
    tokens = list(range(end + 40))
    rendered = Rendered(tokens, [Item(*f) for f in features], cache_salt=salt, lora_name=lora)
    first = 0
    for b, (_, extra) in enumerate(rendered.blocks(block_size)):
        start = b * block_size
        expected, first = block_extra_keys(features, start, start + block_size, salt, first, lora)
        assert extra == expected


def answer(**overrides):
    base = {
        "token_ids": [1, 2, 3, 4, 5, 6],
        "features": {
            "mm_hashes": {"image": ["i1"], "audio": ["a1"]},
            "mm_placeholders": {"image": [{"offset": 3, "length": 2}], "audio": [{"offset": 0, "length": 2}]},
        },
        "cache_salt": None,
    }
    return {**base, **overrides}


def test_a_render_answer_gives_its_tokens_and_its_items_in_token_order_whatever_their_modality():
    rendered = parse_render(answer(cache_salt="s"))
    assert rendered is not None
    assert list(rendered.tokens) == [1, 2, 3, 4, 5, 6]
    assert rendered.items == [Item("a1", 0, 2), Item("i1", 3, 2)]
    assert rendered.cache_salt == "s"
    assert parse_render(answer(features=None)).items == []


@pytest.mark.parametrize(
    "lie",
    [
        [],
        {"token_ids": []},
        {"token_ids": [1, -2]},
        {"token_ids": [1, True]},
        {"token_ids": "123"},
        {"features": []},
        {"features": {"mm_hashes": {"image": ["i1"]}, "mm_placeholders": {}}},
        {
            "features": {
                "mm_hashes": {"image": ["i1", "i2"]},
                "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
            }
        },
        {"features": {"mm_hashes": {"image": ["i1"]}, "mm_placeholders": {"image": [{"offset": 5, "length": 4}]}}},
        {"features": {"mm_hashes": {"image": ["i1"]}, "mm_placeholders": {"image": [{"offset": -1, "length": 1}]}}},
        {"features": {"mm_hashes": {"image": ["x" * 300]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}},
        {"features": {"mm_hashes": {"image": [7]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}},
    ],
)
def test_what_is_not_a_rendered_prompt_is_none(lie):
    assert parse_render(lie if isinstance(lie, list) else answer(**lie)) is None
