"""The agent doors' pure parts: reading Responses and Messages bodies for media, and the bodies
the consumer and prefill get."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from epd_proxy.errors import BadRequest, ErrorAnswer, ProxyError
from epd_proxy.journey.doors import CHAT, with_handles
from epd_proxy.journey.encode import encoder_parts
from epd_proxy.journey.extract import parse_request
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.messages_api import (
    MESSAGES,
    image_source_url,
    messages_prefill_body,
    normalise_messages,
    parse_messages,
)
from epd_proxy.journey.responses_api import (
    RESPONSES,
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


def anthropic_image(data="aW1hZ2UtQQ==", media_type="image/png"):
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def matches_for(items):
    m = Matches()
    for item in items:
        m.items[item.index] = ItemMatch({"image_grid_thw": [1, 2, 2]}, f"h{item.index}", f"t{item.index}")
        m.handles[f"h{item.index}"] = {"metadata": {}}
    return m


# ---------------------------------------------------------------------------------- Responses
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
    normalised = normalise_responses(responses(image_part(uuid="router-made")), trust_client_fields=True)
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
        normalise_responses(responses(image_part(), image_part()), max_media_items=1)


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


# ----------------------------------------------------------------------------------- Messages
def test_image_sources_become_the_urls_vllm_builds():
    assert image_source_url({"type": "url", "url": "https://x/a.png"}) == "https://x/a.png"
    assert (
        image_source_url({"type": "base64", "media_type": "image/webp", "data": "QQ=="})
        == "data:image/webp;base64,QQ=="
    )
    # vLLM's defaults: a source without a type is base64, without a media type a JPEG.
    assert image_source_url({"data": "QQ=="}) == "data:image/jpeg;base64,QQ=="
    for broken in ({}, {"type": "url"}, {"type": "base64", "data": ""}, {"data": 5}, None):
        assert image_source_url(broken) is None


def test_messages_images_are_unnamed_items_in_the_consumers_prompt_order():
    screen = {"type": "image", "source": {"type": "url", "url": "https://x/screen.png"}}
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "system", "content": [anthropic_image("U1lT")]},
            {
                "role": "user",
                "content": [
                    anthropic_image("QQ=="),
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "ok"}, screen]},
                ],
            },
        ],
    }
    normalised = normalise_messages(body)
    assert normalised.body is body
    urls = [item.part["image_url"]["url"] for item in normalised.items]
    # The tool result's image goes in a user message of its own, before the message holding it.
    assert urls == ["https://x/screen.png", "data:image/png;base64,QQ=="]
    assert not any(item.named for item in normalised.items)
    assert encoder_parts(normalised.items, send_uuid=True) == [item.part for item in normalised.items]


def test_messages_guard_and_limits():
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [anthropic_image(), anthropic_image()]}],
    }
    with pytest.raises(BadRequest, match="kv_transfer_params"):
        normalise_messages({**body, "kv_transfer_params": {"do_remote_prefill": True}})
    with pytest.raises(BadRequest, match="more than 1 media items"):
        normalise_messages(body, max_media_items=1)
    with pytest.raises(BadRequest, match="stream"):
        normalise_messages({**body, "stream": "yes"})


def test_messages_consumer_and_prefill_bodies():
    body = {
        "model": "m",
        "max_tokens": 40,
        "stream": True,
        "messages": [{"role": "user", "content": [anthropic_image()]}],
    }
    normalised = normalise_messages(body)
    out = with_handles(body, normalised.items, matches_for(normalised.items), rewrite=True, push_mode=False)
    assert out["messages"] is body["messages"] and out["ec_transfer_params"]["ec_items"][0]["transfer_id"] == "t0"
    prefill = messages_prefill_body(out)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and prefill["ec_transfer_params"]
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True


def test_errors_take_each_doors_shape():
    own = ProxyError(503, "no live decode instance", stage="route", error_type="service_unavailable")
    assert orjson.loads(MESSAGES.error(own)) == {
        "type": "error",
        "error": {"type": "service_unavailable", "message": "no live decode instance"},
    }
    assert RESPONSES.error(own) is None and CHAT.error(own) is None
    consumer = ErrorAnswer(
        400, b'{"type":"error","error":{"type":"x","message":"y"}}', "application/json", stage="decode", backend="b"
    )
    assert MESSAGES.error(consumer) == consumer.raw_body
    encoder = ErrorAnswer(
        400,
        b'{"error":{"message":"bad image","type":"BadRequestError"}}',
        "application/json",
        stage="encode",
        backend="e",
    )
    assert orjson.loads(MESSAGES.error(encoder)) == {
        "type": "error",
        "error": {"type": "BadRequestError", "message": "bad image"},
    }


def test_large_anthropic_images_are_spliced_with_the_full_parses_outcome():
    data = "QUFB" * 400
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [anthropic_image(data)]}]}
    raw = orjson.dumps(body)
    normalised, spliced = parse_messages(raw)
    full = normalise_messages(orjson.loads(raw))
    assert spliced is not None
    assert [i.uuid for i in normalised.items] == [hashlib.sha256(f"data:image/png;base64,{data}".encode()).hexdigest()]
    assert [i.uuid for i in normalised.items] == [i.uuid for i in full.items]

    def written(obj) -> dict:
        return orjson.loads(b"".join(bytes(piece) for piece in spliced.dumps(obj)))

    assert written(encoder_parts(normalised.items, send_uuid=True)) == [i.part for i in full.items]
    consumer = with_handles(normalised.body, normalised.items, Matches(), rewrite=True, push_mode=False)
    assert written(consumer) == body


def test_a_lifted_string_that_is_no_image_source_falls_back_to_the_full_parse():
    data = "QUFB" * 400
    body = {"model": "m", "max_tokens": 4, "metadata": {"data": data}, "messages": [{"role": "user", "content": "hi"}]}
    normalised, spliced = parse_messages(orjson.dumps(body))
    assert spliced is None and normalised.body == body
