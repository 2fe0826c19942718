"""Request builders shared by the tests."""

from __future__ import annotations

import base64
from typing import Any


def image(name: str) -> dict[str, Any]:
    data = base64.b64encode(f"image-{name}".encode()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def _inline(media_type: str, content: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(content.encode()).decode()}"


def audio(name: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": _inline("audio/wav", f"audio-{name}")}}


def video(name: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": _inline("video/mp4", f"video-{name}")}}


def chat(*parts: dict[str, Any], text: str = "What is shown?", **fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny-vlm",
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
        "max_tokens": 8,
        **fields,
    }


def conversation(*turns: list[dict[str, Any]], reply: str = "Noted.", **fields: Any) -> dict[str, Any]:
    """A chat's body on its last turn: every earlier turn's user parts, each answered by `reply`,
    re-sent in front of the last, as chat clients and agents do."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You operate a browser."}]
    for n, parts in enumerate(turns):
        if n:
            messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": [{"type": "text", "text": f"step {n}"}, *parts]})
    return {"model": "tiny-vlm", "messages": messages, "max_tokens": 8, **fields}


def data_url(name: str) -> str:
    return image(name)["image_url"]["url"]


def agent_responses(*shots: str, tools: bool = False, **fields: Any) -> dict[str, Any]:
    """An agent's Responses body on its last turn: one screenshot per turn (`shots`), the history
    re-sent. A later turn's screenshot comes back from a tool call (`tools`), after the model's
    reasoning and call, or from the user after the model's reply."""
    entries: list[dict[str, Any]] = []
    for k, shot in enumerate(shots):
        picture = {"type": "input_image", "image_url": data_url(shot)}
        if k and tools:
            entries += [
                {"type": "reasoning", "id": f"rs_{k}", "summary": [{"type": "summary_text", "text": "look again"}]},
                {"type": "function_call", "id": f"fc_{k}", "call_id": f"call_{k}", "name": "shot", "arguments": "{}"},
                {"type": "function_call_output", "call_id": f"call_{k}", "output": [picture]},
            ]
            continue
        if k:
            reply = {"type": "output_text", "text": "Noted.", "annotations": []}
            entries.append(
                {"type": "message", "id": f"msg_{k}", "role": "assistant", "status": "completed", "content": [reply]}
            )
        entries.append({"role": "user", "content": [{"type": "input_text", "text": f"step {k}"}, picture]})
    return {
        "model": "tiny-vlm",
        "instructions": "You operate a browser.",
        "input": entries,
        "max_output_tokens": 8,
        **fields,
    }


def agent_messages(*shots: str, tools: bool = False, **fields: Any) -> dict[str, Any]:
    """The same agent on the Anthropic Messages API: a `tool_result` returns the tool's screenshot."""
    messages: list[dict[str, Any]] = []
    for k, shot in enumerate(shots):
        data = data_url(shot).split(",", 1)[1]
        picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        if k and tools:
            call = {"type": "tool_use", "id": f"toolu_{k}", "name": "shot", "input": {}}
            result = {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": [picture]}
            messages += [{"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
            continue
        if k:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": "Noted."}]})
        messages.append({"role": "user", "content": [{"type": "text", "text": f"step {k}"}, picture]})
    return {"model": "tiny-vlm", "system": "You operate a browser.", "max_tokens": 8, "messages": messages, **fields}
