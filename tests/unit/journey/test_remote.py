"""Fetched media put into each door's body and named by their bytes (journey/remote.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import pytest

from epd_proxy.calls.media import Fetched, FetchRules
from epd_proxy.errors import BadRequest
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.messages_api import MESSAGES, normalise_messages
from epd_proxy.journey.remote import FETCHES_PER_REQUEST, fetch_media
from epd_proxy.journey.responses_api import RESPONSES, normalise_responses
from tests.media import chat

URL = "https://media.example/a"


class Origin:
    def __init__(self, data: bytes = b"bytes", media_type: str = "image/png", request_bytes: int = 1 << 20) -> None:
        self.answer = Fetched(data, media_type)
        self.asked: list[str] = []
        self.rules = FetchRules(request_bytes=request_bytes)
        self.at_once = self.most_at_once = 0

    async def fetch(self, url: str) -> Fetched:
        self.asked.append(url)
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        await asyncio.sleep(0.001)
        self.at_once -= 1
        return self.answer


def inline(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def fetched(normalised, door, origin):
    return asyncio.run(fetch_media(normalised, origin, door, lambda data, tag: hashlib.sha256(tag + data).hexdigest()))


def test_one_fetch_per_url_and_every_item_named_by_its_bytes_and_kind():
    origin = Origin(media_type="video/jpeg")
    body = chat({"type": "image_url", "image_url": {"url": URL}}, {"type": "video_url", "video_url": URL})
    out = fetched(normalise_request(body), CHAT, origin)
    assert origin.asked == [URL]
    # vLLM reads a video/jpeg data URL as frames, not as the file it would have fetched
    url = inline(b"bytes", "application/octet-stream")
    image, video = out.items
    assert image.part["image_url"]["url"] == video.part["video_url"] == url
    assert image.uuid == hashlib.sha256(url.encode()).hexdigest() != video.uuid
    assert not image.fetch and not video.fetch
    assert out.body["messages"][0]["content"][1:] == [image.part, video.part]
    assert body["messages"][0]["content"][1]["image_url"]["url"] == URL, "the client's body is never changed"


@pytest.mark.parametrize("media_type", ["text/html", "application/json", "text/plain"])
def test_a_document_is_not_media(media_type):
    with pytest.raises(BadRequest, match=media_type):
        fetched(
            normalise_request(chat({"type": "image_url", "image_url": {"url": URL}})), CHAT, Origin(b"x", media_type)
        )


def test_responses_and_messages_bodies_hold_the_bytes_where_they_held_the_url():
    origin = Origin()
    url = inline(b"bytes", "image/png")
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": URL, "detail": "auto"}]}]}
    out = fetched(normalise_responses(responses), RESPONSES, origin)
    assert out.body["input"][0]["content"][0] == {"type": "input_image", "image_url": url, "detail": "auto"}
    image = {"type": "image", "source": {"type": "url", "url": URL}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    messages = {"messages": [{"role": "user", "content": [image, result]}]}
    out = fetched(normalise_messages(messages), MESSAGES, origin)
    moved = {"type": "image", "source": {"type": "url", "url": url}}
    assert out.body["messages"][0]["content"] == [moved, {**result, "content": [moved]}]
    assert [item.part["image_url"]["url"] for item in out.items] == [url, url]


def test_a_request_fetches_a_few_urls_at_a_time_and_no_more_bytes_than_a_body_may_hold():
    many = chat(*({"type": "image_url", "image_url": {"url": f"{URL}?{i}"}} for i in range(40)))
    origin = Origin(b"x" * 10)
    fetched(normalise_request(many), CHAT, origin)
    assert len(origin.asked) == 40 and origin.most_at_once == FETCHES_PER_REQUEST
    # 40 URLs of 10 bytes against a budget of 100: refused, and the fetches stop.
    small = Origin(b"x" * 10, request_bytes=100)
    with pytest.raises(BadRequest, match="more than 100 bytes"):
        fetched(normalise_request(many), CHAT, small)
    assert len(small.asked) < 40
