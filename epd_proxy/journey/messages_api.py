"""The Anthropic Messages door (`/v1/messages`): the client's body is forwarded to the consumer's
own `/v1/messages`, its images encoded first (pure functions; see docs/agent-apis.md for why).

vLLM 0.32 turns a Messages request into a chat completion inside the consumer
(`anthropic/serving.py`, `to_chat_completion_request`): each image block becomes an `image_url`
part whose URL is the block's `url` source, or a data URL built from a base64 source's
`media_type` and `data`; a user's `tool_result` blocks put their images in a user message of
their own, which goes into the conversation before the message that holds them. The block has no
field for a uuid, so the consumer names each image by its content: the encoder is sent the very
URL the consumer will build, without the proxy's uuid, so both derive one identifier.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import orjson

from epd_proxy.calls.sse import Verdict, answer_object, judged, named_event
from epd_proxy.errors import BadRequest, ProxyError
from epd_proxy.fleet.cost import request_costs
from epd_proxy.journey.doors import Conversation, Door, Relayed, chat_conversation, error_fields, with_handles
from epd_proxy.journey.extract import (
    Lifted,
    MediaItem,
    NormalisedRequest,
    Place,
    ReadOptions,
    check_body,
    content_uuid,
    fetched_from,
    parse_json_body,
)
from epd_proxy.journey.prefill import REMOTE_DECODE
from epd_proxy.journey.splice import Spliced, lift_base64_members

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# vLLM leaves system text that starts so out of the prompt (`_convert_system_message`): Claude
# Code's attribution, different on every request.
BILLING_HEADER = "x-anthropic-billing-header"


def image_source_url(source: Any) -> str | None:
    """The URL vLLM makes of an image source (`_convert_image_source_to_url`), or None where the
    consumer would fail on it anyway (it says why, in its own words)."""
    if not isinstance(source, dict) or not source:
        return None
    if source.get("type") == "url":
        url = source.get("url", "")
        return url if isinstance(url, str) and url else None
    media_type, data = source.get("media_type", "image/jpeg"), source.get("data", "")
    if not isinstance(media_type, str) or not isinstance(data, str) or not data:
        return None
    return f"data:{media_type};base64,{data}"


def _image_urls(message: dict[str, Any]) -> Iterator[tuple[int, str]]:
    """(block index, URL) of a message's images in the order the consumer's prompt holds them."""
    content = message.get("content")
    if not isinstance(content, list):
        return
    blocks = [(b, block) for b, block in enumerate(content) if isinstance(block, dict)]
    if message.get("role") == "user":
        for b, block in blocks:
            inner = block.get("content") if block.get("type") == "tool_result" else None
            for entry in inner if isinstance(inner, list) else ():
                if isinstance(entry, dict) and entry.get("type") == "image":
                    url = image_source_url(entry.get("source", {}))
                    if url is not None:
                        yield b, url
    for b, block in blocks:
        if block.get("type") == "image":
            url = image_source_url(block.get("source"))
            if url is not None:
                yield b, url


def normalise_messages(
    body: Any, options: ReadOptions = ReadOptions(), lifted: Lifted | None = None
) -> NormalisedRequest:
    """The body as the client sent it and its images as media items; the consumer judges the rest."""
    check_body(body, options.trust_client_fields)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return NormalisedRequest(body, [])
    items: list[MediaItem] = []
    cost = request_costs(body)["image_url"]
    for m, message in enumerate(messages):
        # vLLM keeps only the text of a system message.
        if not isinstance(message, dict) or message.get("role") == "system":
            continue
        for b, url in _image_urls(message):
            options.check_media_count(len(items))
            part = {"type": "image_url", "image_url": {"url": url}}
            fetch = fetched_from(url, f"messages[{m}].content[{b}]")
            uuid = "" if fetch else content_uuid(part, "image_url", lifted, options.digest)
            place = Place(m, "content", b)
            items.append(MediaItem(len(items), "image_url", part, uuid, place, named=False, cost=cost, fetch=fetch))
    return NormalisedRequest(body, items)


def parse_messages(
    raw: bytes | bytearray, options: ReadOptions = ReadOptions()
) -> tuple[NormalisedRequest, Spliced | None]:
    """`extract.parse_request` for this door: every large base64 `data` is lifted out first, and
    the outcome is the full parse's (else the full parse runs): each lifted string must be an
    image source the consumer builds a URL from, `data:<media type>;base64,` and then its bytes."""
    lifted = lift_base64_members(raw, b"data", options.lift_min_bytes)
    if lifted is not None:
        skeleton, spliced = lifted
        prefix = spliced.prefix

        def url_bytes(url: str) -> bytes | None:
            at = url.find(prefix)
            return None if at < 0 else b"".join((url[:at].encode(), spliced.span(url[at:])))

        try:
            normalised = normalise_messages(orjson.loads(skeleton), options, lifted=url_bytes)
        except (orjson.JSONDecodeError, BadRequest):
            normalised = None  # the full parse gives the exact error
        if normalised is not None:
            used = sum(1 for item in normalised.items if prefix in item.part["image_url"]["url"])
            if used == len(spliced.spans):
                return normalised, spliced
    return normalise_messages(parse_json_body(raw), options), None


def system_text(system: Any) -> str | None:
    """The system prompt the consumer's prompt opens with: the top-level `system` (a string, or its
    text blocks joined), without the billing headers vLLM drops; None where there is none."""
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = [b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text" and b.get("text")]
    else:
        return None
    text = "".join(t for t in texts if isinstance(t, str) and not t.startswith(BILLING_HEADER))
    return text or None


def messages_conversation(body: dict[str, Any]) -> Conversation:
    """The Anthropic messages, told apart by role as a chat's, opened by the system prompt as the
    consumer reads it. An image the fleet holds goes raw as the client sent it: the consumer
    names it by its content, as it did when it first read it."""
    return replace(chat_conversation(body), preamble=system_text(body.get("system")))


def _with_fetched_sources(block: Any, urls: dict[str, str]) -> Any:
    """An image block (or a tool result's images) with each fetched `url` source pointing at the
    fetched bytes: vLLM makes its image part's URL of a `url` source as it stands."""
    if not isinstance(block, dict):
        return block
    source = block.get("source")
    if block.get("type") == "image" and isinstance(source, dict) and source.get("type") == "url":
        url = source.get("url")
        return {**block, "source": {**source, "url": urls[url]}} if isinstance(url, str) and url in urls else block
    inner = block.get("content")
    if block.get("type") == "tool_result" and isinstance(inner, list):
        return {**block, "content": [_with_fetched_sources(entry, urls) for entry in inner]}
    return block


def messages_media_in_body(body: dict[str, Any], moved: Sequence[tuple[MediaItem, str]]) -> dict[str, Any]:
    urls = {item.fetch: url for item, url in moved if item.fetch}
    messages = list(body["messages"])
    for m in {item.place.entry for item, _ in moved}:
        message = messages[m]
        messages[m] = {**message, "content": [_with_fetched_sources(block, urls) for block in message["content"]]}
    return {**body, "messages": messages}


def messages_prefill_body(prepared: dict[str, Any]) -> dict[str, Any]:
    # vLLM skips the thinking budget's check on a leg with do_remote_decode, for this max_tokens.
    return {**prepared, "kv_transfer_params": dict(REMOTE_DECODE), "stream": False, "max_tokens": 1}


def anthropic_error(exc: ProxyError) -> bytes:
    """vLLM's Anthropic error shape (`anthropic/api_router.py`, `translate_error_response`)."""
    kind, message = error_fields(exc)
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_stream_error(failure: ProxyError, relayed: Relayed) -> bytes:
    """How vLLM's Messages stream ends on a failure (`message_stream_converter`): an `error` event
    holding Anthropic's error object, and nothing after it; the Anthropic SDK raises on it."""
    return named_event("error", anthropic_error(failure))


def judge_messages(body: bytes) -> Verdict:
    """A Messages answer vLLM aborted has no `stop_reason`: vLLM gives one for stop, length and
    tool calls only (repetition, the other reason without one, is not a Messages option), leaves
    a null out, and answers an engine error with 500."""
    # Parsed whole: a tool call's input is JSON of the model's, whose keys no byte mark can tell
    # from the answer's own.
    answer = answer_object(body)
    if answer is not None and answer.get("type") != "message":
        answer = None
    return judged(answer, answer is not None and answer.get("stop_reason") is None)


# The consumer gets the client's body as sent, with the EC handles.
MESSAGES = Door(
    "messages",
    MESSAGES_PATH,
    parse_messages,
    with_handles,
    messages_prefill_body,
    messages_conversation,
    judge_messages,
    error_body=anthropic_error,
    stream_error=anthropic_stream_error,
    media_in_body=messages_media_in_body,
)
