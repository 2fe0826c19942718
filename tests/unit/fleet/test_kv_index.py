"""The index of what each engine holds (kv_index.py), driven by events built by hand and a clock
the test moves: our own block names, prefixes, media, removal, clears, staleness and the cap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.fleet import kv_index
from epd_proxy.fleet.kv_index import CHAINS_PER_MEDIA, FRESH, NONE, STALE, KvIndex
from epd_proxy.fleet.kv_names import chain, media_key
from epd_proxy.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
A, B = ("http://pd-a:8000", 0), ("http://pd-b:8000", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def blocks(n: int, start: int = 0, media: dict[int, list] | None = None) -> list[tuple[list[int], list | None]]:
    """n blocks of BS tokens; `media` gives some blocks their extra keys."""
    media = media or {}
    return [(list(range(start + i * BS, start + (i + 1) * BS)), media.get(i)) for i in range(n)]


def stored(
    hashes: list[int], prompt: list, parent: int | None = None, group: int = 0, lora: str | None = None
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[t for tokens, _ in prompt for t in tokens],
        block_size=BS,
        medium="GPU",
        extra_keys=[extra for _, extra in prompt] if any(extra for _, extra in prompt) else None,
        group_idx=group,
        lora_name=lora,
    )


def fresh_index(*engines, clock: Clock | None = None, **options) -> KvIndex:
    index = KvIndex(clock=clock or Clock(), **options)
    for engine in engines:
        index.watch(engine)
        index.heard(engine)
    return index


def test_the_engines_hashes_only_map_to_our_names():
    prompt = blocks(3)
    names = chain(prompt)
    index = fresh_index(A, B)
    index.apply(A, [stored([11, 12, 13], prompt)])
    index.apply(B, [stored([-7, 99, 5], prompt)])  # another seed: other hashes, same content
    assert index.prefix_blocks(A, names) == index.prefix_blocks(B, names) == 3


def test_the_leading_blocks_held_count_until_the_first_missing_one():
    prompt = blocks(4)
    names = chain(prompt)
    index = fresh_index(A)
    index.apply(A, [stored([1, 2], prompt[:2])])
    # Continued in a later event from its parent's engine hash.
    index.apply(A, [stored([3], [prompt[2]], parent=2)])
    assert index.prefix_blocks(A, names) == 3
    index.apply(A, [BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0)])
    assert index.prefix_blocks(A, names) == 1
    assert index.prefix_blocks(A, chain(blocks(2, start=1000))) == 0


def test_a_block_under_an_unknown_parent_is_not_indexed():
    index = fresh_index(A)
    applied = index.apply(A, [stored([7, 8], blocks(2, start=8), parent=12345)])
    assert applied.orphans == 2 and applied.stored == 0 and index.size(A) == 0


def test_a_block_held_in_two_groups_stays_until_both_removed():
    prompt = blocks(1)
    index = fresh_index(A)
    index.apply(A, [stored([1], prompt, group=0), stored([1], prompt, group=1)])
    index.apply(A, [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=1)])
    assert index.prefix_blocks(A, chain(prompt)) == 1
    index.apply(A, [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)])
    assert index.prefix_blocks(A, chain(prompt)) == 0


def test_an_image_counts_once_its_last_block_and_the_whole_chain_to_it_are_held():
    # Text, then an image over blocks 1 and 2, then text: vLLM's extra keys give the offsets.
    image = {1: [["img-1", 2]], 2: [["img-1", -2]]}
    prompt = blocks(4, media=image)
    index = fresh_index(A, B)
    index.apply(A, [stored([1, 2, 3, 4], prompt)])
    assert index.media_holders("img-1") == [A]
    assert index.media_prefix(A, "img-1") == 3
    assert index.media_prefix(B, "img-1") == 0
    # Without its first block no prompt reaches the image's blocks through a held prefix.
    index.apply(A, [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)])
    assert index.media_prefix(A, "img-1") == 0
    assert index.media_holders("img-1") == [A]  # it still holds blocks of it

    # Stored up to the image's second block only: where the image ends is not known yet.
    index.apply(B, [stored([21, 22, 23], prompt[:3])])
    assert index.media_prefix(B, "img-1") == 0
    index.apply(B, [stored([24], prompt[3:], parent=23)])
    assert index.media_prefix(B, "img-1") == 3
    index.apply(B, [BlockRemoved(block_hashes=[23], medium="GPU", group_idx=0)])
    assert index.media_prefix(B, "img-1") == 0
    assert index.media_holders("img-1") == [A, B]
    index.apply(B, [BlockRemoved(block_hashes=[22], medium="GPU", group_idx=0)])
    assert index.media_holders("img-1") == [A]


def test_an_image_in_an_adapters_blocks_is_held_for_that_adapter_only():
    # vLLM 0.32 leads every block's extra keys of a LoRA request with the adapter's name, and says
    # it in the event's `lora_name`.
    prompt = blocks(4, media={0: ["ada"], 1: ["ada", ["img-1", 2]], 2: ["ada", ["img-1", -2]], 3: ["ada"]})
    index = fresh_index(A, B)
    assert index.adapter("ada") is None  # not heard of: taken for the base model
    index.apply(A, [stored([1, 2, 3, 4], prompt, lora="ada")])
    assert index.adapter("ada") == "ada" and index.adapter("base") is None
    assert index.media_prefix(A, media_key("img-1", "ada")) == 3
    # The base model's prompt through the same image reuses none of the adapter's blocks.
    assert index.media_prefix(A, "img-1") == 0 and index.media_holders("img-1") == []
    assert index.media_prefix(A, media_key("img-1", "other")) == 0
    index.apply(B, [stored([5, 6, 7, 8], blocks(4, media={1: [["img-1", 2]], 2: [["img-1", -2]]}))])
    assert index.media_prefix(B, "img-1") == 3 and index.media_prefix(B, media_key("img-1", "ada")) == 0
    assert index.holders([media_key("img-1", "ada")]) == {A}


def test_an_adapter_is_learnt_from_any_block_it_stored_and_the_oldest_forgotten_past_the_cap(monkeypatch):
    monkeypatch.setattr(kv_index, "MAX_ADAPTERS", 2)
    index = fresh_index(A)
    index.apply(A, [stored([1], blocks(1, media={0: ["text-only"]}), lora="text-only")])
    assert index.adapter("text-only") == "text-only"
    index.apply(A, [stored([2], blocks(1, start=100), lora="b"), stored([3], blocks(1, start=200), lora="c")])
    assert [index.adapter(name) for name in ("text-only", "b", "c")] == [None, "b", "c"]
    # A name vLLM would not send is none.
    index.apply(A, [stored([4], blocks(1, start=300), lora="x\0y")])
    assert index.adapter("x\0y") is None and index.adapter("b") == "b"


def test_all_blocks_cleared_empties_the_engine_and_no_other():
    prompt = blocks(2)
    index = fresh_index(A, B)
    index.apply(A, [stored([1, 2], prompt)])
    index.apply(B, [stored([1, 2], prompt)])
    applied = index.apply(A, [AllBlocksCleared()])
    assert applied.cleared == 1 and index.size(A) == 0 and index.complete(A)
    assert index.prefix_blocks(B, chain(prompt)) == 2 and index.blocks == 2


def test_an_engine_turns_stale_on_trouble_or_silence_and_queries_then_say_so():
    clock = Clock()
    index = KvIndex(clock=clock, stale_after_s=10.0)
    assert index.state(A) == NONE
    index.watch(A)
    assert index.state(A) == STALE  # not heard from yet
    index.heard(A)
    index.apply(A, [stored([1], blocks(1), group=0)])
    assert index.state(A) == FRESH and index.prefix_blocks(A, chain(blocks(1))) == 1
    clock.now += 10.5
    assert index.state(A) == STALE and index.why_stale(A) == "nothing heard for over 10s"
    assert index.prefix_blocks(A, chain(blocks(1))) is None and index.media_prefix(A, "x") is None
    index.heard(A)
    assert index.state(A) == FRESH
    assert index.stale(A, "gap") is True and index.state(A) == STALE and index.why_stale(A) == "gap"
    assert index.stale(A, "gap again") is False  # already stale: one transition
    index.heard(A)
    assert index.state(A) == FRESH
    index.forget(A)
    assert index.state(A) == NONE and index.blocks == 0


def test_a_token_forgets_only_its_own_feeds_engine():
    index = KvIndex(clock=Clock())
    old = index.watch(A)
    index.watch(A)  # a newer feed took the engine over
    index.forget(A, old)
    assert index.state(A) != NONE
    index.forget(A)
    assert index.state(A) == NONE


def test_the_cap_drops_the_oldest_entries_over_every_engine_and_counts_them():
    index = fresh_index(A, B, max_blocks=32)
    index.apply(A, [stored([1, 2, 3, 4], blocks(4))])  # A's four oldest
    index.apply(B, [stored(list(range(100, 120)), blocks(20, start=1000))])
    index.apply(A, [stored([1], blocks(1))])  # reused: block 1 is A's newest now
    assert index.blocks == 24 and index.evictions == 0
    applied = index.apply(B, [stored(list(range(200, 210)), blocks(10, start=5000))])
    # 34 > 32: down to 32 - 32 // 16 = 30 at once, the oldest first: A's 2, 3, 4, then B's 100.
    assert applied.evicted == 4 and index.evictions == 4 and index.blocks == 30
    assert index.size(A) == 1 and index.prefix_blocks(A, chain(blocks(1))) == 1
    assert index.prefix_blocks(B, chain(blocks(20, start=1000))) == 0
    assert index.size(B) == 29
    for _ in range(50):  # it stays bounded however much more comes
        index.apply(B, [stored(list(range(300, 340)), blocks(40, start=9000))])
        index.apply(B, [BlockRemoved(block_hashes=list(range(300, 340)), medium="GPU", group_idx=0)])
    assert index.blocks <= 32


def test_a_malformed_store_is_skipped_not_raised():
    index = fresh_index(A)
    short = BlockStored(block_hashes=[1, 2], token_ids=[1, 2, 3], block_size=BS, medium="GPU")
    zero = BlockStored(block_hashes=[1], token_ids=[1], block_size=0, medium="GPU")
    assert index.apply(A, [short, zero]).orphans == 3 and index.size(A) == 0


def test_media_prefixes_answer_each_item_and_share_the_walk_up_its_chain():
    images = {1: [["img-1", 0]], 3: [["img-2", 0]]}
    prompt = blocks(5, media=images)
    index = fresh_index(A)
    index.apply(A, [stored([1, 2, 3, 4, 5], prompt)])
    assert index.media_prefixes(A, ["img-1", "img-2", "img-3"]) == [2, 4, 0]
    index.apply(A, [BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0)])
    assert index.media_prefixes(A, ["img-2", "img-1"]) == [0, 2]
    assert fresh_index(B).media_prefixes(A, ["img-1"]) is None


def test_an_image_on_many_chains_is_looked_for_on_the_newest_only():
    index = fresh_index(A)
    # The oldest chain holds the image deepest (after 8 blocks of text), then 40 others each hold
    # it after one block of text of their own: a request walks the newest CHAINS_PER_MEDIA.
    deep = blocks(10, start=0, media={8: [["img", 0]]})
    index.apply(A, [stored(list(range(1, 11)), deep)])
    for i in range(40):
        shallow = blocks(3, start=1000 * (i + 1), media={1: [["img", 0]]})
        index.apply(A, [stored([100 * (i + 1) + k for k in range(3)], shallow)])
    assert index.media_prefixes(A, ["img"]) == [2]
    assert 40 >= CHAINS_PER_MEDIA


def test_the_deepest_whole_chain_through_an_image_answers_though_a_deeper_one_is_broken():
    index = fresh_index(A)
    index.apply(A, [stored(list(range(1, 11)), blocks(10, start=0, media={8: [["img", 0]]}))])
    index.apply(A, [stored([21, 22, 23], blocks(3, start=5000, media={1: [["img", 0]]}))])
    assert index.media_prefixes(A, ["img"]) == [9]
    index.apply(A, [BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0)])
    # The chain holding the image at its 9th block lost its 5th; the other holds it at its 2nd.
    assert index.media_prefixes(A, ["img"]) == [2]


C = ("http://pd-c:8000", 0)
IMAGES = ["img-0", "img-1", "img-2"]


def image_prompt(first: int, image: str) -> list:
    """Three blocks from token `first`, the middle one holding `image`."""
    return blocks(3, start=first, media={1: [[image, 0]]})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear", "rewatch", "forget"]),
            st.sampled_from([A, B, C]),
            st.integers(0, 5),
            st.sampled_from(IMAGES),
        ),
        max_size=40,
    )
)
def test_the_holders_of_each_image_and_the_answers_kept_follow_every_change(operations):
    index = fresh_index(A, B, C, max_blocks=20)
    for op, engine, n, image in operations:
        hashes = [10 * n + 1, 10 * n + 2, 10 * n + 3]
        if op == "store":
            index.apply(engine, [stored(hashes, image_prompt(1000 * n, image))])
        elif op == "remove":
            index.apply(engine, [BlockRemoved(block_hashes=hashes[1:2], medium="GPU", group_idx=0)])
        elif op == "clear":
            index.apply(engine, [AllBlocksCleared()])
        elif op == "rewatch":  # the engine restarted: a new feed
            index.watch(engine)
        else:
            index.forget(engine)
        for media_id in IMAGES:
            holding = {e for e, record in index._engines.items() if media_id in record.media}
            assert index.holders([media_id]) == holding
        for e, record in index._engines.items():
            # Answers kept between the engine's changes are the answers a fresh walk gives.
            kept = index.media_prefixes(e, IMAGES)
            record.answers.clear()
            assert index.media_prefixes(e, IMAGES) == kept
    assert index.holders(IMAGES) == {e for e, record in index._engines.items() if record.media}


def branching_prompt(variant: int) -> tuple[list[int], list]:
    """Six blocks: three every variant shares, then three of its own; the engine's hashes too."""
    prompt = blocks(3) + blocks(3, start=1000 * (variant + 1))
    return [1, 2, 3] + [100 * variant + k for k in (4, 5, 6)], prompt


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 3), st.integers(0, 5)),
        max_size=30,
    )
)
def test_the_blocks_held_are_counted_from_the_first_however_blocks_were_dropped(operations):
    index = fresh_index(A)
    for op, variant, position in operations:
        hashes, prompt = branching_prompt(variant)
        if op == "store":
            index.apply(A, [stored(hashes, prompt)])
        elif op == "remove":  # any block, the middle of a chain included
            index.apply(A, [BlockRemoved(block_hashes=[hashes[position]], medium="GPU", group_idx=0)])
        else:
            index.apply(A, [AllBlocksCleared()])
        held = index._engines[A].held
        for asked in range(4):
            names = chain(branching_prompt(asked)[1])
            walked = next((k for k, name in enumerate(names) if name not in held), len(names))
            assert index.prefix_blocks(A, names) == walked
            assert index.prefix_blocks(A, names[:4]) == min(walked, 4)
