"""A streamed chat answer reports its tokens to the proxy even when its client did not ask (pure).

Tenants are charged, and prompt sizes learnt, from the `usage` an answer reports. vLLM's chat
stream reports it only when `stream_options.include_usage` is set: then, after the chunk that ends
the choice, one more chunk with no choices holds the usage, and the `system_fingerprint` that would
have ended the choice's chunk moves to it (`chat_completion/serving.py`). So where the client did
not ask, the proxy asks (`ask_chat_usage`) and gives the client back the stream it would have got
(`UnaskedUsage`): the usage chunk taken out, its fingerprint put back where it was, every other
byte as vLLM wrote it.
"""

from __future__ import annotations

from typing import Any

import orjson

from epd_proxy.calls.sse import event_data, events
from epd_proxy.errors import BadRequest

# Only the chunk that ends a choice names a reason as a string (a JSON string in generated text
# has its quotes escaped); the usage chunk has an empty list of choices.
_FINISHED = b'"finish_reason":"'
_NO_CHOICES = b'"choices":[]'
_FINGERPRINT = b'"system_fingerprint":'


class UnaskedUsage:
    """The edit of one stream, fed its whole events in order (`feed`), then `end` for what it
    still holds. The chunk that ends the choice waits for the usage chunk behind it; `heard` is
    that usage chunk, unread."""

    __slots__ = ("_finished", "heard")

    def __init__(self) -> None:
        self._finished = b""
        self.heard = b""

    def feed(self, ready: bytes) -> bytes:
        """What of these whole events goes to the client now."""
        if not self._finished and _FINISHED not in ready and _NO_CHOICES not in ready:
            return ready
        out = bytearray()
        for event in events(ready):
            if not self.heard:
                fingerprint = _usage_fingerprint(event)
                if fingerprint is not None:
                    self.heard = event
                    out += _with_fingerprint(self._finished, fingerprint)
                    self._finished = b""
                    continue
                if _FINISHED in event and not self._finished:
                    self._finished = event
                    continue
            # Anything else after the finished chunk (not what vLLM sends) lets it go as it came.
            out += self._finished + event
            self._finished = b""
        return bytes(out)

    def end(self) -> bytes:
        """The finished chunk still held, when no usage chunk followed it."""
        held, self._finished = self._finished, b""
        return held


def _usage_fingerprint(event: bytes) -> bytes | None:
    """For the usage chunk the proxy asked for: its fingerprint as written there (b"" when it has
    none). None for any other event."""
    if _NO_CHOICES not in event:
        return None
    try:
        payload = orjson.loads(event_data(event))
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or payload.get("choices") != [] or not isinstance(payload.get("usage"), dict):
        return None
    fingerprint = payload.get("system_fingerprint")
    if not isinstance(fingerprint, str):
        return b""
    written = _FINGERPRINT + orjson.dumps(fingerprint)
    # Put back only as vLLM wrote it; where orjson would spell it otherwise, the chunk goes without.
    return written if written in event else b""


def _with_fingerprint(finished: bytes, fingerprint: bytes) -> bytes:
    """The chunk that ended the choice as vLLM writes it without usage: the fingerprint its last field."""
    if not finished or not fingerprint or _FINGERPRINT in finished:
        return finished
    close = finished.rfind(b"}")
    if close < 0:
        return finished
    return finished[:close] + b"," + fingerprint + finished[close:]


def ask_chat_usage(body: dict[str, Any]) -> UnaskedUsage | None:
    """Ask for usage in a streamed chat `body` (changed in place) whose client did not, and return
    the edit that gives the client its stream as it asked for it. None where there is nothing to
    ask: not streamed, asked already, or several choices (each would wait for the usage chunk)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return None
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    for name in ("include_usage", "continuous_usage_stats"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            # vLLM would read "no" as false: a client must not hide its tokens behind a spelling.
            raise BadRequest(f"'stream_options.{name}' must be a boolean")
    if options.get("include_usage"):
        return None
    # Usage per chunk was not asked for (vLLM gives it only with include_usage): it stays off.
    body["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": False}
    return UnaskedUsage()
