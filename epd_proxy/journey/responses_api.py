"""The Responses API door (`/v1/responses`): the client's body is forwarded to the consumer's own
`/v1/responses`, its images encoded first (pure functions; see docs/agent-apis.md for why).

vLLM 0.32 validates `input` against the OpenAI SDK's typed dicts, which keep unknown keys, and
builds chat messages from the message items as they are (`responses/utils.py`,
`_construct_message_from_response_item`), so an `input_image` part reaches the shared chat
parser with whatever else it holds. With a `uuid` that parser reads the part by its first media
key (`image_url`, a string here), so the consumer names the image by the proxy's uuid, exactly as
the encoder stored it. An `image_embeds` part is refused by that validation, so the media stay
raw: the consumer still decodes the image, but loads its embedding instead of running the
vision encoder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from epd_proxy.errors import BadRequest
from epd_proxy.fleet.cost import request_costs
from epd_proxy.journey.dataurl import canonical_media_url
from epd_proxy.journey.doors import Door, with_handles
from epd_proxy.journey.extract import (
    REFERENCE_KINDS,
    MediaItem,
    NormalisedRequest,
    ReadOptions,
    check_body,
    content_uuid,
    parse_request,
    with_parts_replaced,
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


def normalise_responses(
    body: Any, options: ReadOptions = ReadOptions(), lifted: Callable[[str], memoryview | None] | None = None
) -> NormalisedRequest:
    """The body with client uuids removed and its `input_image` parts as media items.

    Everything the proxy does not need to find the media is left for the consumer to judge, so a
    bad body gets vLLM's own 400 in vLLM's words."""
    trust_client_fields = options.trust_client_fields
    check_body(body, trust_client_fields)
    _refuse_unservable(body)
    entries = body.get("input")
    if not isinstance(entries, list):
        return NormalisedRequest(body, [])
    items: list[MediaItem] = []
    replaced: dict[tuple[int, int], Any] = {}
    cost = request_costs(body)["image_url"]
    for m, entry in enumerate(entries):
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            where = f"input[{m}].content[{p}]"
            forwarded = part
            if not trust_client_fields:
                reference = next((key for key in REFERENCE_KINDS if key in part), None)
                if reference is not None:
                    raise BadRequest(
                        f"{where} holds '{reference}': embeddings and cache references are made by the proxy, "
                        "not sent by clients"
                    )
                if "uuid" in part:
                    forwarded = {key: value for key, value in part.items() if key != "uuid"}
            url = part.get("image_url")
            if part.get("type") == "input_image" and isinstance(url, str) and url:
                options.check_media_count(len(items))
                canonical = canonical_media_url(url)
                media = {"type": "image_url", "image_url": {"url": canonical}}
                client_uuid = part.get("uuid")
                if trust_client_fields and isinstance(client_uuid, str) and client_uuid:
                    uuid = client_uuid
                else:
                    uuid = content_uuid(media, "image_url", lifted, options.digest)
                    forwarded = {key: value for key, value in part.items() if key != "uuid"}
                if canonical is not url:
                    forwarded = {**forwarded, "image_url": canonical}
                items.append(MediaItem(len(items), "image_url", media, uuid, m, p, cost=cost))
            if forwarded is not part:
                replaced[m, p] = forwarded
    return NormalisedRequest({**body, "input": with_parts_replaced(entries, replaced)} if replaced else body, items)


def responses_consumer_body(
    body: dict[str, Any], items: Sequence[MediaItem], matches: Matches, *, rewrite: bool, push_mode: bool
) -> dict[str, Any]:
    """The client's body with every image under the proxy's uuid (rewrite) and the EC handles."""
    out = body
    if rewrite and items:
        entries = list(body["input"])
        copied: set[int] = set()
        for item in items:
            m = item.message_index
            if m not in copied:
                entries[m] = {**entries[m], "content": list(entries[m]["content"])}
                copied.add(m)
            content = entries[m]["content"]
            content[item.part_index] = {**content[item.part_index], "uuid": item.uuid}
        out = {**body, "input": entries}
    return with_handles(out, items, matches, rewrite=rewrite, push_mode=push_mode)


def responses_prefill_body(prepared: dict[str, Any]) -> dict[str, Any]:
    return {**prepared, "kv_transfer_params": dict(REMOTE_DECODE), "stream": False, "max_output_tokens": 1}


RESPONSES = Door(
    "responses",
    RESPONSES_PATH,
    partial(parse_request, normalise=normalise_responses),
    responses_consumer_body,
    responses_prefill_body,
)
