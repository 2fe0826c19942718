"""Reading vLLM's server-sent events just far enough to decide about a stream (pure).

vLLM answers a streaming chat request with 200 before the engine runs. Its first event is a
role-only chunk (`delta: {"role": "assistant", "content": ""}`); when generation then fails
(`finish_reason="error"`, e.g. an embedding the EC connector could not obtain) the next event is
`data: {"error": {...}}` followed by `data: [DONE]`. So a stream can still be retried until its
first event that carries something generated, and only the events before that are looked at.

Events are framed as the SSE spec has it (WHATWG HTML, "server-sent events"): a line ends with
CRLF, LF or CR, and an empty line ends an event. vLLM writes `\n\n`, but anything in front of it
may use the others. One event may be at most MAX_EVENT_BYTES (8 MiB) before its empty line: the
largest vLLM writes is the first event of a request with `return_token_ids`, which lists every
prompt token id (about 7 bytes each), so this fits a prompt of a million tokens. A longer one
ends the stream (EventTooLarge), so a backend that never ends an event cannot grow the proxy.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import orjson

EVENT_END = b"\n\n"
DONE = b"[DONE]"
# Events that decide nothing are held at most this many bytes before the stream is committed.
MAX_HELD_BYTES = 64 * 1024
MAX_EVENT_BYTES = 8 * 1024 * 1024
# What vLLM's Messages and Responses streams open with before anything is generated
# (`message_stream_converter`, `responses_stream_generator`): a failure after them is still a retry.
OPENING_EVENTS = frozenset({"message_start", "ping", "response.created", "response.in_progress"})

_CR, _LF = 0x0D, 0x0A
_LINE_END_RUN = re.compile(rb"[\r\n]+")
# One event from the start of a line: its lines, then an empty line. Matched greedily over whole
# events, a CR followed by LF is always taken as one line end.
_EVENT = re.compile(rb"(?:[^\r\n]+(?:\r\n?|\n))*(?:\r\n?|\n)")


class EventTooLarge(Exception):
    """An event went past the cap before its empty line; `ready` holds the whole events before it,
    not yet passed on. The framer that raised it is not to be fed again."""

    def __init__(self, ready: bytes, limit: int) -> None:
        super().__init__(f"an SSE event is larger than {limit} bytes")
        self.ready = ready
        self.limit = limit


class Framer:
    """Cuts a stream, fed chunk by chunk, into whole events with their bytes unchanged, passing each
    one on as soon as it has ended. Each chunk is looked at once: between chunks only the event not
    yet ended is kept, with where its last line stands.

    An empty line ending in CR ends its event at once, so a stream framed with CR is not held back
    waiting for the next byte; when that CR turns out to begin a CRLF, its LF is passed on first
    thing from the next chunk (it still belongs to the event before)."""

    __slots__ = ("_pending", "_line_start", "_cr", "_cr_ended_event", "_limit")

    def __init__(self, max_event_bytes: int | None = MAX_EVENT_BYTES) -> None:
        self._pending = bytearray()
        self._line_start = True  # the last byte ended a line (or nothing came yet)
        self._cr = False  # the last byte was a CR: an LF next completes that CRLF
        self._cr_ended_event = False  # and that CR ended the event last passed on
        self._limit = max_event_bytes

    @property
    def pending(self) -> bytes:
        """The event begun but not ended yet."""
        return bytes(self._pending)

    def feed(self, chunk: bytes) -> bytes:
        """The whole events this chunk ends (b"" if none), raising EventTooLarge past the cap."""
        pending, limit = self._pending, self._limit
        if self._cr or _CR in chunk or (limit is not None and len(pending) + len(chunk) > limit):
            return self._feed_any(chunk)
        # vLLM's own framing, the hot path: with no CR anywhere an event ends at an LF that follows
        # an LF, and the last such pair in the chunk marks how far the events go.
        end = chunk.rfind(EVENT_END)
        if end >= 0:
            end += 2
        elif chunk and self._line_start and chunk[0] == _LF:  # an empty line begins the chunk
            end = 1
        elif chunk:
            self._line_start = chunk[-1] == _LF
            pending += chunk
            return b""
        else:
            return b""
        self._line_start = chunk[-1] == _LF
        return self._take(chunk, end)

    def _feed_any(self, chunk: bytes) -> bytes:
        """Any line ends, looked at byte by byte but only where a run of CR and LF bytes is."""
        limit = self._limit
        # `end`: where the last event ended in this chunk, -len(pending) while none did.
        end = -len(self._pending)
        line_start, cr = self._line_start, self._cr
        cr_end = 0 if self._cr_ended_event else -1  # where a CR ended an event: an LF there joins it
        last_stop = 0
        for run in _LINE_END_RUN.finditer(chunk):
            run_start, last_stop = run.span()
            if run_start:  # the run follows other bytes in this chunk
                line_start = cr = False
            for i in range(run_start, last_stop):
                byte = chunk[i]
                if cr and byte == _LF:
                    cr = False
                    if cr_end == i:
                        end = i + 1
                    continue
                cr = byte == _CR
                if line_start:
                    if limit is not None and i - end > limit:
                        raise EventTooLarge(self._take(chunk, end, keep_rest=False), limit)
                    end = i + 1
                    if cr:
                        cr_end = end
                line_start = True
        if last_stop < len(chunk):
            line_start = cr = False
        self._line_start, self._cr = line_start, cr
        self._cr_ended_event = cr and cr_end == len(chunk)
        if limit is not None and len(chunk) - end > limit:
            raise EventTooLarge(self._take(chunk, end, keep_rest=False), limit)
        return self._take(chunk, end)

    def _take(self, chunk: bytes, end: int, keep_rest: bool = True) -> bytes:
        """The whole events, the pending bytes and the chunk up to `end` (none while `end` is not
        positive: no event ended in this chunk); the rest of the chunk is pending then."""
        pending = self._pending
        if end <= 0:
            ready = b""
            end = 0
        elif pending:
            pending += chunk[:end]
            ready = bytes(pending)
            pending.clear()
        else:
            ready = chunk[:end]
        if keep_rest and end < len(chunk):
            pending += chunk[end:]
        return ready


def events(whole: bytes) -> list[bytes]:
    """Whole events (as Framer.feed passes them on) one by one."""
    return _EVENT.findall(whole)


class Verdict(enum.Enum):
    HOLD = "hold"  # nothing generated yet: keep holding, a retry is still possible
    COMMIT = "commit"  # something generated (or the stream ended): relay, never retry
    ERROR = "error"  # vLLM reported a failure before generating anything
    # vLLM aborted the request (`POST /pause`, a shutdown) before its engine ran it: the answer
    # ended, or reported its usage, having generated no token (any generation, even of an
    # end-of-sequence first token, counts one).
    NOTHING = "aborted before generating"
    # vLLM aborted a JSON answer partway, as its door tells (`Door.judge`): read whole, nothing
    # of it has reached the client.
    CUT = "aborted partway"


class Head:
    """The verdict on a stream's head, fed chunk by chunk; each event is judged once, when it ends."""

    __slots__ = ("held", "_framer")

    def __init__(self) -> None:
        self.held = bytearray()
        # No cap here: the head is committed past MAX_HELD_BYTES, and the relay applies the cap.
        self._framer = Framer(max_event_bytes=None)

    def judge(self, chunk: bytes) -> tuple[Verdict, dict[str, Any] | None]:
        """The verdict on everything held so far, and the error object for ERROR."""
        self.held += chunk
        for event in events(self._framer.feed(chunk)):
            verdict, error = _judge_event(event)
            if verdict is not Verdict.HOLD:
                return verdict, error
        if len(self.held) > MAX_HELD_BYTES:
            return Verdict.COMMIT, None
        return Verdict.HOLD, None


def event_data(event: bytes) -> bytes:
    """An event's data as the spec reads it: one space after the colon dropped, lines joined with LF."""
    return b"\n".join(
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.splitlines()
        if line.startswith(b"data:") or line == b"data"
    )


def _judge_event(event: bytes) -> tuple[Verdict, dict[str, Any] | None]:
    data = event_data(event)
    if not data:
        return Verdict.HOLD, None  # a comment or an event without data
    if data.strip() == DONE:
        # Judged only until something is generated: an ending chat stream got no finish reason.
        return Verdict.NOTHING, None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Verdict.COMMIT, None  # not vLLM's: nothing to judge, pass it on
    if not isinstance(payload, dict):
        return Verdict.COMMIT, None
    error = payload.get("error")
    if error is not None:
        return Verdict.ERROR, error if isinstance(error, dict) else {"message": str(error)}
    kind = payload.get("type")
    if kind in OPENING_EVENTS:
        return Verdict.HOLD, None
    if kind == "error":  # the Responses API's error event carries its fields at the top
        return Verdict.ERROR, payload
    choices = payload.get("choices")
    if not isinstance(choices, list):
        # Messages' `message_delta` and Responses' `response.completed` end the answer with its usage.
        if kind == "message_delta":
            return _ending(payload.get("usage"))
        if kind == "response.completed":
            response = payload.get("response")
            return _ending(response.get("usage") if isinstance(response, dict) else None)
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
        return _ending(payload["usage"])
    return Verdict.HOLD, None


def output_tokens(usage: Any, missing: Any = None) -> Any:
    """What an answer's usage reports as generated, in any API's spelling (chat's completion tokens,
    Messages' and Responses' output tokens), unchecked; `missing` when it reports none."""
    if not isinstance(usage, dict):
        return missing
    return usage.get("completion_tokens", usage.get("output_tokens", missing))


def generated_nothing(usage: Any) -> bool:
    """Whether an answer's usage (any API's) says no token was generated."""
    output = output_tokens(usage)
    return type(output) is int and output == 0


def answer_object(body: bytes) -> dict[str, Any] | None:
    """A JSON answer's top-level object; None when the body is not one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def judged(answer: dict[str, Any] | None, cut: bool) -> Verdict:
    """The verdict on a whole JSON answer whose door found it `cut` short by an abort."""
    if answer is None:
        return Verdict.COMMIT
    if generated_nothing(answer.get("usage")):
        return Verdict.NOTHING
    return Verdict.CUT if cut else Verdict.COMMIT


def _ending(usage: Any) -> tuple[Verdict, None]:
    return (Verdict.NOTHING if generated_nothing(usage) else Verdict.COMMIT), None


def named_event(name: str, data: bytes) -> bytes:
    """One event (its JSON `data` on one line) of the Messages and Responses streams, which name
    each event by its type."""
    return b"event: " + name.encode() + b"\ndata: " + data + EVENT_END


def error_event(message: str, *, error_type: str, code: int, stage: str, backend: str | None = None) -> bytes:
    """An in-band error in vLLM's chat shape, then [DONE], for a stream whose 200 is already sent."""
    error: dict[str, Any] = {"message": message, "type": error_type, "param": None, "code": code, "stage": stage}
    if backend:
        error["backend"] = backend
    return b"data: " + orjson.dumps({"error": error}) + EVENT_END + b"data: " + DONE + EVENT_END
