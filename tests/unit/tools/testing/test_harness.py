"""The one test harness (harness.py): proxies over fakes, in process, static or dynamic."""

from __future__ import annotations

import socket

import pytest

from epd_proxy.config import ConfigError
from epd_proxy_tools.testing.harness import ADMIN_KEY, Fakes, free_port, start_stack
from tests.media import chat, image


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


async def test_a_static_stack_lists_its_fakes_and_answers_a_chat():
    stack = await start_stack(encoders=2, prefills=1, decoders=2, probe_interval_s=0)
    try:
        assert [len(stack.backend_urls[k]) for k in "epd"] == [2, 1, 2]
        assert stack.state.config.encode_urls == tuple(stack.backend_urls["e"])
        assert stack.consumers[0].role == "decode" and stack.pd is stack.consumers[0]
        assert len(stack.servers) == 5
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 200, await resp.text()
        assert len(stack.encoder_requests()) == 1 and len(stack.prefills[0].requests) == 1
        assert (await stack.get("/health"))[0] == 200
        async with await stack.chat(b"{not json") as resp:
            assert resp.status == 400
    finally:
        await stack.close()
    assert stack.servers == [] and stack.client.closed


async def test_a_dynamic_stack_starts_empty_and_fakes_join_it():
    stack = await start_stack(dynamic=True)
    try:
        assert stack.state.config.admin_api_key == ADMIN_KEY and stack.encoders == []
        async with await stack.chat(chat()) as resp:
            assert resp.status == 503
        await stack.join("prefill_decode")
        await stack.join("encode")
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 200
        (url,) = (await stack.get("/instances"))[1]["encode"]["live"]
        assert await stack.unregister(url) == (200, {"removed": True})
    finally:
        await stack.close()


async def test_a_stack_whose_config_is_refused_leaves_no_fake_listening():
    fakes = Fakes()
    with pytest.raises(ConfigError):
        await start_stack(encoders=1, decoders=0, fakes=fakes)
    assert fakes.servers == []


async def test_overrides_may_replace_the_listed_backends():
    fakes = Fakes()
    _, pd_url = await fakes.start("pd")
    stack = await start_stack(encoders=1, decoders=0, fakes=fakes, decode_urls=(pd_url,), probe_interval_s=0)
    try:
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 200
    finally:
        await stack.close()
