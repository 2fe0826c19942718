"""Properties of the pure core, for any input hypothesis can think of."""

from __future__ import annotations

import copy
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.errors import BadRequest
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.routing import RoundRobin
from epd_proxy.journey.extract import EMBEDS_TYPE, REFERENCE_KINDS, normalise_request
from epd_proxy.journey.match import Matches, match_group
from epd_proxy.journey.plan import plan_groups
from epd_proxy.journey.rewrite import rewrite_request
from epd_proxy.journey.subrequest import encoder_body
from epd_proxy_tools.testing.fake_vllm import vllm_part_kind
from tests.matching import every_item_matched

KINDS = st.sampled_from(["image_url", "image_url", "image_url", "audio_url", "video_url", "input_audio"])
NAMES = st.sampled_from("ABCDEFGH")


def part(kind: str, name: str) -> dict:
    if kind == "input_audio":
        return {"type": kind, "input_audio": {"data": name * 4, "format": "wav"}}
    return {"type": kind, kind: {"url": f"https://m/{name}"}}


texts = st.text(max_size=20).map(lambda t: {"type": "text", "text": t})
media = st.tuples(KINDS, NAMES).map(lambda kn: part(*kn))
contents = st.lists(st.one_of(texts, media), max_size=8)
messages = st.lists(
    st.one_of(st.text(max_size=10), contents).map(lambda c: {"role": "user", "content": c}), min_size=1, max_size=4
)
bodies = st.builds(lambda ms, seed: {"model": "m", "messages": ms, "seed": seed}, messages, st.integers(0, 9))


@settings(max_examples=300, deadline=None)
@given(body=bodies, n_encoders=st.integers(1, 5), cap=st.integers(0, 4), cursor=st.integers(0, 10))
def test_plan_covers_every_item_once_keeps_round_robin_order_and_respects_the_cap(body, n_encoders, cap, cursor):
    items = normalise_request(body).items
    encoders = [Instance(f"http://e{i}", "encode") for i in range(n_encoders)]
    policy = RoundRobin()
    policy.choose(encoders, ["warm"] * cursor)
    assignment = policy.choose(encoders, [i.uuid for i in items])
    assert assignment == [encoders[(cursor + k) % n_encoders] for k in range(len(items))]
    groups = plan_groups(items, assignment, cap)
    covered = sorted(i for g in groups for i in g.indices)
    assert covered == list(range(len(items)))
    for group in groups:
        assert all(assignment[i] is group.encoder for i in group.indices)
        assert list(group.indices) == sorted(group.indices)
        if len(group.indices) > 1:
            assert all(items[i].kind == "image_url" for i in group.indices)
        if cap:
            assert len(group.indices) <= cap


def encoder_reply(group_items, derive: bool) -> dict:
    """What an encoder reports: one key per distinct item, all positions under it."""
    params: dict = {}
    for position, item in enumerate(group_items):
        key = f"derived-{item.uuid}" if derive else item.uuid
        entry = params.setdefault(key, {"metadata": {"grid": [[1, position + 1, 2]]}, "item_indices": []})
        entry["item_indices"].append(position)
    return params


@settings(max_examples=200, deadline=None)
@given(names=st.lists(NAMES, min_size=1, max_size=10), derive=st.booleans(), seed=st.integers(0, 1000))
def test_any_permutation_of_response_keys_maps_back_identically(names, derive, seed):
    items = normalise_request({"messages": [{"role": "user", "content": [part("image_url", n) for n in names]}]}).items
    params = encoder_reply(items, derive)
    ids = [f"t{i}" for i in range(len(items))]
    reference = Matches()
    match_group(items, ids, params, reference)
    keys = list(params)
    random.Random(seed).shuffle(keys)
    shuffled = Matches()
    match_group(items, ids, {k: params[k] for k in keys}, shuffled)
    assert shuffled.items == reference.items and shuffled.handles == reference.handles
    for position, item in enumerate(items):
        expected = f"derived-{item.uuid}" if derive else item.uuid
        assert reference.items[item.index].ec_mm_hash == expected
        assert reference.items[item.index].transfer_id == ids[position]


@settings(max_examples=300, deadline=None)
@given(body=bodies, matched_mask=st.lists(st.booleans(), max_size=40), rewrite=st.booleans())
def test_rewriting_never_touches_non_media_content_and_never_mutates_its_input(body, matched_mask, rewrite):
    items = normalise_request(body).items
    matches = Matches()
    for item, hit in zip(items, matched_mask):
        if hit:
            match_group([item], [f"t{item.index}"], {f"h{item.index}": {"metadata": {"g": [[1, 2, 3]]}}}, matches)
    before = copy.deepcopy(body)
    out = rewrite_request(body, items, matches, rewrite=rewrite)
    assert body == before
    assert {k: v for k, v in out.items() if k not in ("messages", "ec_transfer_params")} == {
        k: v for k, v in body.items() if k != "messages"
    }
    media_positions = {(i.place.entry, i.place.part) for i in items}
    assert len(out["messages"]) == len(body["messages"])
    for m, (new, old) in enumerate(zip(out["messages"], body["messages"])):
        assert {k: v for k, v in new.items() if k != "content"} == {k: v for k, v in old.items() if k != "content"}
        if not isinstance(old["content"], list):
            assert new["content"] == old["content"]
            continue
        for p, (new_part, old_part) in enumerate(zip(new["content"], old["content"])):
            if (m, p) not in media_positions:
                assert new_part == old_part
    if rewrite:
        hits = [i for i in items if i.index in matches.items]
        referenced = [
            p
            for msg in out["messages"]
            if isinstance(msg["content"], list)
            for p in msg["content"]
            if p.get("type", "").endswith("_embeds")
        ]
        has_audio_gap = any(i.kind in ("audio_url", "input_audio") for i in items) and len(hits) < len(items)
        # vLLM refuses raw media and embeddings of one modality together: a gap keeps its modality raw
        gaps = {EMBEDS_TYPE[i.kind] for i in items if i.index not in matches.items}
        kept = [i for i in hits if EMBEDS_TYPE[i.kind] not in gaps]
        assert len(referenced) == (0 if has_audio_gap else len(kept))
        assert not {p["type"] for p in referenced} & gaps


# Adversarial parts: any mix of kind keys, with or without `type` and `uuid`, as a client may send.
PART_KEYS = {
    "image_url": st.sampled_from([{"url": "https://m/A"}, "https://m/B", {}, None]),
    "audio_url": st.just({"url": "https://m/C.wav"}),
    "video_url": st.just({"url": "https://m/D.mp4"}),
    "input_audio": st.just({"data": "AAAA", "format": "wav"}),
    "image_embeds": st.just({"image_grid_thw": [1, 4, 4]}),
    "audio_embeds": st.just({}),
    "video_embeds": st.just({}),
    "prompt_embeds": st.just({}),
    "image_pil": st.none(),
    "text": st.just("hi"),
    "data": st.just("AAAA"),
}
TYPES = st.sampled_from([None, "", "text", "image_url", "input_image", "image_embeds", "input_audio", "video_url"])
adversarial_parts = st.builds(
    lambda chosen, part_type, uuid: {
        **chosen,
        **({} if part_type is None else {"type": part_type}),
        **({} if uuid is None else {"uuid": uuid}),
    },
    st.dictionaries(st.sampled_from(sorted(PART_KEYS)), st.none(), max_size=3).flatmap(
        lambda keys: st.fixed_dictionaries({k: PART_KEYS[k] for k in keys})
    ),
    TYPES,
    st.sampled_from([None, "client-uuid", "0" * 64]),
)


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(adversarial_parts, min_size=1, max_size=5), rewrite=st.booleans())
def test_nothing_forwarded_names_a_reference_or_uuid_the_proxy_did_not_make(parts, rewrite):
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    try:
        normalised = normalise_request(body)
    except BadRequest:
        return
    items = normalised.items
    minted = {item.uuid for item in items}
    matches = every_item_matched(items, {"g": [[1, 2, 2]]})
    consumer = rewrite_request(normalised.body, items, matches, rewrite=rewrite)
    encoders = [encoder_body(normalised.body, [item], send_uuid=rewrite) for item in items]
    for forwarded, may_reference in [(consumer, rewrite), *((e, False) for e in encoders)]:
        for message in forwarded["messages"]:
            content = message["content"]
            for part in content if isinstance(content, list) else ():
                kind = vllm_part_kind(part)  # raises where vLLM would refuse: nothing forwarded may
                if isinstance(part, dict) and "uuid" in part:
                    assert part["uuid"] in minted
                if kind in REFERENCE_KINDS:
                    assert may_reference and kind.endswith("_embeds") and part["uuid"] in minted
