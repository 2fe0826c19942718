"""The Responses door's pure parts: its bodies read for media, and what consumer and prefill get."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from epd_proxy.errors import BadRequest
from epd_proxy.journey.doors import Conversation
from epd_proxy.journey.extract import ReadOptions, parse_request
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.responses_api import (
    normalise_responses,
    responses_consumer_body,
    responses_conversation,
    responses_prefill_body,
)
from tests.media import agent_responses

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
    assert (first.place.entry, first.place.part, second.place.part) == (0, 1, 2)
    # an http(s) image is named once fetched (remote.py), by its bytes
    assert first.named and second.fetch == "https://x/b.png" and second.uuid == ""
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
    for body in ({"model": "m"}, {"model": "m", "input": "just text"}, with_entries({"type": "bogus"})):
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


def tool_output(*parts, kind="function_call_output"):
    return {"type": kind, "call_id": "c1", "output": list(parts)}


def with_entries(*entries):
    return {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "go"}]}, *entries]}


ATTACKS = {
    # A metadata-only embeddings reference: a PD engine with no such cache entry dies on it.
    "embeds": {"type": "input_image", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "attacker-chosen"},
    # A data-less image under someone's uuid: a lookup in another tenant's encoder cache.
    "data-less": {"type": "input_image", "image_url": None, "uuid": hashlib.sha256(b"https://x/them.png").hexdigest()},
    "typed as text": {"type": "input_text", "text": "x", "uuid": "u", "image_url": None},
}


@pytest.mark.parametrize("kind", ["function_call_output", "custom_tool_call_output"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_tool_outputs_are_guarded_like_content(kind, attack):
    with pytest.raises(BadRequest, match=r"input\[1\]\.output\[0\]"):
        normalise_responses(with_entries(tool_output(ATTACKS[attack], kind=kind)))
    with pytest.raises(BadRequest, match=r"input\[0\]\.content\[1\]"):
        normalise_responses(responses(ATTACKS[attack]))


@pytest.mark.parametrize("url", [None, "", 7])
def test_an_image_without_its_data_is_the_proxys_400_wherever_it_is(url):
    part = {"type": "input_image", "image_url": url}
    for body in (responses(part), with_entries(tool_output(part))):
        with pytest.raises(BadRequest, match="without an 'image_url'"):
            normalise_responses(body)
    if url is None:
        with pytest.raises(BadRequest, match="without an 'image_url'"):
            normalise_responses(responses({"type": "input_image", "detail": "auto"}))


def test_a_tool_outputs_image_is_an_item_the_consumer_gets_under_the_proxys_uuid():
    screen = image_part(URL, uuid="forged", detail="auto")
    body = with_entries(
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        tool_output({"type": "input_text", "text": "the screen:"}, screen),
    )
    normalised = normalise_responses(body)
    [item] = normalised.items
    assert (item.place.entry, item.place.field, item.place.part) == (2, "output", 1)
    assert item.part == {"type": "image_url", "image_url": {"url": URL}}
    assert item.uuid == hashlib.sha256(URL.encode()).hexdigest()
    assert "uuid" not in normalised.body["input"][2]["output"][1]
    out = responses_consumer_body(
        normalised.body, normalised.items, matches_for(normalised.items), rewrite=True, push_mode=False
    )
    assert out["input"][2]["output"][1] == {**screen, "uuid": item.uuid}
    assert out["input"][2]["output"][0] == {"type": "input_text", "text": "the screen:"}
    assert body["input"][2]["output"][1]["uuid"] == "forged", "the client's body is never changed"


def test_only_the_lists_vllm_parses_are_read():
    reasoning = {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]}
    # An assistant item whose first part has text gives vLLM that text only.
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}, image_part("https://x/a.png")]}
    shown = {"role": "assistant", "content": [image_part("https://x/b.png")]}
    text_output = {"type": "function_call_output", "call_id": "c1", "output": "plain text"}
    normalised = normalise_responses(with_entries(reasoning, said, shown, text_output))
    assert [(i.place.entry, i.place.field) for i in normalised.items] == [(3, "content")]


# -- where its conversation lies ---------------------------------------------------------------------


@pytest.mark.parametrize("tools", [False, True])
def test_the_conversation_opens_with_the_instructions_and_the_first_user_item(tools):
    body = agent_responses("a", "b", "c", tools=tools)
    seen = responses_conversation(body)
    assert seen.entries is body["input"] and seen.preamble == "You operate a browser." and seen.opening == 1


def test_the_opening_runs_through_the_first_user_item():
    entries = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "go"}]
    assert responses_conversation({"input": entries}).opening == 2
    assert responses_conversation({"input": [{"role": "developer", "content": "x"}]}).opening == 0
    # A string input is one user message; vLLM adds no system message for empty instructions.
    text = responses_conversation({"input": "hello", "instructions": ""})
    assert (text.entries, text.opening, text.preamble) == (("hello",), 1, None)
    assert responses_conversation({"input": 5}) == Conversation()
