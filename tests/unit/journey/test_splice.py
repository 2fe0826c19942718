"""Splice against the full parse: for any body, the same items, identities, groups and bytes."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_proxy.errors import BadRequest
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.routing import RoundRobin
from epd_proxy.journey.extract import MEDIA_HASHES, ReadOptions, normalise_request, parse_request
from epd_proxy.journey.match import Matches, match_group
from epd_proxy.journey.plan import plan_groups
from epd_proxy.journey.prefill import prefill_request
from epd_proxy.journey.rewrite import rewrite_request
from epd_proxy.journey.splice import lift
from epd_proxy.journey.subrequest import encoder_body


def data_url(payload: bytes, header: str = "data:image/png;base64,") -> str:
    return header + base64.b64encode(payload).decode()


payloads = st.binary(min_size=0, max_size=96)
canonical = st.one_of(payloads.map(data_url), payloads.map(lambda p: data_url(p, "data:image/jpeg;charset=x;base64,")))
# Mostly canonical, so that many bodies take the fast path; the rest must fall back exactly.
urls = st.one_of(
    canonical,
    canonical,
    canonical,
    canonical,
    canonical,
    payloads.map(lambda p: data_url(p, "DATA:Image/PNG;base64,")),
    payloads.map(lambda p: data_url(p, "data:image/png;base64, ")),  # whitespace to drop
    payloads.map(lambda p: data_url(p)[:40] + "\n" + data_url(p)[40:]),
    payloads.map(lambda p: data_url(p)[:30] + "\t" + data_url(p)[30:] + " "),
    payloads.map(lambda p: data_url(p).rstrip("=")),  # padding dropped: strict base64 refuses it, so not lifted
    payloads.map(lambda p: data_url(p)[:35] + "-_" + data_url(p)[35:]),  # URL-safe alphabet
    payloads.map(lambda p: data_url(p, "data:image/png,")),  # not base64
    st.sampled_from(["https://m/a.png", "https://m/é.png", "data:,", "data:image/png;base64,"]),
)


def media_part(kind: str, url: str, shape: int, uuid: str | None) -> dict:
    if kind == "input_audio":
        part = {"type": "input_audio", "input_audio": {"data": url, "format": "wav"}}
    elif kind == "input_image":
        part = {"type": "input_image", "image_url": url}
    elif shape == 0:
        part = {"type": kind, kind: {"url": url}}
    elif shape == 1:
        part = {"type": kind, kind: url}
    elif shape == 2:
        part = {kind: {"url": url}}  # typed by its key, as vLLM does
    else:
        part = {"type": kind, kind: {"url": url, "detail": url}}  # the same bytes twice
    if uuid is not None:
        part["uuid"] = uuid
    return part


KINDS = st.sampled_from(["image_url"] * 4 + ["audio_url", "video_url", "input_audio", "input_image"])
SHAPES = st.sampled_from([0, 0, 0, 0, 1, 2, 3])
media_parts = st.builds(media_part, KINDS, urls, SHAPES, st.sampled_from([None, None, "client-uuid"]))
texts = st.text(max_size=8)
text_parts = st.one_of(texts, texts, texts, urls).map(lambda t: {"type": "text", "text": t})
contents = st.lists(st.one_of(media_parts, media_parts, text_parts), max_size=4)
messages = st.lists(contents.map(lambda c: {"role": "user", "content": c}), min_size=1, max_size=2)
extras = st.one_of(
    *[st.just({})] * 6, urls.map(lambda u: {"metadata": {"note": u}}), st.just({"messages": "not a list"})
)
bodies = st.builds(lambda ms, extra: {"model": "m", "messages": ms, "max_tokens": 4, **extra}, messages, extras)


# Bodies the fast path must take whole: canonical media where media go, plain text elsewhere.
friendly_parts = st.one_of(
    st.builds(
        media_part,
        st.sampled_from(["image_url", "image_url", "audio_url", "video_url", "input_image"]),
        canonical,
        st.sampled_from([0, 1, 2]),
        st.sampled_from([None, "client-uuid"]),
    ),
    texts.map(lambda t: {"type": "text", "text": t}),
)
friendly_bodies = st.builds(
    lambda ms: {"model": "m", "messages": ms},
    st.lists(
        st.lists(friendly_parts, max_size=5).map(lambda c: {"role": "user", "content": c}), min_size=1, max_size=3
    ),
)


def encodings(body: dict) -> list[bytes]:
    """The same JSON written as different clients write it."""
    compact = orjson.dumps(body)
    return [
        compact,
        json.dumps(body).encode(),  # ", " and ": " separators, non-ASCII escaped
        json.dumps(body, indent=1, ensure_ascii=False).encode(),
        compact.replace(b"/", b"\\/"),  # escaped slashes: same strings, different bytes
    ]


def outcome(raw: bytes, trust: bool, lift_min_bytes: int | None, media_hash: str = "sha256"):
    """Everything later steps see, as bytes, from the fast path or (lift_min_bytes None) the full one."""
    options = ReadOptions(trust_client_fields=trust, media_hash=media_hash)
    try:
        if lift_min_bytes is None:
            normalised, spliced = normalise_request(orjson.loads(raw), options), None
        else:
            normalised, spliced = parse_request(raw, dataclasses.replace(options, lift_min_bytes=lift_min_bytes))
    except BadRequest as exc:
        return ("400", exc.message), None
    dumps = spliced.dumps if spliced is not None else orjson.dumps

    def wire(obj) -> bytes:
        return b"".join(bytes(piece) for piece in (dumps(obj) if spliced else [dumps(obj)]))

    body, items = normalised.body, normalised.items
    encoders = [Instance(f"http://e{i}", "encode") for i in range(3)]
    groups = plan_groups(items, RoundRobin().choose(encoders, [i.uuid for i in items]), 2)
    encoder_bodies = [
        wire(encoder_body(body, [items[i] for i in g.indices], send_uuid=True, transfer_ids=["t"] * len(g.indices)))
        for g in groups
    ]
    matches = Matches()
    for item in items[::2]:
        match_group([item], ["t"], {item.uuid: {"metadata": {"g": [[1, 2, 2]]}}}, matches)
    consumer = rewrite_request(body, items, matches)
    raw_media = rewrite_request(body, items, Matches())
    facts = (
        [(i.index, i.kind, i.uuid, i.place.entry, i.place.part, wire(i.part)) for i in items],
        [(g.encoder.url, g.indices) for g in groups],
        encoder_bodies,
        wire(consumer),
        wire(raw_media),
        wire(prefill_request(consumer)),
    )
    return facts, spliced


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, trust=st.booleans(), media_hash=st.sampled_from(sorted(MEDIA_HASHES)))
def test_the_fast_path_and_the_full_parse_agree_on_everything(body, trust, media_hash):
    for raw in encodings(body):
        full, _ = outcome(raw, trust, None, media_hash)
        fast, spliced = outcome(raw, trust, 1, media_hash)
        assert fast == full


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=friendly_bodies, trust=st.booleans())
def test_canonical_media_always_take_the_fast_path_with_the_same_outcome(body, trust):
    has_media = any("text" not in part for message in body["messages"] for part in message["content"])
    for raw in encodings(body)[:3]:  # escaped slashes are not canonical JSON text
        full, _ = outcome(raw, trust, None)
        fast, spliced = outcome(raw, trust, lift_min_bytes=1)
        assert (spliced is not None) == has_media
        assert fast == full


def test_canonical_media_take_the_fast_path_and_stay_slices_of_the_clients_bytes():
    images = [data_url(bytes([n]) * 3000) for n in range(3)]
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    body["messages"][0]["content"] += [{"type": "image_url", "image_url": {"url": u}} for u in [*images, images[0]]]
    raw = bytearray(orjson.dumps(body))
    normalised, spliced = parse_request(raw)
    assert spliced is not None and len(spliced.spans) == 4
    assert [i.uuid for i in normalised.items] == [hashlib.sha256(u.encode()).hexdigest() for u in [*images, images[0]]]
    pieces = spliced.dumps(encoder_body(normalised.body, normalised.items, send_uuid=True))
    lifted = [p for p in pieces if isinstance(p, memoryview)]
    assert len(lifted) == 4 and all(p.obj is raw for p in lifted)
    assert sum(len(p) for p in lifted) == sum(len(u) for u in [*images, images[0]])


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
        b'{"note": "%s", "messages": [{"role": "user", "content": "x"}]}',
    ],
)
def test_a_lifted_url_that_is_not_a_media_url_falls_back_to_the_full_parse(raw):
    raw = raw % data_url(b"x" * 3000).encode()
    assert lift(raw) is not None
    normalised, spliced = parse_request(raw)
    assert spliced is None and normalised.body == orjson.loads(raw)


def test_invalid_json_gives_the_full_parses_error():
    raw = (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "%s"}]]'
        % data_url(b"x" * 3000).encode()
    )
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request(raw)
