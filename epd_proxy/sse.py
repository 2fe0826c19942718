"""Reading vLLM's server-sent events just far enough to decide about a stream (pure).

vLLM answers a streaming chat request with 200 before the engine runs. Its first event is a
role-only chunk (`delta: {"role": "assistant", "content": ""}`); when generation then fails
(`finish_reason="error"`, e.g. an embedding the EC connector could not obtain) the next event is
`data: {"error": {...}}` followed by `data: [DONE]`. So a stream can still be retried until its
first event that carries something generated, and only the events before that are looked at.
Events are separated by a blank line (`\\n\\n`), which is how vLLM frames them.
"""

from __future__ import annotations

import enum
from typing import Any

import orjson

EVENT_END = b"\n\n"
DONE = b"[DONE]"
# Events that decide nothing are held at most this many bytes before the stream is committed.
MAX_HELD_BYTES = 64 * 1024


class Verdict(enum.Enum):
    HOLD = "hold"  # nothing generated yet: keep holding, a retry is still possible
    COMMIT = "commit"  # something generated (or the stream ended): relay, never retry
    ERROR = "error"  # vLLM reported a failure before generating anything


def judge(held: bytes) -> tuple[Verdict, dict[str, Any] | None]:
    """The verdict on the bytes held so far, and the error object for ERROR."""
    end = held.rfind(EVENT_END)
    if end >= 0:
        for event in held[:end].split(EVENT_END):
            verdict, error = _judge_event(event)
            if verdict is not Verdict.HOLD:
                return verdict, error
    if len(held) > MAX_HELD_BYTES:
        return Verdict.COMMIT, None
    return Verdict.HOLD, None


def _judge_event(event: bytes) -> tuple[Verdict, dict[str, Any] | None]:
    data = b"".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data:
        return Verdict.HOLD, None  # a comment or an event without data
    if data.strip() == DONE:
        return Verdict.COMMIT, None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Verdict.COMMIT, None  # not vLLM's: nothing to judge, pass it on
    if not isinstance(payload, dict):
        return Verdict.COMMIT, None
    error = payload.get("error")
    if error is not None:
        return Verdict.ERROR, error if isinstance(error, dict) else {"message": str(error)}
    choices = payload.get("choices")
    if not isinstance(choices, list):
        return Verdict.COMMIT, None
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return Verdict.COMMIT, None
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return Verdict.COMMIT, None
        if any(value for key, value in delta.items() if key != "role"):
            return Verdict.COMMIT, None
    if payload.get("usage") and not choices:
        return Verdict.COMMIT, None
    return Verdict.HOLD, None


def error_event(message: str, *, error_type: str, code: int, stage: str, backend: str | None = None) -> bytes:
    """An in-band error in vLLM's shape, then [DONE], for a stream whose 200 is already sent."""
    error: dict[str, Any] = {"message": message, "type": error_type, "param": None, "code": code, "stage": stage}
    if backend:
        error["backend"] = backend
    return b"data: " + orjson.dumps({"error": error}) + EVENT_END + b"data: " + DONE + EVENT_END


def complete_events(pending: bytes) -> int:
    """How many leading bytes of `pending` are whole events (up to and including the last blank
    line), so a stream that breaks off is never followed by an error glued to half an event."""
    end = pending.rfind(EVENT_END)
    return 0 if end < 0 else end + len(EVENT_END)
