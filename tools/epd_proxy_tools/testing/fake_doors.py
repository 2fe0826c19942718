"""The fakes' `/v1/responses` and `/v1/messages`: what vLLM 0.32 does with them, reduced to what the
proxy can tell apart (pure functions; fake_vllm.py serves them).

vLLM serves both by building a chat completion from the body and converting its answer back:
Messages in `anthropic/serving.py` (`to_chat_completion_request`, `messages_full_converter`,
`message_stream_converter`), Responses in `openai/responses/` (`construct_input_messages`, the
typed output items and events). So the fakes do the same: `chat_view` is the chat body the
consumer would run, and the answer is written in the API's own shapes, errors included.
"""

from __future__ import annotations

import json
import time
from typing import Any

import orjson

RESPONSES, MESSAGES = "responses", "messages"
PATHS = {RESPONSES: "/v1/responses", MESSAGES: "/v1/messages"}
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


class Refused(ValueError):
    """A body vLLM's validation refuses: a 400 in the API's error shape."""


def _image_url(source: Any) -> str:
    """`_convert_image_source_to_url`, as vLLM has it."""
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


# vLLM drops system text that starts so: Claude Code's per-request attribution, which would defeat
# prefix caching.
BILLING_HEADER = "x-anthropic-billing-header"


def _system_text(content: Any) -> str:
    """`_extract_system_text`: a system's text blocks, joined, billing headers left out."""
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    texts = [b.get("text") or "" for b in content if isinstance(b, dict) and b.get("type") == "text"]
    return "".join(t for t in texts if not t.startswith(BILLING_HEADER))


def _tool_result(chat: list[dict[str, Any]], block: dict[str, Any]) -> None:
    """A user's `tool_result` as `_convert_user_tool_result` makes it: a tool message of its text,
    then a user message of its images, both before the message that holds it."""
    inner = block.get("content")
    entries = [i for i in (inner if isinstance(inner, list) else ()) if isinstance(i, dict)]
    text = inner if isinstance(inner, str) else "\n".join(i.get("text", "") for i in entries if i.get("type") == "text")
    chat.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})
    urls = [_image_url(i.get("source", {})) for i in entries if i.get("type") == "image"]
    if urls:
        chat.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]})


def _messages_view(body: dict[str, Any]) -> list[dict[str, Any]]:
    for name in ("model", "messages", "max_tokens"):
        if name not in body:
            raise Refused(f"Field required: {name}")
    if not isinstance(body["max_tokens"], int) or body["max_tokens"] <= 0:
        raise Refused("max_tokens must be positive")
    if not isinstance(body["messages"], list):
        raise Refused("messages: Input should be a valid list")
    chat: list[dict[str, Any]] = []
    system = _system_text(body.get("system") or "")
    if system:
        chat.append({"role": "system", "content": system})
    for message in body["messages"]:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise Refused("messages: each needs a role of user, assistant or system")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise Refused("messages.content: Input should be a valid string or list")
        if message["role"] == "system":
            if text := _system_text(content):
                chat.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
            continue
        out: dict[str, Any] = {"role": message["role"]}
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                function = {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}
                calls.append({"id": block.get("id"), "type": "function", "function": function})
            elif kind == "tool_result" and message["role"] == "user":
                _tool_result(chat, block)
            elif kind == "tool_result":
                inner = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {inner if inner else ''}"})
            elif kind not in ("text", "image", "thinking", "redacted_thinking"):
                raise Refused(f"messages.content.type: Input should be a known block type, got {kind!r}")
        if reasoning:
            out["reasoning"] = "".join(reasoning)
        if calls:
            out["tool_calls"] = calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            out["content"] = parts[0]["text"]
        elif parts:
            out["content"] = parts
        # A user message left with nothing (its tool results went before it) is dropped.
        if message["role"] != "user" or "content" in out:
            chat.append(out)
    return chat


# The part types the OpenAI SDK's input item types take in a message's `content` and in a tool
# output's `output`, which vLLM validates `input` against.
CONTENT_PARTS = ("input_text", "input_image", "input_file", "output_text", "refusal")
OUTPUT_PARTS = ("input_text", "input_image", "input_file")


def _check_parts(parts: Any, allowed: tuple[str, ...], where: str) -> None:
    for part in parts if isinstance(parts, list) else ():
        if not isinstance(part, dict) or part.get("type") not in allowed:
            raise Refused(f"{where}: Input should be {', '.join(allowed)}")


def _to_assistant(chat: list[dict[str, Any]], key: str, value: Any) -> None:
    """vLLM's merging of consecutive assistant items: a tool call joins the previous assistant
    message's calls, reasoning or text fills its field if still empty, else a new message."""
    previous = chat[-1] if chat and chat[-1]["role"] == "assistant" else None
    if previous is not None and key == "tool_calls":
        previous.setdefault("tool_calls", []).append(value)
    elif previous is not None and previous.get(key) is None:
        previous[key] = value
    else:
        chat.append({"role": "assistant", key: [value] if key == "tool_calls" else value})


def _responses_item(chat: list[dict[str, Any]], item: Any) -> None:
    """One input item as `_construct_message_from_response_item` makes it a chat message."""
    if not isinstance(item, dict):
        raise Refused("input: Input should be a valid dictionary")
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments", "") if kind == "function_call" else item.get("input", "")
        call = {"name": item.get("name"), "arguments": arguments}
        _to_assistant(chat, "tool_calls", {"id": item.get("call_id"), "type": "function", "function": call})
    elif kind == "reasoning":
        texts = item.get("content") or item.get("summary") or [{}]
        _to_assistant(chat, "reasoning", texts[0].get("text", ""))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise Refused("input.output: Input should be a valid string or list")
        _check_parts(output, OUTPUT_PARTS, "input.output")
        chat.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
    elif "role" not in item:
        raise Refused(f"Unsupported input item type: {kind}")
    else:
        content = item.get("content")
        _check_parts(content, CONTENT_PARTS, "input.content")
        first = content[0] if isinstance(content, list) and content else None
        text = content if isinstance(content, str) else first.get("text") if isinstance(first, dict) else None
        if item["role"] == "assistant" and text is not None:
            _to_assistant(chat, "content", text)
        else:
            chat.append(item)


def _responses_view(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "input" not in body:
        raise Refused("input: Field required")
    chat: list[dict[str, Any]] = []
    if body.get("instructions"):
        chat.append({"role": "system", "content": body["instructions"]})
    entries = body["input"]
    if isinstance(entries, str):
        return chat + [{"role": "user", "content": entries}]
    if not isinstance(entries, list):
        raise Refused("input: Input should be a valid string or list")
    for entry in entries:
        _responses_item(chat, entry)
    return chat


def chat_view(api: str, body: Any) -> dict[str, Any]:
    """The chat completion vLLM runs for `body`, with what the fakes read of it."""
    if not isinstance(body, dict):
        raise Refused("Input should be a valid dictionary")
    messages = _messages_view(body) if api == MESSAGES else _responses_view(body)
    view = {k: v for k, v in body.items() if k not in ("messages", "input", "instructions", "system")}
    view["messages"] = messages
    if api == RESPONSES and "max_output_tokens" in body:
        view["max_tokens"] = body["max_output_tokens"]
    return view


def error_body(api: str, message: str, status: int, kind: str | None = None) -> bytes:
    """An API's error as vLLM's router writes it: Messages keeps the chat error's type."""
    kind = kind or ("BadRequestError" if status == 400 else "InternalServerError")
    if api == MESSAGES:
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


def _usage(api: str, usage: dict[str, int]) -> dict[str, int]:
    if api == MESSAGES:
        return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
    return {
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
    }


def answer_json(
    api: str,
    answer_id: str,
    model: Any,
    text: str,
    usage: dict[str, int],
    kv: Any = None,
    stop_reason: Any = "end_turn",
) -> bytes:
    """An answer of `text`; a Messages one without a `stop_reason` (None) is one vLLM aborted."""
    if api == MESSAGES:
        out: dict[str, Any] = {
            "id": answer_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": model,
            "usage": _usage(api, usage),
        }
        if stop_reason is not None:  # vLLM leaves a null out
            out["stop_reason"] = stop_reason
    else:
        out = {
            "id": f"resp_{answer_id}",
            "created_at": int(time.time()),
            "model": model,
            "object": "response",
            "output": [_output_message(answer_id, text)],
            "status": "completed",
            "usage": _usage(api, usage),
        }
    if kv is not None:
        out["kv_transfer_params"] = kv
    return orjson.dumps(out)


def _output_message(answer_id: str, text: str) -> dict[str, Any]:
    return {
        "id": f"msg_{answer_id}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _message_opening(answer_id: str, model: Any) -> dict[str, Any]:
    """The message a Messages stream opens with, nothing in it yet."""
    return {"id": answer_id, "type": "message", "role": "assistant", "content": [], "model": model}


def _response_opening(answer_id: str, model: Any) -> dict[str, Any]:
    """The response a Responses stream opens with (`response.created`, `response.in_progress`)."""
    return {"id": f"resp_{answer_id}", "object": "response", "model": model, "status": "in_progress", "output": []}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def stream_frames(api: str, answer_id: str, model: Any, pieces: list[str], usage: dict[str, int]) -> list[bytes]:
    """The answer's events, in the order vLLM writes them."""
    text = "".join(pieces)
    if api == MESSAGES:
        start = _message_opening(answer_id, model)
        frames = [
            _event("message_start", {"type": "message_start", "message": {**start, "usage": _usage(api, usage)}}),
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
        ]
        frames += [
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
            )
            for piece in pieces
        ]
        frames.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        frames.append(
            _event(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": _usage(api, usage)},
            )
        )
        frames.append(_event("message_stop", {"type": "message_stop"}))
        return frames
    response = _response_opening(answer_id, model)
    item_id = f"msg_{answer_id}"
    at = {"output_index": 0, "item_id": item_id, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    # What `streaming_events.py` emits for plain text: the item and its part open, the deltas, then
    # the text, the part and the item done.
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response}),
        ("response.in_progress", {"response": response}),
        (
            "response.output_item.added",
            {"output_index": 0, "item": {**_output_message(answer_id, ""), "content": [], "status": "in_progress"}},
        ),
        ("response.content_part.added", {**at, "part": part}),
    ]
    events += [("response.output_text.delta", {**at, "delta": piece, "logprobs": []}) for piece in pieces]
    done = _output_message(answer_id, text)
    events += [
        ("response.output_text.done", {**at, "text": text, "logprobs": []}),
        ("response.content_part.done", {**at, "part": done["content"][0]}),
        ("response.output_item.done", {"output_index": 0, "item": done}),
        (
            "response.completed",
            {"response": {**response, "status": "completed", "output": [done], "usage": _usage(api, usage)}},
        ),
    ]
    return [_event(name, {"type": name, "sequence_number": n, **data}) for n, (name, data) in enumerate(events)]


def aborted_json(api: str, answer_id: str, model: Any, usage: dict[str, int]) -> bytes:
    """An answer of no token: Messages with an empty text and no `stop_reason`, Responses with an
    empty message, `completed`."""
    if api == MESSAGES:
        return answer_json(api, answer_id, model, "", usage, stop_reason=None)
    message = {**_output_message(answer_id, ""), "content": []}
    response = {"id": f"resp_{answer_id}", "object": "response", "model": model, "status": "completed"}
    return orjson.dumps({**response, "output": [message], "usage": _usage(api, usage)})


def aborted_stream(api: str, answer_id: str, model: Any, usage: dict[str, int]) -> bytes:
    """A stream of no token: Messages opens and ends with `end_turn` and 0 output tokens,
    Responses opens and completes with no output."""
    if api == MESSAGES:
        start = _message_opening(answer_id, model)
        delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": _usage(api, usage)}
        return (
            _event("message_start", {"type": "message_start", "message": {**start, "usage": _usage(api, usage)}})
            + _event("message_delta", delta)
            + _event("message_stop", {"type": "message_stop"})
        )
    response = _response_opening(answer_id, model)
    completed = {**response, "status": "completed", "usage": _usage(api, usage)}
    events = [("response.created", response), ("response.in_progress", response), ("response.completed", completed)]
    return b"".join(
        _event(name, {"type": name, "sequence_number": n, "response": data}) for n, (name, data) in enumerate(events)
    )


def stream_error(api: str, answer_id: str, model: Any) -> bytes:
    """What the API's stream says when the generation under it fails after its 200: its opening
    events, then the error."""
    if api == MESSAGES:
        start = _message_opening(answer_id, model)
        error = {"type": "error", "error": {"type": "internal_error", "message": "Internal server error"}}
        return _event("message_start", {"type": "message_start", "message": start}) + _event("error", error)
    response = _response_opening(answer_id, model)
    return (
        _event("response.created", {"type": "response.created", "sequence_number": 0, "response": response})
        + _event("response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": response})
        + _event("error", {"type": "error", "code": "500", "message": "Internal server error", "sequence_number": 2})
    )
