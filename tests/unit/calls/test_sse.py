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
        DONE,
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]},"finish_reason":null}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"},"finish_reason":null}]}\n\n',
        b"data: not json\n\n",
    ],
)
def test_anything_generated_or_unknown_commits(event):
    assert judge(ROLE + event)[0] is Verdict.COMMIT


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
