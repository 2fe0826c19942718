"""The APIs a request may come in by (its door) and what each changes in the journey.

Every door runs the same journey (encode, prefill, decode, retries); a door decides everything
that depends on its API's shape: how the client's body is read for media (`parse`), where its
conversation opens (`conversation`: what prefix affinity keys on), what the consumer is sent
(`consumer_body`, `prefill_body`) on which path, what it is asked to report (`ask_usage`), how
it tells an answer vLLM aborted (`judge`), and the shape of the errors the proxy itself makes:
as an HTTP answer, and in-band when a stream breaks after its 200 (`stream_error`). Its `name`
labels metrics and the request log, its `path` traces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.calls.sse import Verdict, answer_object, error_event, judged
from epd_proxy.errors import ErrorAnswer, ProxyError
from epd_proxy.fleet.backends import CHAT_PATH
from epd_proxy.journey.extract import MediaItem, NormalisedRequest, ReadOptions, parse_request, with_urls
from epd_proxy.journey.match import Matches
from epd_proxy.journey.prefill import prefill_request
from epd_proxy.journey.rewrite import ec_item_list, rewrite_request, transfer_params
from epd_proxy.journey.splice import Spliced
from epd_proxy.journey.stream_usage import UnaskedUsage, ask_chat_usage

ConsumerBody = Callable[..., dict[str, Any]]
# (body, each fetched item with the `data:` URL of its bytes) -> the body holding those bytes
# where it held the item's http(s) URL (journey/remote.py).
MediaInBody = Callable[[dict[str, Any], Sequence[tuple[MediaItem, str]]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Relayed:
    """What a stream had sent its client when it broke: the head held until decode committed (the
    stream's opening events) and the last whole events passed on; both as they went out, unread."""

    head: bytes
    last: bytes


def chat_stream_error(failure: ProxyError, relayed: Relayed) -> bytes:
    """vLLM's own in-band error of a chat stream, then [DONE]."""
    return error_event(
        failure.message,
        error_type=failure.error_type,
        code=failure.status,
        stage=failure.stage,
        backend=failure.backend,
    )


@dataclass(frozen=True, slots=True)
class Conversation:
    """Where a body's conversation opens, in its door's own list of entries (chat messages,
    Responses input items, Anthropic messages), for the conversation key (reuse.py). Nothing of
    the history's shape counts as sent before: what the fleet holds is what the proxy saw (held.py)."""

    entries: Sequence[Any] = ()
    # entries[:opening] open the conversation, through its first user entry: the same on every
    # turn. 0: no user entry, no conversation to follow.
    opening: int = 0
    # What the consumer's prompt holds before the entries, as the consumer reads it (Responses
    # `instructions`, Anthropic `system`): part of the opening.
    preamble: Any = None


def conversation_of(entries: Any, *, user: Callable[[Any], bool], preamble: Any = None) -> Conversation:
    """The conversation in `entries`, opened through the first entry the door's `user` test takes."""
    if not isinstance(entries, list):
        return Conversation()
    opening = next((m + 1 for m, entry in enumerate(entries) if user(entry)), 0)
    return Conversation(entries, opening, preamble)


def _role_is(role: str) -> Callable[[Any], bool]:
    return lambda entry: isinstance(entry, dict) and entry.get("role") == role


def chat_conversation(body: dict[str, Any]) -> Conversation:
    """A chat's messages; its system prompt is a message of the opening."""
    return conversation_of(body.get("messages"), user=_role_is("user"))


def usage_always_reported(body: dict[str, Any]) -> UnaskedUsage | None:
    return None


def judge_chat(body: bytes) -> Verdict:
    """A chat answer vLLM aborted (a pause, a shutdown) says `finish_reason` "abort" (unless a
    tool call it parsed turned that into "tool_calls"), with no token or partway."""
    # vLLM writes compact JSON, and generated text, tool arguments included, is inside strings,
    # its quotes escaped: an answer without these marks is not parsed.
    if b'"finish_reason":"abort"' not in body and b'"completion_tokens":0' not in body:
        return Verdict.COMMIT
    answer = answer_object(body)
    choices = answer.get("choices") if answer is not None else None
    cut = isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)
    return judged(answer, cut)


def chat_media_in_body(body: dict[str, Any], moved: Sequence[tuple[MediaItem, str]]) -> dict[str, Any]:
    return {**body, "messages": with_urls(body["messages"], moved)}


@dataclass(frozen=True, slots=True)
class Door:
    name: str
    path: str
    # (raw body, the proxy's read options) -> (the request, the splice its media point into).
    parse: Callable[[bytes | bytearray, ReadOptions], tuple[NormalisedRequest, Spliced | None]]
    # (body, items, matches, rewrite=, push_mode=) -> the body prefill (E+P+D) or decode gets.
    consumer_body: ConsumerBody
    prefill_body: Callable[[dict[str, Any]], dict[str, Any]]
    # (body) -> where its conversation opens. The consumer body sends the items the fleet holds
    # raw, under the name the consumer gives them, so a consumer holding them reuses them.
    conversation: Callable[[dict[str, Any]], Conversation]
    # (a whole 200 JSON answer) -> NOTHING or CUT when vLLM aborted it, as this API tells, else
    # COMMIT: nothing of it has reached the client, so another instance may answer it.
    judge: Callable[[bytes], Verdict]
    # The proxy's own error in this API's shape; None keeps the proxy's (OpenAI's) shape.
    error_body: Callable[[ProxyError], bytes] | None = None
    # The events that end a stream broken after its 200, in this API's stream shape, so the
    # client's SDK sees a failure rather than an answer cut short.
    stream_error: Callable[[ProxyError, Relayed], bytes] = chat_stream_error
    # Where fetched media go in this door's body.
    media_in_body: MediaInBody = chat_media_in_body
    # (body) -> the edit that hides the usage the proxy asked for in `body` (changed in place), for
    # an API whose answers report usage only when asked.
    ask_usage: Callable[[dict[str, Any]], UnaskedUsage | None] = usage_always_reported

    def error(self, exc: ProxyError) -> bytes | None:
        """The body of an error answer, or None to answer in the proxy's own shape.

        A consumer of this door answers in its API's shape already; an encoder is always called
        by chat completions, so its answer is reshaped like the proxy's own errors."""
        if self.error_body is None:
            return None
        if isinstance(exc, ErrorAnswer) and exc.raw_body and exc.stage != "encode":
            return exc.raw_body
        return self.error_body(exc)


def _chat_consumer_body(
    body: dict[str, Any], items: Sequence[MediaItem], matches: Matches, *, rewrite: bool, push_mode: bool
) -> dict[str, Any]:
    return rewrite_request(body, items, matches, rewrite=rewrite, push_mode=push_mode)


def with_handles(
    body: dict[str, Any], items: Sequence[MediaItem], matches: Matches, *, rewrite: bool, push_mode: bool
) -> dict[str, Any]:
    """`body` with the EC handles attached: what a consumer needs whose API takes no `*_embeds`."""
    out = dict(body)
    params = transfer_params(body, matches.handles, ec_item_list(items, matches) if rewrite or push_mode else [])
    if params is not None:
        out["ec_transfer_params"] = params
    return out


CHAT = Door(
    "chat",
    CHAT_PATH,
    parse_request,
    _chat_consumer_body,
    prefill_request,
    chat_conversation,
    judge_chat,
    ask_usage=ask_chat_usage,
)


def error_fields(exc: ProxyError) -> tuple[str, str]:
    """(type, message) of an error, read from a backend's OpenAI-shaped body where there is one."""
    if isinstance(exc, ErrorAnswer) and exc.raw_body:
        try:
            parsed = orjson.loads(exc.raw_body)
        except orjson.JSONDecodeError:
            parsed = None
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            kind = error.get("type")
            return (kind if isinstance(kind, str) else exc.error_type), error["message"]
    return exc.error_type, exc.message
