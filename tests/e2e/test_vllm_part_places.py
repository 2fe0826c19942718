"""Where the pinned vLLM parses content parts, against where each door reads them.

A content part reaches vLLM's chat parser only from certain lists of a request: a chat message's
`content`, and whatever a Responses item or an Anthropic block is turned into. Every such list is
a place a client can put an embeddings reference or a data-less cache lookup, so each door must
read exactly those lists with the chat path's rules. These tests build one item or message of
every type vLLM's request models know (from the type hints, so a type added by an upgrade is
built too), put a marked part in each of its lists (and in `content` and `output` beside a
`role`, which vLLM takes as a chat message whatever the type), run vLLM's own validation and
conversion, and record the parts its chat parser is handed. A new place fails here until the
door reads it. No servers are started; only vLLM's parsing code is imported.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin
from unittest import mock

import pydantic
import pytest
from typing_extensions import is_typeddict

from epd_proxy.journey.extract import REFERENCE_KINDS
from epd_proxy.journey.messages_api import normalise_messages
from epd_proxy.journey.responses_api import part_list

pytestmark = pytest.mark.e2e
chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
chat_protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
responses_protocol = pytest.importorskip("vllm.entrypoints.openai.responses.protocol")
responses_utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
anthropic_protocol = pytest.importorskip("vllm.entrypoints.anthropic.protocol")
anthropic_serving = pytest.importorskip("vllm.entrypoints.anthropic.serving")

SEQUENCES = (list, collections.abc.Iterable, collections.abc.Sequence)


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) in (typing.Required, typing.NotRequired) or type(tp).__name__ == "_AnnotatedAlias":
        tp = get_args(tp)[0]
    return tp


def _members(tp: Any) -> list[Any]:
    tp = _unwrap(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in _members(arg)]
    return [tp]


def _is_record(tp: Any) -> bool:
    return is_typeddict(tp) or (isinstance(tp, type) and issubclass(tp, pydantic.BaseModel))


def _fields(tp: Any) -> dict[str, tuple[Any, bool]]:
    """name -> (annotation, required)."""
    if not is_typeddict(tp):
        return {name: (f.annotation, f.is_required()) for name, f in tp.model_fields.items()}
    hints = typing.get_type_hints(tp, include_extras=True)

    def required(name: str) -> bool:
        origin = get_origin(hints[name])
        return origin is typing.Required or (origin is not typing.NotRequired and name in tp.__required_keys__)

    return {name: (hint, required(name)) for name, hint in hints.items()}


def example(tp: Any, depth: int = 0) -> Any:
    """A small value of type `tp`: its required keys only, the first of each union and literal."""
    tp = _unwrap(tp)
    origin = get_origin(tp)
    if origin is Literal:
        return get_args(tp)[0]
    if origin in (Union, types.UnionType):
        options = [m for m in get_args(tp) if m is not type(None)]
        return example(options[0], depth) if options else None
    if origin in SEQUENCES:
        return [example(get_args(tp)[0], depth + 1)] if get_args(tp) and depth < 6 else []
    if origin is dict or tp is dict:
        return {}
    if _is_record(tp):
        return {name: example(hint, depth + 1) for name, (hint, required) in _fields(tp).items() if required}
    return {str: "x", bool: False, int: 1, float: 1.0}.get(tp, {})


def list_elements(hint: Any) -> list[Any]:
    """The record types a field's lists may hold."""
    return [
        element
        for option in _members(hint)
        if get_origin(option) in SEQUENCES and get_args(option)
        for element in _members(get_args(option)[0])
        if _is_record(element)
    ]


def literal_values(records: list[Any], name: str) -> set[str]:
    return {
        value
        for record in records
        for hint, _ in [_fields(record).get(name, (None, False))]
        for option in _members(hint)
        if get_origin(option) is Literal
        for value in get_args(option)
    }


def marked_variants(records: list[Any], extra_lists: tuple[str, ...], extra: dict[str, list[Any]]):
    """One value per record and list: the record with a marked part (`probe` naming the list) as
    that list's only element, for every element type the list takes; and the record with each
    of `extra_lists` added, under each combination of `extra` keys' values."""
    elements = {
        id(e): e
        for r in records
        for name, (hint, _) in _fields(r).items()
        if name in extra_lists
        for e in list_elements(hint)
    }
    for record in records:
        base = example(record)
        for name, (hint, _) in _fields(record).items():
            for element in list_elements(hint):
                yield record, {**base, name: [{**example(element), "probe": name}]}
        for name in extra_lists:
            for element in elements.values():
                for key, values in extra.items():
                    for value in values:
                        yield record, {**base, key: value, name: [{**example(element), "probe": name}]}


def marks(parts: Any) -> set[str]:
    return {p["probe"] for p in parts if isinstance(p, dict) and "probe" in p} if isinstance(parts, list) else set()


class _Tracker:
    def create_parser(self, **_: Any) -> object:
        return object()


def parts_parsed(messages: list[Any]) -> list[Any]:
    """The parts vLLM's chat parser is handed for these chat messages, in order."""
    parts: list[Any] = []
    with mock.patch.object(chat_utils, "_parse_chat_message_content_part", lambda part, *_, **__: parts.append(part)):
        for message in messages:
            chat_utils._parse_chat_message_content(message, _Tracker(), "openai", interleave_strings=False)
    return parts


def lists_parsed(messages: list[Any]) -> set[str]:
    """The `probe` marks of the parts vLLM's chat parser is handed."""
    return {
        mark
        for part in parts_parsed(messages)
        if (mark := part.get("probe") if isinstance(part, dict) else getattr(part, "probe", None)) is not None
    }


def responses_lists_parsed(item: dict[str, Any]) -> tuple[bool, set[str] | None]:
    """Whether vLLM's request model takes `item`, and the lists of it vLLM parses as content
    parts (None where vLLM refuses the item: nothing reaches the parser)."""
    try:
        request = responses_protocol.ResponsesRequest.model_validate({"model": "m", "input": [item]})
    except pydantic.ValidationError:
        return False, None
    try:
        return True, lists_parsed(responses_utils.construct_input_messages(request_input=request.input))
    except Exception:  # vLLM's 400 for an item it does not take
        return True, None


def test_the_responses_door_reads_every_list_vllm_parses_and_no_other():
    records = [m for m in _members(responses_protocol.ResponseInputOutputItem) if _is_record(m)]
    roles = sorted(literal_values(records, "role"))
    judged: set[str] = set()
    wrong = []
    for record, item in marked_variants(records, ("content", "output"), {"role": roles}):
        valid, parsed = responses_lists_parsed(item)
        if valid:
            judged.add(record.__name__)
        if parsed is None:
            continue
        read = part_list(item)
        if parsed != marks(item.get(read) if read else None):
            wrong.append((item, sorted(parsed), read))
    assert not wrong, f"(item, the lists vLLM parses, the list the proxy reads): {wrong[:5]}"
    assert {r.__name__ for r in records} <= judged, "an item type vLLM never validated: extend `example`"
    assert {"content", "output"} <= {read for r, i in marked_variants(records, (), {}) if (read := part_list(i))}


def test_the_chat_door_reads_every_messages_content_and_vllm_parses_nothing_else():
    records = [m for m in _members(chat_protocol.ChatCompletionMessageParam) if _is_record(m)]
    roles = sorted(literal_values(records, "role") | {"custom"})
    judged: set[str] = set()
    wrong = []
    for record, message in marked_variants(records, ("content", "output"), {"role": roles}):
        try:
            request = chat_protocol.ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})
            parsed = lists_parsed(request.messages)
        except Exception:  # refused by vLLM
            continue
        judged.add(record.__name__)
        # normalise_request reads the content list of every message, whatever its role.
        if parsed != marks(message.get("content")):
            wrong.append((message, sorted(parsed)))
    assert not wrong, f"vLLM parses lists of a chat message besides its content: {wrong[:5]}"
    assert judged, "no chat message vLLM accepted: extend `example`"


def _block(kind: str, url: str) -> dict[str, Any]:
    """An Anthropic block of `kind` with every field filled, a forged uuid and reference beside."""
    source = {"type": "url", "url": url, "uuid": "forged", "image_embeds": {}}
    inner = [
        {"type": "image", "source": {**source, "url": url + "?tool"}},
        {"type": "text", "text": "t"},
        {"type": "input_image", "image_url": url + "?input", "uuid": "forged"},
        {"type": "image_url", "image_url": {"url": url + "?chat"}, "uuid": "forged"},
        {"type": "tool_reference", "tool_name": "t"},
    ]
    return {
        "type": kind,
        "text": "t",
        "source": source,
        "id": "i",
        "tool_use_id": "i",
        "name": "n",
        "input": {},
        "content": inner,
        "thinking": "t",
        "tool_name": "n",
        "data": "d",
        "uuid": "forged",
        "image_embeds": {},
    }


def test_the_messages_door_reads_every_image_vllm_builds_and_no_client_part_reaches_the_parser():
    kinds = sorted(literal_values([anthropic_protocol.AnthropicContentBlock], "type"))
    roles = sorted(literal_values([anthropic_protocol.AnthropicMessage], "role"))
    judged = 0
    for role in roles:
        for kind in kinds:
            blocks = [_block(kind, f"https://x/{role}-{kind}-{n}.png") for n in range(2)]
            body = {"model": "m", "max_tokens": 4, "system": blocks, "messages": [{"role": role, "content": blocks}]}
            try:
                request = anthropic_protocol.AnthropicMessagesRequest.model_validate(body)
                chat = anthropic_serving.AnthropicServingMessages.to_chat_completion_request(request)
            except Exception:  # refused by vLLM
                continue
            judged += 1
            parts = parts_parsed(chat.messages)
            # Every part vLLM parses is one it built: no client uuid, no reference.
            assert not [p for p in parts if "uuid" in p or REFERENCE_KINDS & p.keys()], (role, kind, parts)
            parsed = [p["image_url"]["url"] for p in parts if p.get("type") == "image_url"]
            read = [item.part["image_url"]["url"] for item in normalise_messages(body).items]
            assert read == parsed, (role, kind)
    assert judged >= len(kinds), "vLLM accepted too few of the built messages: extend `_block`"
