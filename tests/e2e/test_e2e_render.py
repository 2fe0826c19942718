"""Exact matching on real vLLM: the PD (started with `--enable-scale-out`) renders a conversation's
next turn as the proxy asks it to (journey/render.py's body), and the block chain the proxy names
from that render (fleet/rendered.py) is the chain the PD stored while serving the turn, block for
block, as its KV events say (fleet/kv_index.py, fed the PD's own frames)."""

from __future__ import annotations

import json
import time
import urllib.request

import orjson
import pytest

from epd_proxy.fleet import kv_wire
from epd_proxy.fleet.kv_index import KvIndex
from epd_proxy.fleet.rendered import Rendered, parse_render
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.extract import parse_request
from epd_proxy.journey.match import Matches
from epd_proxy_tools.testing.kv_tap import KvTap, reachable
from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import await_subscription, chat_body, chat_ok, make_image

pytestmark = pytest.mark.e2e


def render(url: str, body: dict) -> tuple[Rendered, dict, dict]:
    """What the proxy's renderer sends and reads: the consumer's body, every item raw under the
    proxy's name, no tensors."""
    parsed, spliced = parse_request(orjson.dumps(body))
    sent = CHAT.consumer_body(parsed.body, parsed.items, Matches(), rewrite=True, push_mode=False)
    sent["mm_payload"] = "none"
    payload = spliced.dumps(sent) if spliced is not None else orjson.dumps(sent)
    data = b"".join(bytes(piece) for piece in payload) if isinstance(payload, list) else bytes(payload)
    request = urllib.request.Request(
        url + "/v1/chat/completions/render", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        answer = json.loads(resp.read())
    rendered = parse_render(answer)
    assert rendered is not None, answer
    return rendered, answer, sent


def holds_chain(tap: KvTap, index: KvIndex, engine: tuple[str, int], names: list[bytes]) -> bool:
    """Whether, with what the PD published since, its index holds every block of `names`."""
    for frames in tap.drain(0.5):
        index.apply(engine, kv_wire.decode(frames.payload).events)
    index.heard(engine)
    return index.prefix_blocks(engine, names) == len(names)


def test_the_blocks_named_from_a_render_are_the_blocks_the_pd_stored(stack):
    with urllib.request.urlopen(stack.pd_url + "/kv_event_sources", timeout=30) as resp:
        source = json.loads(resp.read())["0"]
    host = stack.config.host
    tap = KvTap(reachable(source["endpoint"], host), reachable(source["replay_endpoint"], host))
    index, engine = KvIndex(), (stack.pd_url, 0)
    index.watch(engine)
    try:
        await_subscription(stack.pd_url, tap)
        # A system prompt no other request sent: every block of this conversation is new, so its
        # chain is whole in what the subscriber hears from here on.
        system = {"role": "system", "content": f"Session {time.time_ns()}: a careful describer of pictures."}
        first = chat_body([make_image(4_242)], text="Describe the first picture in a few words.")
        first["messages"].insert(0, system)
        answer = chat_ok(stack.proxy_url, first)["choices"][0]["message"]["content"]
        second = chat_body([make_image(4_243)], text="And this one, compared with the first?")
        second["messages"] = [*first["messages"], {"role": "assistant", "content": answer}, *second["messages"]]
        served = chat_ok(stack.proxy_url, second)

        rendered, raw, sent = render(stack.pd_url, second)
        assert len(rendered.tokens) == served["usage"]["prompt_tokens"]
        parts = [part for m in sent["messages"] if isinstance(m["content"], list) for part in m["content"]]
        assert [item.identifier for item in rendered.items] == [part["uuid"] for part in parts if "uuid" in part]
        assert raw["features"]["kwargs_data"] is None  # no tensors came back
        names = rendered.names(stack.config.kv_block_size)

        eventually_sync(
            lambda: holds_chain(tap, index, engine, names),
            timeout=60,
            what="the PD's stored blocks never matched the rendered chain",
        )
        # A turn that changes the first picture shares only the blocks before it.
        changed = json.loads(json.dumps(second))
        changed["messages"][1]["content"][1]["image_url"]["url"] = make_image(4_244)
        other, _, _ = render(stack.pd_url, changed)
        start = other.items[0].offset
        assert (
            index.prefix_blocks(engine, other.names(stack.config.kv_block_size)) == start // stack.config.kv_block_size
        )
    finally:
        tap.close()
