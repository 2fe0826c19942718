"""stream_usage.py: usage asked for on a chat client's behalf, heard by the proxy and hidden from it."""

from __future__ import annotations

import pytest

from epd_proxy.errors import BadRequest
from epd_proxy.journey.stream_usage import UnaskedUsage, ask_chat_usage

ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
TOKEN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"\\"finish_reason\\":\\"x"},"logprobs":null,"finish_reason":null}]}\n\n'
FINISHED = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"length"}]}\n\n'
)
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"total_tokens":6,"completion_tokens":1},"system_fingerprint":"vllm-\\u00e9"}\n\n'
DONE = b"data: [DONE]\n\n"


def fed(edit: UnaskedUsage, *events: bytes) -> bytes:
    return b"".join(edit.feed(event) for event in events) + edit.end()


def test_the_usage_chunk_goes_and_its_fingerprint_ends_the_finished_chunk_as_vllm_writes_it_without_usage():
    edit = UnaskedUsage()
    assert edit.feed(ROLE + TOKEN) == ROLE + TOKEN  # text that spells a finish reason is not one
    assert edit.feed(FINISHED) == b""  # waits for the usage chunk
    fingerprinted = FINISHED[:-3] + b',"system_fingerprint":"vllm-\\u00e9"}\n\n'
    # Escaped where pydantic and orjson write UTF-8: not put back in a spelling vLLM did not use.
    assert edit.feed(USAGE + DONE) == FINISHED + DONE
    assert edit.heard == USAGE
    plain = USAGE.replace(b"vllm-\\u00e9", b"vllm-0.32-abc")
    again = UnaskedUsage()
    assert (
        fed(again, ROLE, FINISHED, plain, DONE)
        == ROLE + fingerprinted.replace(b"vllm-\\u00e9", b"vllm-0.32-abc") + DONE
    )
    assert again.heard == plain


def test_a_usage_chunk_without_a_fingerprint_leaves_the_finished_chunk_as_it_came():
    without = USAGE.replace(b',"system_fingerprint":"vllm-\\u00e9"', b"")
    edit = UnaskedUsage()
    assert fed(edit, ROLE, FINISHED + without + DONE) == ROLE + FINISHED + DONE
    assert edit.heard == without


def test_a_stream_that_does_not_follow_its_finished_chunk_with_usage_is_passed_on_whole():
    edit = UnaskedUsage()
    assert fed(edit, ROLE, FINISHED, DONE) == ROLE + FINISHED + DONE
    assert edit.heard == b""
    ended = UnaskedUsage()
    assert fed(ended, ROLE, FINISHED) == ROLE + FINISHED


def test_usage_is_asked_for_only_where_the_client_did_not_and_one_choice_streams():
    body = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert isinstance(ask_chat_usage(body), UnaskedUsage)
    # Usage on every chunk would change each one: it stays off, as vLLM had it without include_usage.
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    bare = {"stream": True}
    assert ask_chat_usage(bare) is not None and bare["stream_options"]["include_usage"] is True
    for untouched in (
        {"stream": False},
        {},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"stream": True, "n": 2},
    ):
        before = dict(untouched)
        assert ask_chat_usage(untouched) is None
        assert untouched == before


@pytest.mark.parametrize(
    "options", ["yes", {"include_usage": "no"}, {"include_usage": 0}, {"continuous_usage_stats": "on"}]
)
def test_a_spelling_vllm_would_read_loosely_is_a_400_not_a_way_to_hide_tokens(options):
    with pytest.raises(BadRequest):
        ask_chat_usage({"stream": True, "stream_options": options})
