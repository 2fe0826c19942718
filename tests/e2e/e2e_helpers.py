"""Shared helpers for the end-to-end tests: images, requests, metrics."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import io
import itertools
import json
import re
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from epd_proxy_tools.local.supervisor import http_ok
from epd_proxy_tools.testing.harness import free_port, serve_command
from epd_proxy_tools.testing.polling import eventually_sync

MODEL = "tiny-vlm"
# The topologies the tests run, as the fidelity table names them.
EPD, PREFILL, AUDIO, TWO_PDS = "E+PD", "E+P+D", "E+PD audio", "E+2PD"
# The production transports: encoder output pushed over Mooncake (TCP), KV pulled over NIXL (UCX).
MOONCAKE, NIXL = "E+PD Mooncake", "E+P+D NIXL"
# The two-PD stack's PDs refuse a request while this many are unfinished (--max-num-queued-reqs).
BUSY_AT = 2
# Byte-level tokenizer of the tiny model: byte b has token id b.
LOWERCASE_IDS = list(range(ord("a"), ord("z") + 1))
SMALL = (224, 160)  # 8 x 6 merged patches = 48 image tokens by default
# Grid differs from the default one (48 tokens -> 12 tokens for 224x160).
SMALL_SIZE_KWARGS = {"size": {"shortest_edge": 3136, "longest_edge": 12544}}
BLACK_BG = {"image": {"rgba_background_color": [0, 0, 0]}}


@contextlib.contextmanager
def extra_proxy(
    stack, name: str, *flags: str, decode_url: str | None = None, encoder_urls: list[str] | None = None
) -> Iterator[str]:
    """One more `epd-proxy serve` in front of the stack's own encoders (or `encoder_urls`) and PD
    (or `decode_url`), with `flags`; yields its URL."""
    port = free_port()
    with open(stack.work_dir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            serve_command(
                port,
                "--encode-servers-urls",
                ",".join(encoder_urls or stack.encoder_urls),
                "--decode-servers-urls",
                decode_url or stack.pd_url,
                *flags,
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:

            def started() -> bool:
                assert proc.poll() is None, f"{name} did not start"
                return http_ok(url + "/metrics")

            eventually_sync(started, timeout=60, interval=0.2, what=f"{name} did not start")
            yield url
        finally:
            proc.terminate()
            proc.wait(15)


def make_image(seed: int, mode: str = "RGB", size=SMALL, fmt: str = "PNG") -> str:
    """A deterministic picture as a data URL; different seeds differ visibly."""
    from PIL import Image, ImageDraw

    w, h = size
    bg = ((seed * 53) % 256, (seed * 97 + 40) % 256, (seed * 31 + 90) % 256)
    if mode == "RGBA":
        bg = bg + (96,)  # translucent, so the background colour matters
    img = Image.new(mode, size, bg)
    draw = ImageDraw.Draw(img)
    for i in range(8):
        x = (seed * 37 + i * 41) % (w - 40)
        y = (seed * 13 + i * 23) % (h - 30)
        fill = ((i * 80 + seed * 40) % 256, (i * 45 + seed * 7) % 256, (seed * 90 + i * 11) % 256)
        if mode == "RGBA":
            fill = fill + ((i * 30) % 256,)
        draw.rectangle([x, y, x + 20 + (i * 7) % 20, y + 10 + (i * 5) % 20], fill=fill)
    buf = io.BytesIO()
    img.save(buf, fmt)
    mime = "jpeg" if fmt.upper() == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def image_source(seeds: range) -> Callable[..., list[str]]:
    """`fresh(n, **make_image options)`: n pictures, each from a seed this source has not drawn before."""
    unused = iter(seeds)

    def fresh(n: int = 1, **kw) -> list[str]:
        return [make_image(next(unused), **kw) for _ in range(n)]

    return fresh


def media_body(parts: list[dict], text: str = "Describe it.", model: str = MODEL, **extra) -> dict:
    """One user turn: the text, then the media parts; greedy, seeded, lowercase letters only."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
        "temperature": 0,
        "seed": 1234,
        "max_tokens": 16,
        "allowed_token_ids": LOWERCASE_IDS,
    }
    body.update(extra)
    return body


def chat_body(images: list[str], text: str = "Describe the picture.", **extra) -> dict:
    return media_body([{"type": "image_url", "image_url": {"url": u}} for u in images], text, **extra)


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw = err.read()
        status = err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def chat_ok(url: str, body: dict) -> dict:
    status, data = post_json(url, body)
    assert status == 200, f"{url}: HTTP {status}: {data}"
    assert isinstance(data, dict)
    return data


def comparable(resp: dict) -> dict:
    """The parts of a chat completion that must match exactly.

    ids, timestamps and the ``ec_transfer_params``/``kv_transfer_params``
    bookkeeping legitimately differ between the proxied and the direct answer.
    """
    return {
        "model": resp.get("model"),
        "choices": [
            {
                "index": c.get("index"),
                "message": c.get("message"),
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason"),
            }
            for c in resp.get("choices", [])
        ],
        "usage": resp.get("usage"),
    }


_WARM_UPS = itertools.count()


def await_subscription(pd_url: str, tap) -> None:
    """Until `tap` hears the PD's KV events: a subscriber that has just connected misses what is
    published before its subscription lands, so text prompts of their own (new blocks each) go to
    the PD until one is heard; then what is still on its way is drained."""

    def heard():
        text = f"warm-up {next(_WARM_UPS)} {time.time_ns()} " + "x" * 80
        chat_ok(pd_url, media_body([], text, max_tokens=1))
        return tap.receive(1.0)

    eventually_sync(heard, timeout=60, interval=0.2, what="PD's KV events never reached the subscriber")
    tap.drain(1.0)


def text_of(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@functools.cache
def _samples_of(name: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})?[ \t]+(\S+)", re.M)


def metric_total(base_url: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (a counter's `_total` spelling, or a gauge) on a
    server's /metrics whose labels include `labels`. One regular expression finds them: tests poll
    this while the engine works, and a whole Prometheus parse of vLLM's page takes a good part of a
    short generation."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(value)
        for found, value in _samples_of(name).findall(text)
        if labels.items() <= dict(_LABEL.findall(found)).items()
    )


def finished_requests(base_url: str) -> float:
    """Requests a vLLM server has finished (all finish reasons)."""
    return metric_total(base_url, "vllm:request_success_total")


def encoder_total(urls: list[str]) -> float:
    return sum(finished_requests(u) for u in urls)


def settled_encoder_total(urls: list[str], expect: float | None = None, timeout: float = 5.0) -> float:
    """Counter value once it stops moving.

    vLLM bumps its Prometheus counters from the output loop, which may run a
    moment after the HTTP answer went out; poll until two reads 0.3 s apart
    agree (and, when given, the expected value is reached or time runs out).
    """
    deadline = time.monotonic() + timeout
    last = encoder_total(urls)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        cur = encoder_total(urls)
        if cur == last and (expect is None or cur >= expect):
            return cur
        last = cur
    return last


def store_entries(store: Path) -> dict[str, bool]:
    """EC store folders -> whether they hold a saved embedding."""
    if not store.exists():
        return {}
    return {p.name: (p / "encoder_cache.safetensors").is_file() for p in store.iterdir() if p.is_dir()}


def loaded_hashes(pd_log: Path) -> list[str]:
    """Hashes PD loaded from the EC store (needs PD at DEBUG log level)."""
    try:
        text = pd_log.read_text(errors="replace")
    except OSError:
        return []
    return re.findall(r"Success load encoder cache for hash (\S+)", text)


# ---- E+P+D: the KV handover through vLLM's disk-based ExampleConnector ----------------------
_INJECT_RE = re.compile(r"Inject KV cache of (\d+) tokens")


def kv_loads(decode_log: Path) -> list[int]:
    """Token counts decode loaded from the KV store, in log order (INFO level)."""
    try:
        return [int(n) for n in _INJECT_RE.findall(decode_log.read_text(errors="replace"))]
    except OSError:
        return []


def kv_entries(store: Path) -> dict[str, list[str]]:
    """KV store folders -> the per-layer files saved in them."""
    if not store.exists():
        return {}
    return {p.name: sorted(f.name for f in p.glob("*.safetensors")) for p in store.iterdir() if p.is_dir()}


def kv_saved_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens prefill saves and decode loads: whole blocks of the prompt minus its last token."""
    return (prompt_tokens - 1) // block_size * block_size


def kv_folder(prompt_token_ids: list[int], block_size: int, mm_hashes: list[str]) -> str:
    """The folder vLLM 0.32's ExampleConnector keys a prompt's saved KV by: md5 over the int64
    ids of the saved tokens, then the media hashes joined by '-'."""
    n = kv_saved_tokens(len(prompt_token_ids), block_size)
    data = struct.pack(f"<{n}q", *prompt_token_ids[:n]) + "-".join(mm_hashes).encode()
    return hashlib.md5(data).hexdigest()


def zero_safetensors(path: Path) -> None:
    """Overwrite every tensor in a safetensors file with zeros, keeping its header."""
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    start = 8 + header_len
    raw[start:] = bytes(len(raw) - start)
    path.write_bytes(raw)


def push_waits(consumer_log: Path) -> int:
    """How many pushes a Mooncake consumer waited out (`push_wait_timeout_s`) and gave up on: the
    warning `ECMooncakeScheduler` logs for each (`mooncake/scheduler.py`)."""
    return consumer_log.read_text(errors="replace").count("that never arrived")


def prompt_sources(base_url: str) -> dict[str, float]:
    """Where an engine's prompt tokens came from, so far: `local_compute`, `local_cache_hit`,
    `external_kv_transfer` (vLLM's `prompt_tokens_by_source` counter)."""
    name = "vllm:prompt_tokens_by_source_total"
    return {
        s: metric_total(base_url, name, source=s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def openai_stream(url: str, body: dict) -> tuple[str, object]:
    """`body` streamed through the official `openai` client: the text and the usage it reports."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=body["model"],
        messages=body["messages"],
        temperature=body["temperature"],
        seed=body["seed"],
        max_tokens=body["max_tokens"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"allowed_token_ids": body["allowed_token_ids"]},
    )
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces += [ch.delta.content for ch in chunk.choices if ch.delta and ch.delta.content]
    return "".join(pieces), usage
