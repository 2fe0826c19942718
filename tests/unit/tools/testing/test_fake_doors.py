"""The fakes' reading of Responses and Messages bodies follows vLLM's conversion to chat."""

from __future__ import annotations

import orjson
import pytest

from epd_proxy.tools.testing.fake_doors import MESSAGES, RESPONSES, Refused, chat_view, error_body


def test_messages_become_vllms_chat_messages():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QQ=="}}
    screen = {"type": "image", "source": {"type": "url", "url": "https://x/s.png"}}
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": "brief",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, image]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [screen]}]},
        ],
    }
    view = chat_view(MESSAGES, body)
    assert view["messages"][0] == {"role": "system", "content": "brief"}
    assert view["messages"][1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,QQ=="},
    }
    assert view["messages"][2]["role"] == "tool"
    assert view["messages"][3]["content"] == [{"type": "image_url", "image_url": {"url": "https://x/s.png"}}]


def test_responses_keep_their_parts_and_instructions_lead():
    part = {"type": "input_image", "image_url": "https://x/a.png", "uuid": "u"}
    view = chat_view(RESPONSES, {"model": "m", "instructions": "brief", "input": [{"role": "user", "content": [part]}]})
    assert view["messages"] == [{"role": "system", "content": "brief"}, {"role": "user", "content": [part]}]


@pytest.mark.parametrize("api, body", [(MESSAGES, {"model": "m", "messages": []}), (RESPONSES, {"model": "m"})])
def test_what_vllm_refuses_the_fakes_refuse_in_the_apis_shape(api, body):
    with pytest.raises(Refused):
        chat_view(api, body)
    shaped = orjson.loads(error_body(api, "bad", 400))
    assert (shaped["type"] == "error") if api == MESSAGES else (shaped["error"]["code"] == 400)
