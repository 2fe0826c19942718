"""Judging the head of a vLLM stream: retry is possible until something generated went out."""

from __future__ import annotations

import json

import orjson
import pytest

from epd_proxy.calls.sse import MAX_HELD_BYTES, Head, Verdict, error_event

# vLLM's first event (role only) and its GenerationError event, as serving.py writes them.
ROLE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
ERROR = (
    b"data: "
    + json.dumps(
        {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
    ).encode()
    + b"\n\n"
)
CONTENT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"


def judge(held: bytes):
    return Head().judge(held)


def test_role_chunk_alone_is_held():
    assert judge(ROLE) == (Verdict.HOLD, None)
    assert judge(ROLE[:20]) == (Verdict.HOLD, None)
    assert judge(b": keep-alive\n\n" + ROLE) == (Verdict.HOLD, None)


def test_error_after_the_role_chunk_is_an_error_even_split_anywhere():
    stream = ROLE + ERROR + DONE
    verdicts = [judge(stream[:cut])[0] for cut in range(len(stream) + 1)]
    first_error = len(ROLE) + len(ERROR)
    assert set(verdicts[:first_error]) == {Verdict.HOLD}
    assert set(verdicts[first_error:]) == {Verdict.ERROR}
    assert judge(stream)[1]["message"] == "Internal server error"


def test_generated_content_commits_and_a_later_error_no_longer_counts():
    assert judge(ROLE + CONTENT)[0] is Verdict.COMMIT
    assert judge(ROLE + CONTENT + ERROR)[0] is Verdict.COMMIT


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]},"finish_reason":null}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"},"finish_reason":null}]}\n\n',
        b"data: not json\n\n",
    ],
)
def test_anything_generated_or_unknown_commits(event):
    assert judge(ROLE + event)[0] is Verdict.COMMIT


# What vLLM 0.32 streams when it aborts a request before its engine ran it (`POST /pause`, a
# shutdown), captured from a real server: no finish reason, and usage, where reported, of 0 tokens.
USAGE_0 = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":76,"total_tokens":76,"completion_tokens":0}}\n\n'
ROLE_WITH_USAGE = ROLE.replace(b'"finish_reason":null}]', b'"finish_reason":null}],"usage":{"completion_tokens":0}')
MESSAGE_START = b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"stop_reason":null,"usage":{"input_tokens":76,"output_tokens":0}}}\n\n'
MESSAGE_DELTA = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"input_tokens":76,"output_tokens":%d}}\n\n'
CREATED = b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"r","status":"in_progress","output":[],"usage":null}}\n\n'
COMPLETED = b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,"response":{"id":"r","status":"completed","output":[],"usage":{"input_tokens":76,"output_tokens":%d,"total_tokens":76}}}\n\n'


@pytest.mark.parametrize(
    "stream",
    [
        ROLE + DONE,
        ROLE + USAGE_0 + DONE,
        ROLE_WITH_USAGE + USAGE_0 + DONE,
        MESSAGE_START + MESSAGE_DELTA % 0,
        CREATED + COMPLETED % 0,
    ],
    ids=["chat", "chat-usage", "chat-continuous-usage", "messages", "responses"],
)
def test_a_stream_that_ends_having_generated_nothing_says_so(stream):
    assert judge(stream) == (Verdict.NOTHING, None)


def test_a_generation_of_one_token_is_something():
    # A first token that is end-of-sequence: an empty text, but one token generated.
    eos = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}\n\n'
    assert (
        judge(ROLE + eos + USAGE_0.replace(b'"completion_tokens":0', b'"completion_tokens":1') + DONE)[0]
        is Verdict.COMMIT
    )
    assert judge(ROLE_WITH_USAGE) == (Verdict.HOLD, None)
    assert judge(MESSAGE_START + MESSAGE_DELTA % 1)[0] is Verdict.COMMIT
    assert judge(CREATED + COMPLETED % 1)[0] is Verdict.COMMIT


def test_endless_undecided_events_commit_after_a_bound():
    assert judge(b": ping\n\n" * (MAX_HELD_BYTES // 8 + 1))[0] is Verdict.COMMIT


def test_error_event_has_vllms_shape_and_ends_the_stream():
    event = error_event("gone", error_type="upstream_error", code=502, stage="decode", backend="http://d")
    first, done, rest = event.split(b"\n\n")
    assert orjson.loads(first[6:])["error"] == {
        "message": "gone",
        "type": "upstream_error",
        "param": None,
        "code": 502,
        "stage": "decode",
        "backend": "http://d",
    }
    assert done == b"data: [DONE]" and rest == b""
