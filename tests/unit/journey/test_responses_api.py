"""The Responses door's pure parts: its bodies read for media, and what consumer and prefill get."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from epd_proxy.errors import BadRequest
from epd_proxy.journey.extract import ReadOptions, parse_request
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.responses_api import (
    normalise_responses,
    responses_consumer_body,
    responses_prefill_body,
)

URL = "data:image/png;base64,aW1hZ2UtQQ=="


def responses(*parts, **fields):
    return {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, *parts]}],
        **fields,
    }


def image_part(url=URL, **extra):
    return {"type": "input_image", "image_url": url, **extra}


def matches_for(items):
    m = Matches()
    for item in items:
        m.items[item.index] = ItemMatch({"image_grid_thw": [1, 2, 2]}, f"h{item.index}", f"t{item.index}")
        m.handles[f"h{item.index}"] = {"metadata": {}}
    return m


def test_responses_images_become_items_named_by_the_chat_paths_identity():
    normalised = normalise_responses(responses(image_part(), image_part("https://x/b.png")))
    first, second = normalised.items
    assert first.part == {"type": "image_url", "image_url": {"url": URL}}
    assert first.uuid == hashlib.sha256(URL.encode()).hexdigest()
    assert (first.message_index, first.part_index, second.part_index) == (0, 1, 2)
    assert first.named and second.uuid == hashlib.sha256(b"https://x/b.png").hexdigest()
    # The chat path names the same image the same way, so both share encoder caches.
    chat, _ = parse_request(
        orjson.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}}]}]})
    )
    assert chat.items[0].uuid == first.uuid


def test_responses_client_uuids_are_removed_and_embeddings_refused():
    normalised = normalise_responses(
        responses(image_part(uuid="forged"), {"type": "input_text", "text": "x", "uuid": "u"})
    )
    content = normalised.body["input"][0]["content"]
    assert "uuid" not in content[1] and "uuid" not in content[2]
    assert normalised.items[0].uuid != "forged"
    with pytest.raises(BadRequest, match="image_embeds"):
        normalise_responses(responses({"type": "input_text", "text": "x", "image_embeds": {}}))


def test_trusted_responses_keep_the_clients_uuid():
    normalised = normalise_responses(responses(image_part(uuid="router-made")), ReadOptions(trust_client_fields=True))
    assert normalised.items[0].uuid == "router-made"


@pytest.mark.parametrize("field", ["previous_response_id", "background", "previous_input_messages"])
def test_state_the_proxy_does_not_hold_is_a_400_naming_the_field(field):
    value = [{"role": "user", "content": "x"}] if field == "previous_input_messages" else "resp_1"
    with pytest.raises(BadRequest, match=field):
        normalise_responses(responses(**{field: value}))


def test_what_vllm_judges_is_left_to_it():
    for body in ({"model": "m"}, {"model": "m", "input": "just text"}, responses(image_part(url=7))):
        normalised = normalise_responses(body)
        assert normalised.items == [] and normalised.body is body


def test_responses_media_limit():
    with pytest.raises(BadRequest, match="more than 1 media items"):
        normalise_responses(responses(image_part(), image_part()), ReadOptions(max_media_items=1))


def test_responses_consumer_gets_each_image_under_its_uuid_and_the_handles():
    body = responses(image_part())
    normalised = normalise_responses(body)
    out = responses_consumer_body(
        normalised.body, normalised.items, matches_for(normalised.items), rewrite=True, push_mode=False
    )
    part = out["input"][0]["content"][1]
    assert part == {**image_part(), "uuid": normalised.items[0].uuid}
    assert out["ec_transfer_params"] == {"h0": {"metadata": {}}, "ec_items": [{"mm_hash": "h0", "transfer_id": "t0"}]}
    assert body["input"][0]["content"][1] == image_part(), "the client's body is never changed"
    raw = responses_consumer_body(
        normalised.body, normalised.items, matches_for(normalised.items), rewrite=False, push_mode=False
    )
    assert "uuid" not in raw["input"][0]["content"][1] and "ec_items" not in raw["ec_transfer_params"]


def test_responses_prefill_runs_one_token_without_streaming():
    body = responses_prefill_body({"input": "x", "stream": True, "max_output_tokens": 50})
    assert body["max_output_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True


def test_responses_large_images_are_spliced_and_written_back_whole():
    url = "data:image/png;base64," + "QUFB" * 400
    raw = orjson.dumps(responses(image_part(url)))
    normalised, spliced = parse_request(raw, normalise=normalise_responses)
    assert spliced is not None
    out = responses_consumer_body(normalised.body, normalised.items, Matches(), rewrite=True, push_mode=False)
    written = b"".join(bytes(piece) for piece in spliced.dumps(out))
    assert orjson.loads(written)["input"][0]["content"][1]["image_url"] == url
    assert normalised.items[0].uuid == hashlib.sha256(url.encode()).hexdigest()
