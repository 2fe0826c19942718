"""Fuzzing the endpoint: whatever bytes a client sends, the answer is never a 5xx and always JSON."""

from __future__ import annotations

import asyncio
import http.client
import threading

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epd_proxy_tools.testing.harness import start_stack
from tests.media import chat, image


@pytest.fixture(scope="module")
def proxy_port():
    """Proxy and fakes on an event loop in a thread, so hypothesis can drive it synchronously."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def start():
        holder["stack"] = await start_stack(encoders=2, probe_interval_s=0)
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield holder["stack"].port
    asyncio.run_coroutine_threadsafe(holder["stack"].close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def post(port: int, body: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def check(port: int, body: bytes) -> None:
    status, content_type, payload = post(port, body)
    assert status < 500, (status, body[:300], payload[:300])
    if status != 200:
        assert content_type.startswith("application/json"), (status, content_type)
        assert "error" in orjson.loads(payload)


VALID = orjson.dumps(chat(image("A"), image("B"), image("A")))
KEYS = st.sampled_from(
    [
        "messages",
        "role",
        "content",
        "type",
        "text",
        "image_url",
        "url",
        "audio_url",
        "video_url",
        "input_audio",
        "data",
        "uuid",
        "stream",
        "model",
        "image_embeds",
        "mm_processor_kwargs",
        "max_tokens",
        "ec_transfer_params",
    ]
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(
        ["image_url", "audio_url", "video_url", "input_audio", "text", "user", "data:image/png;base64,QQ=="]
    ),
)
JSON = st.recursive(
    LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)),
    max_leaves=25,
)
SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@settings(max_examples=250, deadline=None, suppress_health_check=SUPPRESS)
@given(value=JSON)
def test_generated_json_bodies(proxy_port, value):
    check(proxy_port, orjson.dumps(value))


@settings(max_examples=150, deadline=None, suppress_health_check=SUPPRESS)
@given(messages=st.lists(st.dictionaries(KEYS, JSON, max_size=4), min_size=1, max_size=3))
@example(messages=[{"content": [{"type": []}]}])  # once answered 500: an unhashable content type
def test_generated_message_lists(proxy_port, messages):
    check(proxy_port, orjson.dumps({"model": "tiny-vlm", "messages": messages}))


@settings(max_examples=250, deadline=None, suppress_health_check=SUPPRESS)
@given(data=st.data())
def test_mutated_valid_bodies(proxy_port, data):
    body = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 6))):
        action = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = data.draw(st.integers(0, max(len(body) - 1, 0)))
        if action == "flip" and body:
            body[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del body[at:]
        elif action == "insert":
            body[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif body:
            del body[at : at + data.draw(st.integers(1, 16))]
    check(proxy_port, bytes(body))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body",
    [
        # deeper than orjson writes (254 levels), in a field forwarded to the encoders and PD
        orjson.dumps(chat(image("A"))).replace(
            b'"max_tokens"', b'"mm_processor_kwargs":{"x":%s},"max_tokens"' % nested(300)
        ),
        # in a field only PD gets, so the encoders have answered by then
        orjson.dumps(chat(image("A"))).replace(b'"max_tokens"', b'"metadata":%s,"max_tokens"' % nested(300)),
        # deeper than Python's json writes, inside a media part that has no URL (named by its JSON)
        b'{"model":"tiny-vlm","messages":[{"role":"user","content":[{"type":"input_audio",'
        b'"input_audio":{"data":"AAAA","format":"wav","x":%s}}]}]}' % nested(1000),
    ],
    ids=["forwarded-to-encoders", "pd-only", "media-part"],
)
def test_deeply_nested_bodies_are_a_400_not_a_500(proxy_port, body):
    status, content_type, payload = post(proxy_port, body)
    assert status == 400 and content_type.startswith("application/json"), (status, payload[:300])
    assert "nest" in orjson.loads(payload)["error"]["message"]
