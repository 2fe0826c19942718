"""Request builders shared by the tests."""

from __future__ import annotations

import base64
from typing import Any


def image(name: str) -> dict[str, Any]:
    data = base64.b64encode(f"image-{name}".encode()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def audio(name: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": f"https://media.example/{name}.wav"}}


def video(name: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": f"https://media.example/{name}.mp4"}}


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
