"""The tenants workload's pieces: the tenants file it gives our proxies, and its distinct images."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from epd_proxy.tenants import parse_tenants
from epd_proxy_tools.bench import tenant_load
from epd_proxy_tools.bench.tenant_load import FLOOD, INTERACTIVE, Load


def test_the_tenants_file_names_both_tenants_by_key_digest_only():
    flood, chat = tenant_load.new_tenants(1500)
    text = tenant_load.tenants_toml((flood, chat))
    assert flood.key not in text and chat.key not in text
    tenants = parse_tenants(text)
    assert tenants.by_key(flood.key.encode()).name == FLOOD
    assert tenants.by_key(chat.key.encode()).name == INTERACTIVE
    assert tenants.by_name(FLOOD).deadline_s == 1.5 and tenants.by_name(INTERACTIVE).deadline_s is None


def test_every_image_is_distinct_bytes_of_the_same_picture():
    flood = tenant_load.requests_for(FLOOD, 3, model="m", seed=1, tiny=True)
    chats = tenant_load.requests_for(INTERACTIVE, 3, model="m", seed=1, tiny=True)
    assert all(6 <= r.images <= 12 for r in flood) and all(r.images == 1 for r in chats)
    urls = [
        part["image_url"]["url"]
        for r in flood + chats
        for part in __import__("json").loads(r.body)["messages"][0]["content"]
        if part["type"] == "image_url"
    ]
    assert len(set(urls)) == len(urls) == sum(r.images for r in flood + chats)
    picture = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    picture.load()  # the comment segment keeps it a valid JPEG
    assert picture.size[0] > 0


def test_enough_requests_for_a_block():
    load = Load(seconds=10, flood_rate=40, interactive_clients=2)
    assert tenant_load.flood_count(load) > 400
    assert tenant_load.interactive_count(load) >= 2 * 10 / 0.2
    assert tenant_load.flood_count(Load(seconds=10, flood_rate=0, interactive_clients=1)) == 0


def test_the_capacity_is_the_rate_while_the_pipeline_is_full():
    # A cold start (the first answers late and together) and a ramp-down (the last ones spread
    # out with fewer in flight) around a steady 4 requests a second of 8 images, one failed.
    ends = [2.0, 2.0, 2.1, *(2.1 + 0.25 * k for k in range(1, 13)), 6.0, 8.0, 11.0]
    done = [(end, 0 if k == 7 else 8) for k, end in enumerate(ends)]
    rate, images = tenant_load.steady_rate(done, 3)
    assert rate == pytest.approx(4.0 * 11 / 12) and images == pytest.approx(8 * 4.0 * 11 / 12)
    assert tenant_load.steady_rate(done[:6], 3) is None  # too few answers for a window
