from __future__ import annotations

import copy
import hashlib
import json

import blake3
import pytest

from epd_proxy.errors import BadRequest
from epd_proxy.journey.extract import ReadOptions, canonical_media_url, normalise_request
from tests.media import audio, chat, image, video

EMBEDS = {"image_grid_thw": [1, 4, 4]}
URL = {"url": "https://m/a.png"}
TRUSTED = ReadOptions(trust_client_fields=True)


def items_of(body, **options):
    return normalise_request(body, ReadOptions(**options)).items


def test_items_come_from_every_message_in_order():
    body = {
        "messages": [
            {"role": "system", "content": "plain text is ignored"},
            {"role": "user", "content": [image("A"), {"type": "text", "text": "x"}, audio("s")]},
            {"role": "assistant", "content": [video("v")]},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
        ]
    }
    assert [(i.index, i.kind, i.place.entry, i.place.part) for i in items_of(body)] == [
        (0, "image_url", 1, 0),
        (1, "audio_url", 1, 2),
        (2, "video_url", 2, 0),
        (3, "input_audio", 3, 0),
    ]


def test_an_images_uuid_is_the_reference_proxys_content_hash_and_other_kinds_are_tagged():
    part = image("A")
    [item] = items_of(chat(part))
    assert item.uuid == hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()
    inline = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    [item] = items_of(chat(inline))
    assert item.uuid == hashlib.sha256(b"audio:" + json.dumps(inline, sort_keys=True).encode()).hexdigest()


def test_the_same_bytes_as_image_video_and_audio_get_three_names():
    url = image("A")["image_url"]["url"]
    parts = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}} for kind in ("image", "video", "audio")]
    items = items_of(chat(*parts))
    assert len({item.uuid for item in items}) == 3
    assert items[1].uuid == hashlib.sha256(b"video:" + url.encode()).hexdigest()


def test_an_input_audios_url_field_names_nothing():
    """vLLM decodes an input_audio's `data`; a `url` beside it must not stand for other data."""
    one, other = ({"type": "input_audio", "input_audio": {"data": d, "format": "wav", "url": "u"}} for d in "AB")
    assert items_of(chat(one))[0].uuid != items_of(chat(other))[0].uuid


def test_media_urls_are_data_or_http_urls_and_http_ones_wait_for_their_bytes_to_be_named():
    for url in ("file:///etc/passwd", "ftp://m/a.png", "a.png"):
        with pytest.raises(BadRequest, match="data: URL or an http"):
            items_of(chat({"type": "image_url", "image_url": {"url": url}}))
    [item] = items_of(chat({"type": "video_url", "video_url": {"url": "HTTPS://m/a.mp4"}}))
    assert item.fetch == "HTTPS://m/a.mp4" and item.uuid == ""
    trusted = ReadOptions(trust_client_fields=True)
    [item] = normalise_request(chat({"type": "image_url", "image_url": URL, "uuid": "mine"}), trusted).items
    assert item.fetch == URL["url"] and item.uuid == "mine"


def test_blake3_names_media_by_the_same_bytes_when_asked():
    part = image("A")
    inline = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    items = normalise_request(chat(part, inline), ReadOptions(media_hash="blake3")).items
    assert [item.uuid for item in items] == [
        blake3.blake3(part["image_url"]["url"].encode()).hexdigest(),
        blake3.blake3(b"audio:" + json.dumps(inline, sort_keys=True).encode()).hexdigest(),
    ]
    assert [item.uuid for item in items_of(chat(part, inline))] != [item.uuid for item in items]


def test_client_uuids_are_dropped_everywhere_unless_trusted():
    body = chat(
        {**image("A"), "uuid": "client-chosen"},
        {"type": "text", "text": "t", "uuid": "on-text-too"},
        "a bare string part",
    )
    normalised = normalise_request(body)
    [item] = normalised.items
    assert item.uuid == hashlib.sha256(image("A")["image_url"]["url"].encode()).hexdigest()
    assert "uuid" not in item.part
    assert not any(isinstance(p, dict) and "uuid" in p for p in normalised.body["messages"][0]["content"])
    assert body["messages"][0]["content"][1]["uuid"] == "client-chosen", "the client's body is never mutated"
    trusted = normalise_request(body, TRUSTED)
    assert trusted.items[0].uuid == "client-chosen"
    assert trusted.body is body


def test_untouched_bodies_are_not_copied():
    body = chat(image("A"))
    assert normalise_request(body).body is body


# Each of these is read by vLLM 0.32's chat parser as an embeddings (or cache) reference: by its
# media key when there is no type or when a uuid is present, whatever the type says.
EMBEDS_BYPASSES = [
    {"image_embeds": EMBEDS, "uuid": "0000deadbeef"},
    {"image_embeds": EMBEDS},
    {"type": "image_embeds", "image_embeds": EMBEDS},
    {"type": "audio_embeds", "audio_embeds": {"audio_feature_lengths": [4]}},
    {"video_embeds": EMBEDS, "uuid": "x"},
    {"type": "prompt_embeds", "data": "AAAA"},
    {"prompt_embeds": {}, "uuid": "x"},
    {"image_pil": None, "uuid": "cached-image"},
    {"type": None, "image_embeds": EMBEDS, "uuid": "x"},
]


@pytest.mark.parametrize("part", EMBEDS_BYPASSES)
def test_embeddings_references_are_refused_under_any_or_no_type(part):
    with pytest.raises(BadRequest, match="embeddings and cache references") as err:
        normalise_request(chat(part))
    assert "messages[0].content[1]" in err.value.message


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "x", "image_embeds": EMBEDS, "uuid": "u"},
        {"type": "text", "text": "x", "image_url": URL, "uuid": "another callers hash"},
        {"type": "text", "text": "x", "image_url": URL},
        {"type": "image_url", "image_url": URL, "image_embeds": EMBEDS},
        {"type": "image_url", "image_url": URL, "video_url": URL},
        {"image_url": URL, "audio_url": URL},
        {"type": "input_audio", "input_audio": {"data": "AA"}, "audio_url": URL},
    ],
)
def test_parts_naming_more_than_one_kind_are_refused(part):
    with pytest.raises(BadRequest, match="more than one kind"):
        normalise_request(chat(part))
    with pytest.raises(BadRequest, match="more than one kind"):
        normalise_request(chat(part), TRUSTED)


@pytest.mark.parametrize(
    "part, complaint",
    [
        ({"type": "", "image_embeds": EMBEDS}, "unsupported type ''"),
        ({"type": "image", "image_url": URL}, "unsupported type 'image'"),
        ({"type": []}, "type must be a string"),
        ({"uuid": "only"}, "no 'type' and no media field"),
        ({}, "no 'type' and no media field"),
        ({"type": "image_url", "image_url": {}}, "without a 'image_url.url'"),
        ({"image_url": None, "uuid": "cached"}, "without a 'image_url.url'"),
        ({"type": "video_url"}, "without a 'video_url.url'"),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data"),
        ({"type": "input_image"}, "'input_image' without"),
    ],
)
def test_bad_parts_are_named(part, complaint):
    with pytest.raises(BadRequest, match=complaint.replace("[", r"\[").replace("]", r"\]")) as err:
        normalise_request(chat(part))
    assert err.value.status == 400


@pytest.mark.parametrize(
    "body, complaint",
    [
        ([1, 2], "JSON object"),
        ({"model": "m"}, "'messages'"),
        ({"messages": []}, "'messages'"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "user", "content": [7]}]}, "content[0] must be an object or a string"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "'stream'"),
        (chat(ec_transfer_params={"h": {}}), "ec_transfer_params"),
        (chat(kv_transfer_params={"remote_block_ids": [1]}), "kv_transfer_params"),
        (chat(vllm_xargs={"kv_transfer_params": "x"}), "vllm_xargs.kv_transfer_params"),
        (chat(vllm_xargs={"ec_transfer_params": ["y"]}), "vllm_xargs.ec_transfer_params"),
        (chat(vllm_xargs={"kv_cache_report_mode": "full"}), "vllm_xargs.kv_cache_report_mode"),
    ],
)
def test_bad_requests_are_named(body, complaint):
    with pytest.raises(BadRequest, match=complaint.replace("[", r"\[").replace("]", r"\]")):
        normalise_request(body)


def test_trusted_callers_may_send_engine_fields_and_references():
    part = {"type": "image_embeds", "image_embeds": {}, "uuid": "x"}
    body = chat(part, {"image_embeds": EMBEDS, "uuid": "y"}, ec_transfer_params={"h": {}})
    normalised = normalise_request(body, TRUSTED)
    assert normalised.body is body and normalised.items == []


def test_parts_without_a_type_are_typed_by_their_media_key():
    [item] = items_of(chat({"image_url": {"url": "https://m/a.png"}}))
    assert item.kind == "image_url" and item.place.part == 1
    # vLLM refuses a type-less part with no media key ("Missing 'type' field"): so do we, earlier.
    with pytest.raises(BadRequest, match="no 'type'"):
        normalise_request(chat({"text": "plain"}))


def test_text_like_types_are_not_media():
    body = chat(
        {"type": "input_text", "text": "a"},
        {"type": "thinking", "thinking": "b"},
        {"type": "refusal", "refusal": "c"},
        {"type": "tool_reference", "name": "t"},
    )
    assert items_of(body) == []


def test_input_image_is_an_image_url_item():
    [item] = items_of(chat({"type": "input_image", "image_url": "https://m/a.png"}))
    assert item.kind == "image_url"
    assert item.part == {"type": "image_url", "image_url": {"url": "https://m/a.png"}}
    assert item.fetch == "https://m/a.png"


def test_the_input_is_never_mutated():
    body = chat({**image("A"), "uuid": "u"}, {"type": "input_image", "image_url": "https://m/a.png"})
    before = copy.deepcopy(body)
    normalise_request(body)
    assert body == before


def test_canonical_data_urls_hash_like_the_reference():
    canonical = "data:image/png;base64,iVBORw0KGgo="
    assert canonical_media_url(canonical) is canonical
    assert canonical_media_url("DATA:Image/PNG;BASE64,iVBO\nRw0K\r\nGgo=") == canonical
    assert canonical_media_url("data:image/png;base64, iVBORw0K Ggo=") == canonical
    plain = "https://Example.com/A B.png"
    assert canonical_media_url(plain) is plain
    # non-base64 payloads keep their spaces: they are data
    assert canonical_media_url("data:text/plain,a b") == "data:text/plain,a b"


def test_line_breaks_do_not_change_an_items_identity():
    one = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJDRA=="}}
    wrapped = {"type": "image_url", "image_url": {"url": "data:image/PNG;base64,QUJD\nRA=="}}
    a, b = items_of(chat(one, wrapped))
    assert a.uuid == b.uuid == hashlib.sha256(b"data:image/png;base64,QUJDRA==").hexdigest()


def test_media_item_limit():
    with pytest.raises(BadRequest, match="more than 2 media items"):
        normalise_request(chat(image("A"), image("B"), image("C")), ReadOptions(max_media_items=2))
    assert len(items_of(chat(image("A"), image("B")), max_media_items=2)) == 2


def test_other_vllm_xargs_pass():
    body = chat(vllm_xargs={"ngram_size": 3})
    assert normalise_request(body).body is body


def test_media_is_forwarded_in_the_canonical_form_its_identity_names():
    messy = {"type": "image_url", "image_url": {"url": "DATA:image/PNG;base64,QUJD\nRA==", "detail": "auto"}}
    [item] = items_of(chat(messy))
    assert item.part == {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJDRA==", "detail": "auto"}}
    assert item.uuid == hashlib.sha256(b"data:image/png;base64,QUJDRA==").hexdigest()
    [item] = items_of(chat({"image_url": "data:image/PNG;base64,QUJDRA=="}))
    assert item.part == {"image_url": "data:image/png;base64,QUJDRA=="}
    [item] = items_of(chat({"type": "input_image", "image_url": "DATA:image/png;base64,QUJD RA=="}))
    assert item.part == {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJDRA=="}}
    assert item.uuid == hashlib.sha256(b"data:image/png;base64,QUJDRA==").hexdigest()
    clean = image("A")
    assert items_of(chat(clean))[0].part is clean


def test_an_isolated_tenants_salt_names_the_same_bytes_apart_and_no_salt_keeps_the_reference_name():
    part = image("A")
    url = part["image_url"]["url"].encode()
    plain = items_of(chat(part))[0].uuid
    assert plain == hashlib.sha256(url).hexdigest()
    one, two = (normalise_request(chat(part), ReadOptions(salt=s)).items[0].uuid for s in ("s1" * 32, "s2" * 32))
    assert len({plain, one, two}) == 3
    assert normalise_request(chat(part), ReadOptions(salt="s1" * 32)).items[0].uuid == one, "stable"
    fast = normalise_request(chat(part), ReadOptions(media_hash="blake3", salt="s1" * 32)).items[0].uuid
    assert fast not in (one, blake3.blake3(url).hexdigest())
