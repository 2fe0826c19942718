"""Large media through the whole proxy: the spliced fast path sends what the full parse would."""

from __future__ import annotations

import base64
import dataclasses
import hashlib

import orjson

from epd_proxy.http import routes
from epd_proxy.journey.extract import parse_request
from tests.media import chat


def big_image(n: int) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(bytes([n]) * 6000 + b"\xfb\xff").decode()
    return {"type": "image_url", "image_url": {"url": url}}


def without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "ec_transfer_params"}


async def test_spliced_and_fully_parsed_requests_reach_the_backends_identically(make_stack, monkeypatch):
    took_fast_path = []

    def recording(raw, options):
        normalised, spliced = parse_request(raw, options)
        took_fast_path.append(spliced is not None)
        return normalised, spliced

    monkeypatch.setattr(routes, "CHAT", dataclasses.replace(routes.CHAT, parse=recording))
    images = [big_image(1), big_image(2), big_image(1)]
    body = chat(*images, mm_processor_kwargs={"size": 1})
    seen = {}
    # The same JSON twice: canonical (spliced), and with escaped slashes, which must fall back.
    for name, raw in (("spliced", orjson.dumps(body)), ("parsed", orjson.dumps(body).replace(b"/", b"\\/"))):
        stack = await make_stack(encoders=2)
        async with await stack.chat(raw, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
        assert stack.pd.loaded_from_cache == 3 and stack.pd.encoded_locally == 0
        async with stack.client.get(stack.url + "/metrics") as resp:
            path = "splice" if name == "spliced" else "full"
            assert f'epd_request_parse_total{{path="{path}"}} 1.0' in await resp.text()
        seen[name] = (
            sorted(orjson.dumps(without_ids(b), option=orjson.OPT_SORT_KEYS) for b in stack.encoder_requests()),
            without_ids(stack.pd.requests[0].body),
        )
    assert took_fast_path == [True, False]
    assert seen["spliced"] == seen["parsed"]
    encoder_parts = [
        p for b in orjson.loads(b"[" + b",".join(seen["spliced"][0]) + b"]") for p in b["messages"][0]["content"]
    ]
    for part in encoder_parts:
        assert part["uuid"] == hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()
    assert sorted(p["image_url"]["url"] for p in encoder_parts) == sorted(i["image_url"]["url"] for i in images)
