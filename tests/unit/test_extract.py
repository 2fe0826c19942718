from __future__ import annotations

import hashlib
import json

import pytest

from epd_proxy.errors import BadRequest
from epd_proxy.extract import extract_media, validate_request
from tests.media import audio, chat, image, video


def test_items_come_from_every_message_in_order():
    body = {
        "messages": [
            {"role": "system", "content": "plain text is ignored"},
            {"role": "user", "content": [image("A"), {"type": "text", "text": "x"}, audio("s")]},
            {"role": "assistant", "content": [video("v")]},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
        ]
    }
    items = extract_media(body)
    assert [(i.index, i.kind, i.message_index, i.part_index) for i in items] == [
        (0, "image_url", 1, 0),
        (1, "audio_url", 1, 2),
        (2, "video_url", 2, 0),
        (3, "input_audio", 3, 0),
    ]


def test_uuid_is_the_reference_proxys_content_hash():
    part = image("A")
    [item] = extract_media(chat(part))
    assert item.uuid == hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()
    inline = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    [item] = extract_media(chat(inline))
    assert item.uuid == hashlib.sha256(json.dumps(inline, sort_keys=True).encode()).hexdigest()


def test_client_uuid_only_counts_when_trusted():
    part = {**image("A"), "uuid": "client-chosen"}
    assert extract_media(chat(part))[0].uuid != "client-chosen"
    assert extract_media(chat(part), honour_client_uuid=True)[0].uuid == "client-chosen"


@pytest.mark.parametrize(
    "body, complaint",
    [
        ([1, 2], "JSON object"),
        ({"model": "m"}, "'messages'"),
        ({"messages": []}, "'messages'"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "user", "content": ["hi"]}]}, "content[0] must be an object"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "without a 'image_url.url'",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video_url"}]}]}, "without a 'video_url.url'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"format": "wav"}}]}]},
            "input_audio.data",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "'stream'"),
        ({"messages": [{"content": [{"type": []}]}]}, "type must be a string"),
        ({"messages": [{"content": [{"type": None}]}]}, "type must be a string"),
        (
            chat({"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "x"}),
            "embeddings references",
        ),
        (chat(ec_transfer_params={"h": {}}), "ec_transfer_params"),
        (chat(kv_transfer_params={"remote_block_ids": [1]}), "kv_transfer_params"),
    ],
)
def test_bad_requests_are_named(body, complaint):
    with pytest.raises(BadRequest, match=complaint.replace("[", r"\[").replace("]", r"\]")) as err:
        validate_request(body, trust_client_fields=False)
    assert err.value.status == 400


def test_trusted_callers_may_send_engine_fields():
    body = chat({"type": "image_embeds", "image_embeds": {}, "uuid": "x"}, ec_transfer_params={"h": {}})
    assert validate_request(body, trust_client_fields=True) is body


def test_canonical_data_urls_hash_like_the_reference():
    from epd_proxy.extract import canonical_media_url

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
    a, b = extract_media(chat(one, wrapped))
    assert a.uuid == b.uuid == hashlib.sha256(b"data:image/png;base64,QUJDRA==").hexdigest()


def test_media_item_limit():
    with pytest.raises(BadRequest, match="more than 2 media items"):
        validate_request(chat(image("A"), image("B"), image("C")), trust_client_fields=False, max_media_items=2)
    validate_request(chat(image("A"), image("B")), trust_client_fields=False, max_media_items=2)


def test_parts_without_a_type_are_typed_by_their_media_key():
    body = chat({"image_url": {"url": "https://m/a.png"}}, {"text": "plain"})
    [item] = extract_media(validate_request(body, trust_client_fields=False))
    assert item.kind == "image_url" and item.part_index == 1
    with pytest.raises(BadRequest, match="image_url.url"):
        validate_request(chat({"image_url": {}}), trust_client_fields=False)
