"""The Messages door's pure parts: its bodies read for media (spliced too), and what consumer and prefill get."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from epd_proxy.errors import BadRequest
from epd_proxy.journey.doors import Conversation, with_handles
from epd_proxy.journey.extract import ReadOptions
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.messages_api import (
    image_source_url,
    messages_conversation,
    messages_prefill_body,
    normalise_messages,
    parse_messages,
)
from epd_proxy.journey.subrequest import encoder_parts
from tests.media import agent_messages

URL = "data:image/png;base64,aW1hZ2UtQQ=="


def anthropic_image(data="aW1hZ2UtQQ==", media_type="image/png"):
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def matches_for(items):
    m = Matches()
    for item in items:
        m.items[item.index] = ItemMatch({"image_grid_thw": [1, 2, 2]}, f"h{item.index}", f"t{item.index}")
        m.handles[f"h{item.index}"] = {"metadata": {}}
    return m


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
        normalise_messages(body, ReadOptions(max_media_items=1))
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


# -- where its conversation lies ---------------------------------------------------------------------


@pytest.mark.parametrize("tools", [False, True])
def test_the_conversation_opens_through_the_first_user_message(tools):
    body = agent_messages("a", "b", "c", tools=tools)
    seen = messages_conversation(body)
    assert seen.entries is body["messages"] and seen.opening == 1
    assert messages_conversation({"messages": "x"}) == Conversation()


@pytest.mark.parametrize(
    ("system", "read"),
    [
        ("brief", "brief"),
        (
            [
                {"type": "text", "text": "be "},
                {"type": "text", "text": "brief", "cache_control": {"type": "ephemeral"}},
            ],
            "be brief",
        ),
        # Claude Code's attribution changes on every request; vLLM leaves it out of the prompt.
        ([{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "brief"}], "brief"),
        ("x-anthropic-billing-header: cch=1;", None),
        (None, None),
    ],
)
def test_the_preamble_is_the_system_prompt_as_vllm_reads_it(system, read):
    body = agent_messages("a", system=system)
    assert messages_conversation(body).preamble == read


def test_a_fetched_source_beside_a_source_whose_url_is_not_text_is_put_in_place_alone():
    from epd_proxy.journey.messages_api import _with_fetched_sources

    fetched = {"type": "image", "source": {"type": "url", "url": "https://ok/a.png"}}
    odd = {"type": "image", "source": {"type": "url", "url": {"x": 1}}}
    urls = {"https://ok/a.png": "data:image/png;base64,AA=="}
    assert _with_fetched_sources(fetched, urls)["source"]["url"] == "data:image/png;base64,AA=="
    assert _with_fetched_sources(odd, urls) is odd
