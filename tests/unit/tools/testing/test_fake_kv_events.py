"""The fake consumer's block cache stores, reuses and evicts blocks when vLLM 0.32's block pool does
(vllm/v1/core/block_pool.py, kv_cache_manager.py), and says so in its events' shapes."""

from __future__ import annotations

from typing import Any

from epd_proxy_tools.testing.fake_kv_events import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    Feature,
    Prompt,
    tokenize,
)


def prompt(length: int, features: list[Feature] = (), seed: int = 0) -> Prompt:
    return Prompt([(seed + i) % 256 for i in range(length)], list(features), [length])


def serve(pool: BlockPool, p: Prompt, generated: int = 1, salt: str | None = None) -> tuple[Any, list[Any]]:
    events: list[Any] = []
    served = pool.serve(p, [7] * generated, salt, events)
    return served, events


def test_only_full_blocks_are_stored_with_each_items_uuid_and_offset_per_block():
    # What the real engine published for an image with uuid img-8152 in a 144-token prompt with
    # 32-token blocks: its 64 placeholder tokens start at token 45 (13 into the second block).
    pool = BlockPool(64, 32)
    served, events = serve(pool, prompt(144, [Feature("img-8152", 45, 64)]))
    (stored,) = events
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == 4 and len(stored.token_ids) == 128
    assert stored.parent_block_hash is None and stored.block_size == 32 and stored.medium == "GPU"
    assert stored.extra_keys == [None, (("img-8152", 13),), (("img-8152", -19),), (("img-8152", -51),)]
    assert (stored.group_idx, stored.lora_id, stored.lora_name) == (0, None, None)
    assert served.cached_tokens == 0 and served.created_tokens == 128


def test_the_same_prompt_again_reuses_its_full_blocks_and_stores_nothing_new():
    pool = BlockPool(64, 32)
    serve(pool, prompt(144))
    served, events = serve(pool, prompt(144))
    assert served.cached_tokens == 128 and served.created_tokens == 0
    assert events == []


def test_the_block_holding_the_prompts_last_token_is_recomputed_and_stored_again():
    # vLLM reuses at most prompt length - 1 tokens: a two-block prompt reuses one block, and the
    # recomputed second block is stored again under the hash it already had.
    pool = BlockPool(64, 32)
    _, (first,) = serve(pool, prompt(64))
    served, (again,) = serve(pool, prompt(64))
    assert served.cached_tokens == 32
    assert again.block_hashes == first.block_hashes[1:] and again.parent_block_hash == first.block_hashes[0]


def test_generated_tokens_fill_blocks_stored_one_by_one_after_the_prompts():
    pool = BlockPool(64, 16)
    _, events = serve(pool, prompt(20), generated=30)  # 49 tokens computed: 3 full blocks
    assert [len(e.block_hashes) for e in events] == [1, 1, 1]
    assert events[1].parent_block_hash == events[0].block_hashes[0]
    assert events[2].parent_block_hash == events[1].block_hashes[0]
    assert events[2].token_ids[-1] == 7


def test_the_least_recently_used_blocks_go_first_a_requests_tail_before_its_head():
    pool = BlockPool(4, 16)
    _, (a,) = serve(pool, prompt(33, seed=1))  # blocks A0 A1 and a partial one
    _, events = serve(pool, prompt(33, seed=2))  # three blocks: the free one, then A's tail first
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[a.block_hashes[1]]]
    assert isinstance(events[-1], BlockStored) and events.index(removed[0]) < events.index(events[-1])
    # A0 is still cached: A's prompt reuses it, evicting what B left at the head of the queue.
    served, _ = serve(pool, prompt(33, seed=1))
    assert served.cached_tokens == 16


def test_a_cache_salt_keys_the_first_block_and_isolates_the_prefix():
    pool = BlockPool(64, 16)
    _, (plain,) = serve(pool, prompt(40))
    served, (salted,) = serve(pool, prompt(40), salt="tenant-a")
    assert served.cached_tokens == 0 and salted.block_hashes[0] != plain.block_hashes[0]
    assert salted.extra_keys == [("tenant-a",), None]


def test_clearing_sends_all_blocks_cleared_and_nothing_is_reused_after():
    pool = BlockPool(64, 16)
    serve(pool, prompt(40))
    events: list[Any] = []
    pool.clear(events)
    assert events == [AllBlocksCleared()] and pool.cached() == set()
    served, _ = serve(pool, prompt(40))
    assert served.cached_tokens == 0


def test_the_fakes_prompt_marks_roles_spells_text_in_bytes_and_places_media():
    p = tokenize([("<user>", 1, "role"), ("hé", 1, "text"), ("img-1", 6, "image"), ("x", 1, "text")])
    assert p.tokens[:6] == [256, *b"user", 10]
    assert p.features == [Feature("img-1", 9, 6)] and p.tokens[9:15] == [258] * 6
    assert p.ends == [6, 9, 15, 16] and p.tokens[16:] == [256, *b"assistant", 10]
