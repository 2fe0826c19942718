"""A LoRA adapter's blocks on real vLLM: a PD serving the adapter `ada` (`--enable-lora`) renders a
request of it as of the base model (render only echoes `model`), lists `ada` in /v1/models with a
`parent`, which is how the proxy's renderer tells an adapter (journey/render.py), and stores the
request's blocks under names that only a chain carrying the adapter's name finds
(fleet/rendered.py), its images held for the adapter alone (fleet/kv_names.py). The PD runs
alone, started here: the shared stacks' PDs serve no adapter, and their answers are compared with
a baseline that has none."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import pytest

from epd_proxy.fleet.kv_index import KvIndex
from epd_proxy.fleet.kv_names import media_key
from epd_proxy.fleet.rendered import Rendered
from epd_proxy_tools.local.stack import engine_env
from epd_proxy_tools.local.supervisor import Managed, stop_groups, wait_healthy
from epd_proxy_tools.local.tiny_model import build_lora_adapter, build_tiny_model
from epd_proxy_tools.testing.harness import free_port
from epd_proxy_tools.testing.kv_tap import KvTap
from epd_proxy_tools.testing.polling import eventually_sync

from .conftest import WORK
from .e2e_helpers import MODEL, await_subscription, chat_body, chat_ok, make_image
from .test_e2e_render import holds_chain, render

pytestmark = pytest.mark.e2e

ADAPTER = "ada"
BLOCK = 32


@pytest.fixture(scope="module")
def lora_pd():
    """A PD of the tiny model serving the adapter, with its render endpoints and KV events."""
    work = WORK.with_name(WORK.name + "-lora")
    model = build_tiny_model(work / "tiny-vlm")
    adapter = build_lora_adapter(work / ADAPTER)
    port, events = free_port(), free_port(host="0.0.0.0")
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    cmd += ["--max-model-len", "2048", "--block-size", str(BLOCK), "--num-gpu-blocks-override", "256"]
    cmd += ["--limit-mm-per-prompt", '{"image": 2}', "--enable-scale-out"]
    cmd += ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", "8"]
    publisher = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
    cmd += ["--kv-events-config", json.dumps(publisher)]
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **engine_env(work)}
    pd = Managed("lora-pd", cmd, {}, work / "logs" / "lora-pd.log", url + "/health", cwd=work)
    pd.start(env)
    try:
        wait_healthy([pd], timeout=float(os.environ.get("EPD_E2E_HEALTH_TIMEOUT", "600")))
        yield url, f"tcp://127.0.0.1:{events}"
    finally:
        stop_groups([pd])


def test_an_adapters_blocks_are_found_by_a_chain_carrying_its_name_and_only_by_it(lora_pd):
    url, endpoint = lora_pd
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        cards = {card["id"]: card.get("parent") for card in json.loads(resp.read())["data"]}
    assert cards == {MODEL: None, ADAPTER: MODEL}, cards
    tap = KvTap(endpoint)
    index, engine = KvIndex(), (url, 0)
    index.watch(engine)
    try:
        await_subscription(url, tap)
        system = {"role": "system", "content": f"Session {time.time_ns()}: a careful describer of pictures."}
        body = chat_body([make_image(4_301)], text="Describe the picture in a few words, please.")
        body["messages"].insert(0, system)
        adapted = {**body, "model": ADAPTER}
        rendered, raw, _ = render(url, adapted)
        assert raw["model"] == ADAPTER
        # Served as the proxy sends it: the image under the name the render reported.
        (part,) = [p for p in adapted["messages"][-1]["content"] if p["type"] == "image_url"]
        part["uuid"] = rendered.items[0].identifier
        served = chat_ok(url, adapted)
        assert len(rendered.tokens) == served["usage"]["prompt_tokens"]
        plain = rendered.names(BLOCK)
        named = Rendered(rendered.tokens, rendered.items, rendered.cache_salt, lora_name=ADAPTER).names(BLOCK)
        eventually_sync(
            lambda: holds_chain(tap, index, engine, named),
            timeout=60,
            what="the PD's stored blocks never matched the adapter's chain",
        )
        assert index.prefix_blocks(engine, plain) == 0, "the base model's names found the adapter's blocks"
        # Its image is held for the adapter, not for the base model (fleet/kv_names.py).
        image = rendered.items[0].identifier
        assert index.adapter(ADAPTER) == ADAPTER and index.adapter(MODEL) is None
        assert index.media_holders(media_key(image, ADAPTER)) == [engine]
        assert index.media_holders(image) == []
    finally:
        tap.close()
