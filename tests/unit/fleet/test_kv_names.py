"""Our names of blocks and media items (kv_names.py), from extra keys as vLLM 0.32 publishes them."""

from __future__ import annotations

from epd_proxy.fleet.kv_names import MAX_ID_CHARS, block_name, chain, media_in, media_key


def test_our_names_chain_the_parent():
    prompt = [([1, 2], None), ([3, 4], None), ([5, 6], None)]
    names = chain(prompt)
    assert names[1] == block_name(names[0], prompt[1][0], None)
    assert len(set(names)) == 3 and all(len(name) == 16 for name in names)
    # Tuples as a caller writes them and lists as msgpack decodes them name a block alike.
    assert block_name(None, (1, 2), (("img", 3),)) == block_name(None, [1, 2], [["img", 3]])
    # The same tokens after another parent, or with other extra keys, are another block.
    assert block_name(names[0], prompt[0][0], None) != names[0]
    assert block_name(None, prompt[0][0], [["img", 0]]) != names[0]


def test_media_identifiers_come_from_the_pairs_among_the_extra_keys():
    assert media_in(None) == media_in([]) == ()
    assert media_in([["img-1", 13], b"\x00digest", ["img-2", -19], "salt"]) == ("img-1", "img-2")
    # Not vLLM's: too long, or holding the NUL that separates an adapter's name.
    assert media_in([["x" * (MAX_ID_CHARS + 1), 0], ["ada\0img", 0], ["img-3", 0]]) == ("img-3",)


def test_an_adapters_media_are_named_with_it():
    # vLLM's order: the LoRA name, the items' pairs, the cache salt (first block only).
    assert media_in(["ada", ["img-1", 13], "salt"], "ada") == (media_key("img-1", "ada"),)
    assert media_key("img-1", "ada") != "img-1" == media_key("img-1", None)
    assert media_key("img-1", "ada") != media_key("img-1", "ada2")
    # An adapter's name vLLM would not send: its media count for no one.
    assert media_in(["a" * (MAX_ID_CHARS + 1), ["img-1", 0]], "a" * (MAX_ID_CHARS + 1)) == ()
    assert media_in(["x\0y", ["img-1", 0]], "x\0y") == ()
