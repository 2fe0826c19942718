"""The E+PD stack's PD publishes vLLM's KV events where the stack configured them: `GET
/kv_event_sources` says so, and an image request through the proxy is stored in blocks whose extra
keys name the uuid the proxy sent for the image (decoded with vLLM's own classes)."""

from __future__ import annotations

import json
import time
import urllib.request

import msgspec
import pytest

from epd_proxy.journey.extract import content_uuid
from epd_proxy_tools.testing.kv_tap import KvTap, reachable
from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import await_subscription, chat_body, chat_ok, make_image, media_body, metric_total

pytestmark = pytest.mark.e2e
kv_events = pytest.importorskip("vllm.distributed.kv_events")
DECODE = msgspec.msgpack.Decoder(kv_events.KVEventBatch)


def test_pd_publishes_the_blocks_of_an_image_under_the_uuid_the_proxy_sent(stack):
    with urllib.request.urlopen(stack.pd_url + "/kv_event_sources", timeout=30) as resp:
        sources = json.loads(resp.read())
    ports = stack.kv_event_ports()["pd"]
    assert list(sources) == ["0"]
    source = sources["0"]
    assert (source["enable_kv_cache_events"], source["publisher"], source["topic"]) == (True, "zmq", "")
    assert (source["endpoint"], source["replay_endpoint"]) == (f"tcp://*:{ports.events}", f"tcp://*:{ports.replay}")

    host = stack.config.host
    tap = KvTap(reachable(source["endpoint"], host), reachable(source["replay_endpoint"], host))
    try:
        await_subscription(stack.pd_url, tap)

        image = make_image(9_871)
        part = {"type": "image_url", "image_url": {"url": image}}
        uuid = content_uuid(part, "image_url")
        chat_ok(stack.proxy_url, chat_body([image], text=f"kv events {time.time_ns()}: describe the picture."))

        def stored_with_uuid():
            frames = tap.receive(1.0)
            if frames is None:
                return None
            for event in DECODE.decode(frames.payload).events:
                if isinstance(event, kv_events.BlockStored) and event.extra_keys:
                    named = [key for keys in event.extra_keys if keys for key in keys]
                    if any(key[0] == uuid for key in named):
                        return frames, event, named
            return None

        frames, event, named = eventually_sync(
            stored_with_uuid, timeout=60, what="no BlockStored named the image's uuid"
        )
        assert all(isinstance(key[1], int) for key in named) and event.block_size == stack.config.kv_block_size
        assert (
            len(event.token_ids)
            == event.block_size * len(event.block_hashes)
            == event.block_size * len(event.extra_keys)
        )
        # The replay socket holds the same batch under the same seq.
        replayed = tap.replay(frames.seq)
        assert replayed[0] == [frames.topic, frames.seq.to_bytes(8, "big"), frames.payload]
    finally:
        tap.close()


def _status_of_pd(stack) -> dict:
    with urllib.request.urlopen(stack.proxy_url + "/status.json", timeout=30) as resp:
        status = json.loads(resp.read())
    rows = [row for row in status["roster"] if row["url"] == stack.pd_url]
    return rows[0]["kv_events"] or {"state": "none", "blocks": 0}


def test_the_proxy_follows_the_pd_and_leaves_it_an_image_its_prefix_holds(stack):
    """The proxy found the PD's events when it joined; once turn 2 has stored blocks past turn 1's
    image, turn 3 leaves that image to the PD because the index says its prefix holds it."""
    eventually_sync(lambda: _status_of_pd(stack)["state"] == "fresh", timeout=60, what="the PD's events never fresh")
    part = {"type": "image_url", "image_url": {"url": make_image(9_872)}}
    messages = [{"role": "user", "content": [{"type": "text", "text": f"turn one {time.time_ns()}: describe."}, part]}]
    for follow_up in ("and its colours?", "and its shape?"):
        before = _status_of_pd(stack)["blocks"]
        answer = chat_ok(stack.proxy_url, {**media_body([]), "messages": messages})
        reply = {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        messages += [reply, {"role": "user", "content": follow_up}]
        eventually_sync(
            lambda before=before: _status_of_pd(stack)["blocks"] > before,
            timeout=60,
            what="the turn's blocks never reached the proxy's index",
        )
    reused = metric_total(stack.proxy_url, "epd_prefix_decisions_total", decision="reuse", source="index")
    chat_ok(stack.proxy_url, {**media_body([]), "messages": messages})
    assert metric_total(stack.proxy_url, "epd_prefix_decisions_total", decision="reuse", source="index") == reused + 1
