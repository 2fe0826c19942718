"""The Responses API door (`/v1/responses`): the client's body is forwarded to the consumer's own
`/v1/responses`, its images encoded first (pure functions; see docs/agent-apis.md for why).

vLLM 0.32 validates `input` against the OpenAI SDK's typed dicts, which keep unknown keys, and
turns each item into a chat message (`responses/utils.py`, `_construct_message_from_response_item`)
whose content list reaches the shared chat parser part by part, with whatever else each part
holds. So the proxy reads exactly those lists (`part_list`) with the chat path's rules
(`extract.PartReader`). With a `uuid` that parser reads an `input_image` by its first media key
(`image_url`, a string here), so the consumer names the image by the proxy's uuid, exactly as the
encoder stored it. The SDK types have no `image_embeds` part, so the media stay raw: the consumer
still decodes the image, but loads its embedding instead of running the vision encoder.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import orjson

from epd_proxy.calls.sse import Verdict, answer_object, event_data, events, judged, named_event
from epd_proxy.errors import BadRequest, ProxyError
from epd_proxy.journey.doors import Conversation, Door, Relayed, conversation_of, with_handles
from epd_proxy.journey.extract import (
    Lifted,
    MediaItem,
    NormalisedRequest,
    PartReader,
    ReadOptions,
    check_body,
    parse_request,
    with_parts_replaced,
    with_urls,
)
from epd_proxy.journey.match import Matches
from epd_proxy.journey.prefill import REMOTE_DECODE

RESPONSES_PATH = "/v1/responses"
# State the proxy does not hold: a stored response lives on whichever instance answered it (and
# in E+P+D prefill never sees decode's), and a background response is polled with
# GET /v1/responses/{id}, which the proxy does not route.
STATEFUL_FIELDS = ("previous_response_id", "background")
# Messages in the harmony format, which the proxy does not read for media.
UNREAD_FIELDS = ("previous_input_messages",)
# The input items vLLM 0.32 makes a tool message of, their `output` its content.
TOOL_OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output"})
# Items vLLM turns into an assistant's tool call or reasoning text, whatever else they hold.
TEXT_ONLY_TYPES = frozenset({"function_call", "custom_tool_call", "reasoning"})
TYPED_ITEMS = TOOL_OUTPUT_TYPES | TEXT_ONLY_TYPES


def _refuse_unservable(body: dict[str, Any]) -> None:
    for name in STATEFUL_FIELDS:
        if body.get(name):
            raise BadRequest(
                f"'{name}' needs a response stored on one vLLM instance, which the proxy cannot route to; "
                "send the conversation so far in 'input' instead"
            )
    for name in UNREAD_FIELDS:
        if body.get(name):
            raise BadRequest(f"'{name}' is not supported through the proxy; send the conversation in 'input'")


def part_list(item: Any) -> str | None:
    """The field of an input item whose list vLLM 0.32 parses as chat content parts, if any.

    vLLM's order of cases (`_construct_message_from_response_item`): an item typed as a tool call
    or reasoning becomes a tool call or reasoning text; a tool output becomes a tool message whose
    content is the item's `output`; an assistant item gives vLLM only its text when its content is
    a string or its first part has a `text`; any other item with a `role` is a chat message as it
    stands, `content` and all, whatever its `type`; vLLM refuses the rest.
    tests/e2e/test_vllm_part_places.py checks this against vLLM for every item type its SDK knows.
    """
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind in TOOL_OUTPUT_TYPES:
        return "output" if isinstance(item.get("output"), list) else None
    if kind in TEXT_ONLY_TYPES or "role" not in item or not isinstance(item.get("content"), list):
        return None
    content = item["content"]
    if item["role"] == "assistant" and content and isinstance(content[0], dict) and content[0].get("text") is not None:
        return None
    return "content"


def normalise_responses(
    body: Any, options: ReadOptions = ReadOptions(), lifted: Lifted | None = None
) -> NormalisedRequest:
    """The body with every part vLLM will parse read by the chat path's rules: client uuids
    removed, references and data-less media refused, images as media items.

    Everything else is left for the consumer to judge, so a bad item gets vLLM's own 400 in
    vLLM's words."""
    check_body(body, options.trust_client_fields)
    _refuse_unservable(body)
    entries = body.get("input")
    if not isinstance(entries, list):
        return NormalisedRequest(body, [])
    reader = PartReader(options, lifted, keep_input_image=True, body=body)
    for m, entry in enumerate(entries):
        name = part_list(entry)
        if name is not None:
            reader.read(entry[name], m, name, f"input[{m}].{name}")
    return reader.normalised(body, "input")


def _has_role(role: str) -> Callable[[Any], bool]:
    return lambda item: isinstance(item, dict) and item.get("type") not in TYPED_ITEMS and item.get("role") == role


def responses_conversation(body: dict[str, Any]) -> Conversation:
    """The input items, opened by `instructions` (vLLM's leading system message). An image the
    fleet holds goes raw under the proxy's uuid (`responses_consumer_body`), the name the
    consumer gave it when it first read it."""
    entries, instructions = body.get("input"), body.get("instructions") or None
    if isinstance(entries, str):  # one user message
        return Conversation((entries,), opening=1, preamble=instructions)
    return conversation_of(entries, user=_has_role("user"), preamble=instructions)


def responses_consumer_body(
    body: dict[str, Any], items: Sequence[MediaItem], matches: Matches, *, rewrite: bool, push_mode: bool
) -> dict[str, Any]:
    """The client's body with every image under the proxy's uuid (rewrite) and the EC handles."""
    out = body
    if rewrite and items:
        entries = body["input"]
        named = {item.place: {**item.place.of(entries), "uuid": item.uuid} for item in items}
        out = {**body, "input": with_parts_replaced(entries, named)}
    return with_handles(out, items, matches, rewrite=rewrite, push_mode=push_mode)


def responses_prefill_body(prepared: dict[str, Any]) -> dict[str, Any]:
    return {**prepared, "kv_transfer_params": dict(REMOTE_DECODE), "stream": False, "max_output_tokens": 1}


def _payloads(stream: bytes) -> Iterable[dict[str, Any]]:
    for event in events(stream):
        try:
            payload = orjson.loads(event_data(event))
        except orjson.JSONDecodeError:
            continue
        if isinstance(payload, dict):
            yield payload


def _opened_response(head: bytes) -> dict[str, Any] | None:
    """The response object the stream opened with (`response.created`): the failed one is the
    same response, or the OpenAI SDK's stream helper refuses it."""
    for payload in _payloads(head):
        response = payload.get("response")
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            return response
    return None


def _last_sequence_number(relayed: Relayed) -> int:
    for stream in (relayed.last, relayed.head):
        numbers = [p["sequence_number"] for p in _payloads(stream) if isinstance(p.get("sequence_number"), int)]
        if numbers:
            return numbers[-1]
    return -1


def responses_stream_error(failure: ProxyError, relayed: Relayed) -> bytes:
    """`response.failed`, the Responses API's end of a failed stream, numbered after the last event
    sent and carrying the opened response with status `failed` and the error. vLLM 0.32 has no
    in-band error here (its stream generator cannot serialise one and its connection breaks)."""
    opened = _opened_response(relayed.head)
    if opened is None:  # not a stream as vLLM opens one: the fields the SDK's Response requires
        opened = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    error = {"code": "server_error", "message": failure.message, "type": failure.error_type}
    response = {**opened, "status": "failed", "error": error, "output": [], "usage": None}
    failed = {"type": "response.failed", "sequence_number": _last_sequence_number(relayed) + 1, "response": response}
    return named_event("response.failed", orjson.dumps(failed))


def responses_media_in_body(body: dict[str, Any], moved: Sequence[tuple[MediaItem, str]]) -> dict[str, Any]:
    return {**body, "input": with_urls(body["input"], moved)}


def judge_responses(body: bytes) -> Verdict:
    """A Responses answer vLLM aborted is `cancelled` (harmony models, once an output item is
    whole), or of no output token. vLLM 0.32 answers other models' request aborted partway as
    `completed` with the text so far: nothing tells it from a finished one."""
    if b'"output_tokens":0' not in body and b'"status":"cancelled"' not in body:
        return Verdict.COMMIT
    answer = answer_object(body)
    return judged(answer, answer is not None and answer.get("status") == "cancelled")


RESPONSES = Door(
    "responses",
    RESPONSES_PATH,
    partial(parse_request, normalise=normalise_responses),
    responses_consumer_body,
    responses_prefill_body,
    responses_conversation,
    judge_responses,
    stream_error=responses_stream_error,
    media_in_body=responses_media_in_body,
)
