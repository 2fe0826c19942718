"""The fakes' reading of Responses and Messages bodies follows vLLM's conversion to chat."""

from __future__ import annotations

import orjson
import pytest

from epd_proxy_tools.testing.fake_doors import MESSAGES, RESPONSES, Refused, chat_view, error_body


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


def test_responses_items_become_chat_messages_as_vllm_builds_them():
    screen = {"type": "input_image", "image_url": "https://x/s.png", "uuid": "u"}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "look"}]},
        {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "got"}, screen]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "plain"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "seen"}, screen]},
        {"role": "assistant", "content": [screen]},
    ]
    view = chat_view(RESPONSES, {"model": "m", "input": items})["messages"]
    assert view[1]["role"] == "assistant" and view[1]["reasoning"] == "hmm"
    assert view[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]
    assert view[2] == {"role": "tool", "content": items[3]["output"], "tool_call_id": "c1"}
    assert view[3] == {"role": "tool", "content": "plain", "tool_call_id": "c2"}
    # An assistant item gives only its first part's text, unless that part has none.
    assert view[4] == {"role": "assistant", "content": "seen"}
    assert view[5] == items[6]


@pytest.mark.parametrize(
    "item",
    [
        {"type": "computer_call_output", "call_id": "c", "output": {"type": "computer_screenshot"}},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "image_url", "image_url": "x"}]},
        {"type": "function_call_output", "call_id": "c", "output": 5},
    ],
)
def test_responses_items_vllm_refuses_are_refused(item):
    with pytest.raises(Refused):
        chat_view(RESPONSES, {"model": "m", "input": [item]})


def test_messages_keep_assistant_tool_calls_inline_system_and_tool_text_as_vllm_does():
    screen = {"type": "image", "source": {"type": "url", "url": "https://x/s.png"}}
    result = [{"type": "text", "text": "took"}, {"type": "text", "text": "it"}, screen]
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "t", "name": "shot", "input": {"x": 1}},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": result}]},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "odd"}]},
        ],
    }
    view = chat_view(MESSAGES, body)["messages"]
    call = {"id": "t", "type": "function", "function": {"name": "shot", "arguments": '{"x": 1}'}}
    assert view == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "reasoning": "hmm", "tool_calls": [call]},
        {"role": "system", "content": "reminder"},
        {"role": "tool", "tool_call_id": "t", "content": "took\nit"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/s.png"}}]},
        {"role": "assistant", "content": "Tool result: odd"},
    ]
