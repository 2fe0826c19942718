"""Media behind http(s) URLs: fetched once by the proxy, sent on as `data:` URLs and named by
their bytes and kind, so encoder and consumer always hold the same bytes under one name; and the
fetch's guards (private addresses, size, time, redirects, non-media answers) answer the client a 400
in its door's shape without touching any backend."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections import Counter
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from epd_proxy.addresses import Networks
from tests.media import chat, conversation

LOOPBACK = Networks().parse("127.0.0.1/32")
FIRST, SECOND = b"\x89PNG first bytes", b"\x89PNG second, other bytes"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def name_of(url: str, kind: str = "image") -> str:
    """The proxy's name for a `data:` URL: an image's is the reference proxy's, sha256 of the URL."""
    tag = b"" if kind == "image" else kind.encode() + b":"
    return hashlib.sha256(tag + url.encode()).hexdigest()


class MediaServer:
    """An origin on loopback: `/changing` answers other bytes from its second fetch on (a "latest
    screenshot" URL), `/fresh` may be cached for a minute, `/tagged` only revalidated (ETag)."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.revalidated = 0
        self.hang = asyncio.Event()
        app = web.Application()
        app.router.add_get("/{name}", self.handle)
        self.runner = web.AppRunner(app)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.port = port
        return f"http://127.0.0.1:{port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] += 1
        if name == "changing":
            return web.Response(body=FIRST if self.hits[name] == 1 else SECOND, content_type="image/png")
        if name == "fresh":
            return web.Response(body=FIRST, content_type="image/png", headers={"Cache-Control": "max-age=60"})
        if name == "tagged":
            if request.headers.get("If-None-Match") == '"v1"':
                self.revalidated += 1
                return web.Response(status=304, headers={"ETag": '"v1"'})
            return web.Response(body=FIRST, content_type="image/png", headers={"ETag": '"v1"'})
        if name == "nostore":
            return web.Response(body=FIRST, content_type="image/png", headers={"Cache-Control": "no-store, max-age=60"})
        if name == "blob":
            return web.Response(body=FIRST, content_type="application/octet-stream")
        if name == "page":
            return web.Response(text="<html>not found</html>", content_type="text/html")
        if name == "big":
            return web.Response(body=b"x" * 4096, content_type="image/png")
        if name == "slow":
            await self.hang.wait()
            return web.Response(body=FIRST, content_type="image/png")
        if name == "missing":
            return web.Response(status=404, text="no such image")
        if name.startswith("to-"):  # a redirect to the URL-safe base64 of the target
            target = base64.urlsafe_b64decode(name[3:]).decode()
            raise web.HTTPFound(target)
        raise web.HTTPNotFound()

    def redirect(self, base: str, target: str) -> str:
        return f"{base}/to-{base64.urlsafe_b64encode(target.encode()).decode()}"

    async def close(self) -> None:
        self.hang.set()
        await self.runner.cleanup()


@pytest.fixture
async def origin() -> AsyncIterator[tuple[MediaServer, str]]:
    server = MediaServer()
    base = await server.start()
    yield server, base
    await server.close()


def picture(url: str, kind: str = "image") -> dict:
    return {"type": f"{kind}_url", f"{kind}_url": {"url": url}}


async def post(stack, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    async with stack.client.post(path, json=body) as resp:
        return resp.status, orjson.loads(await resp.read())


def consumer_parts(stack, n: int = -1) -> list[dict]:
    body = stack.pd.requests[n].body
    return [p for m in body["messages"] if isinstance(m.get("content"), list) for p in m["content"] if "uuid" in p]


async def test_a_url_whose_bytes_change_gets_the_new_bytes_name_on_the_turn_they_change(make_stack, origin):
    server, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    url = f"{base}/changing"
    status, answer = await post(stack, chat(picture(url)))
    assert status == 200, answer
    [sent] = stack.encoders[0].requests[0].body["messages"][0]["content"]
    assert sent["image_url"]["url"] == data_url(FIRST) and sent["uuid"] == name_of(data_url(FIRST))
    # The next turn re-sends the URL as history, but it answers other bytes now: they are new to
    # the fleet, so an encoder gets them, under their own name, and the consumer gets that name,
    # never the first bytes' (which it holds).
    status, answer = await post(stack, conversation([picture(url)], [{"type": "text", "text": "and now?"}]))
    assert status == 200, answer
    [again] = stack.encoders[0].requests[1].body["messages"][0]["content"]
    assert again["image_url"]["url"] == data_url(SECOND) and again["uuid"] == name_of(data_url(SECOND))
    [history] = consumer_parts(stack)
    assert history["uuid"] == name_of(data_url(SECOND)) != name_of(data_url(FIRST))
    assert server.hits["changing"] == 2


async def test_the_same_bytes_as_image_and_as_video_get_two_names(make_stack, origin):
    _, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    status, answer = await post(stack, chat(picture(f"{base}/blob"), picture(f"{base}/blob", "video")))
    assert status == 200, answer
    parts = [p for r in stack.encoders[0].requests for p in r.body["messages"][0]["content"]]
    by_type = {p["type"]: p for p in parts}
    url = data_url(FIRST, "application/octet-stream")
    assert by_type["image_url"]["image_url"]["url"] == by_type["video_url"]["video_url"]["url"] == url
    assert by_type["image_url"]["uuid"] == name_of(url) != by_type["video_url"]["uuid"] == name_of(url, "video")


async def test_a_url_the_origin_says_is_fresh_is_fetched_once_across_turns(make_stack, origin):
    server, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    for turn in range(3):
        turns = [[picture(f"{base}/fresh")]] + [[{"type": "text", "text": f"turn {n}"}] for n in range(turn)]
        status, answer = await post(stack, conversation(*turns))
        assert status == 200, answer
    assert server.hits["fresh"] == 1
    # only revalidated when the origin gave a validator but no freshness, never kept with no-store
    for _ in range(2):
        assert (await post(stack, chat(picture(f"{base}/tagged"), picture(f"{base}/nostore"))))[0] == 200
    assert server.hits["tagged"] == 2 and server.revalidated == 1 and server.hits["nostore"] == 2


def responses_with(url: str) -> dict:
    parts = [{"type": "input_text", "text": "What is shown?"}, {"type": "input_image", "image_url": url}]
    return {"model": "tiny-vlm", "input": [{"role": "user", "content": parts}]}


def messages_with(url: str) -> dict:
    blocks = [{"type": "text", "text": "What is shown?"}, {"type": "image", "source": {"type": "url", "url": url}}]
    return {"model": "tiny-vlm", "max_tokens": 8, "messages": [{"role": "user", "content": blocks}]}


DOORS = {
    "chat": ("/v1/chat/completions", lambda url: chat(picture(url))),
    "responses": ("/v1/responses", responses_with),
    "messages": ("/v1/messages", messages_with),
}


@pytest.mark.parametrize("door", DOORS)
async def test_every_door_sends_fetched_bytes_to_encoder_and_consumer(make_stack, origin, door):
    _, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    path, build = DOORS[door]
    status, answer = await post(stack, build(f"{base}/changing"), path)
    assert status == 200, answer
    [sent] = stack.encoders[0].requests[0].body["messages"][0]["content"]
    assert sent["image_url"]["url"] == data_url(FIRST)
    # the consumer never sees the URL; Responses and Messages send it the same bytes raw (chat
    # sends the embedding's reference)
    consumer = orjson.dumps(stack.pd.requests[0].body)
    assert b"/changing" not in consumer
    assert (data_url(FIRST).encode() in consumer) == (door != "chat")
    assert stack.pd.loaded_from_cache == 1 and stack.pd.encoded_locally == 0


def refusal(door: str, answer: dict) -> str:
    """The message of a 400 in the door's own shape."""
    if door == "messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        assert answer["error"]["code"] == 400 and answer["error"]["type"] == "invalid_request_error"
    return answer["error"]["message"]


@pytest.mark.parametrize("door", DOORS)
async def test_a_private_address_is_refused_by_default_in_the_doors_shape(make_stack, origin, door):
    server, base = origin
    stack = await make_stack(encoders=1)
    path, build = DOORS[door]
    private = (
        f"{base}/fresh",
        f"http://localhost:{server.port}/fresh",  # a name is checked by the addresses it resolves to
        f"http://2130706433:{server.port}/fresh",  # 127.0.0.1 as one number
        f"http://[::ffff:127.0.0.1]:{server.port}/fresh",
        "http://169.254.169.254/latest/meta-data",
    )
    for url in private:
        status, answer = await post(stack, build(url), path)
        assert status == 400, answer
        message = refusal(door, answer)
        assert "not allowed" in message or "not a canonical IPv4 address" in message, message
    assert server.hits["fresh"] == 0
    assert not stack.encoders[0].requests and not stack.pd.requests
    # allowed by the operator, the same request goes through
    allowed = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    status, answer = await post(allowed, build(f"{base}/fresh"), path)
    assert status == 200, answer


async def test_a_redirect_to_a_private_address_is_refused(make_stack, origin):
    server, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    for target in ("http://169.254.169.254/latest/meta-data", f"http://127.0.0.2:{server.port}/fresh"):
        status, answer = await post(stack, chat(picture(server.redirect(base, target))))
        assert status == 400 and "not allowed" in answer["error"]["message"], answer
    assert server.hits["fresh"] == 0
    # a redirect within what is allowed is followed, up to the limit
    assert (await post(stack, chat(picture(server.redirect(base, f"{base}/fresh")))))[0] == 200
    strict = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK, media_fetch_max_redirects=0)
    status, answer = await post(strict, chat(picture(server.redirect(base, f"{base}/fresh"))))
    assert status == 400 and "redirect" in answer["error"]["message"], answer


@pytest.mark.parametrize(
    "name, overrides, words",
    [
        ("big", {"media_fetch_max_bytes": 1024}, "more than 1024 bytes"),
        ("slow", {"media_fetch_timeout_s": 0.2}, "within 0.2"),
        ("page", {}, "text/html"),
        ("missing", {}, "404"),
    ],
)
async def test_fetch_failures_are_the_clients_400_and_no_backend_sees_them(make_stack, origin, name, overrides, words):
    _, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK, **overrides)
    status, answer = await post(stack, chat(picture(f"{base}/{name}")))
    assert status == 400 and words in answer["error"]["message"], answer
    assert not stack.encoders[0].requests and not stack.pd.requests
    # no encoder was charged for it: the next request is encoded as usual
    status, answer = await post(stack, chat(picture(f"{base}/fresh")))
    assert status == 200 and len(stack.encoders[0].requests) == 1, answer


async def test_an_unreachable_origin_and_a_domain_outside_the_list_are_a_400(make_stack, origin):
    _, base = origin
    stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK, allowed_media_domains=("media.example",))
    status, answer = await post(stack, chat(picture(f"{base}/fresh")))
    assert status == 400 and "media.example" in answer["error"]["message"], answer
    open_stack = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    status, answer = await post(open_stack, chat(picture("http://127.0.0.1:9/x.png")))  # nothing listens there
    assert status == 400 and "could not be fetched" in answer["error"]["message"], answer
    assert not open_stack.encoders[0].requests


async def test_count_tokens_fetches_through_the_same_guards(make_stack, origin):
    server, base = origin
    stack = await make_stack(encoders=1)
    status, answer = await post(stack, messages_with(f"{base}/fresh"), "/v1/messages/count_tokens")
    assert status == 400 and answer["type"] == "error" and "not allowed" in answer["error"]["message"], answer
    assert stack.pd.token_counts == 0 and server.hits["fresh"] == 0
    allowed = await make_stack(encoders=1, media_fetch_allow_networks=LOOPBACK)
    status, answer = await post(allowed, messages_with(f"{base}/fresh"), "/v1/messages/count_tokens")
    assert status == 200 and answer["input_tokens"] == 3, answer
    assert allowed.pd.token_counts == 1 and server.hits["fresh"] == 1
