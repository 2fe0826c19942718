"""A MUIRBench-like multi-image chat mix, generated once per seed and cached as ready-to-send bytes.

Bodies are serialised up front so the load generator spends no CPU on JSON or base64 while it
measures, and every arm (and every re-run with the same seed) sends byte-identical requests.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import orjson

# Bump when the generator changes, so stale caches are never mistaken for the current mix.
GENERATOR_VERSION = 2
MODEL = "bench-vlm"

# MUIRBench averages 4.3 images per question with a long tail up to 12; these weights give a mean
# of about 4.3 over 1..12.
IMAGES_PER_REQUEST_WEIGHTS = (10, 18, 19, 15, 11, 8, 6, 4, 3, 3, 2, 1)
FULL_SIZES = ((448, 448), (640, 480), (480, 640), (800, 600), (1024, 768), (336, 336))
TINY_SIZES = ((56, 56), (84, 56), (112, 84), (56, 112))
QUESTIONS = (
    "Which of these images shows the same place as the first one?",
    "How many of the images contain a red shape?",
    "Order the images from darkest to brightest.",
    "What changed between the first and the last image?",
    "Which image does not belong with the others, and why?",
    "Do any two images show the same object? Answer yes or no.",
    "Describe the texture common to all images in one sentence.",
    "Which image has the most circles?",
)


@dataclass(frozen=True)
class WorkloadSpec:
    # Names its cache file, and is part of its key (cache_key).
    kind: ClassVar[str] = "pool"
    seed: int = 1234
    requests: int = 128
    # JPEG bytes per image; a real multi-image benchmark sends photos of roughly this weight.
    min_image_bytes: int = 30_000
    max_image_bytes: int = 200_000
    tiny: bool = False
    # Share of requests that list one of their images twice (MUIRBench reuses images across options).
    repeat_share: float = 0.2
    model: str = MODEL


def cache_key(spec: WorkloadSpec | ChatMixSpec | AgentSpec) -> str:
    """What a generated workload is cached under: the generator's version, the spec's kind and
    every field of it, so a changed field never reads another spec's cache."""
    raw = json.dumps([GENERATOR_VERSION, spec.kind, *spec.__dict__.values()])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


@dataclass
class Pool:
    bodies: list[bytes]
    images_per_request: list[int]
    image_bytes: list[int]
    path: Path | None = None

    @property
    def mean_images(self) -> float:
        return sum(self.images_per_request) / len(self.images_per_request)


def _textured_jpeg(rng: random.Random, size: tuple[int, int], lo: int, hi: int) -> bytes:
    """Noise over gradients and shapes: compresses like a photo, unlike a flat colour, so JPEG sizes
    and base64 lengths look like real traffic."""
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = size
    np_rng = np.random.default_rng(rng.getrandbits(32))
    target = rng.uniform(lo, hi)
    # Gradients are smooth, so they are computed at 1/8 scale and upsampled: generation stays cheap.
    sw, sh = max(2, w // 8), max(2, h // 8)
    yy, xx = np.mgrid[0:sh, 0:sw].astype(np.float32)
    base = np.empty((sh, sw, 3), np.float32)
    for c in range(3):
        fx, fy = np_rng.uniform(0.016, 0.24, 2)
        base[..., c] = 127 + 100 * np.sin(xx * fx + yy * fy + np_rng.uniform(0, 6.3))
    image = Image.fromarray(base.clip(0, 255).astype(np.uint8)).resize((w, h), Image.BILINEAR)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 12)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = x0 + rng.randrange(8, max(9, w // 2)), y0 + rng.randrange(8, max(9, h // 2))
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    pixels = np.asarray(image, np.float32)
    # Noise amplitude is what drives JPEG size; search it so each image lands near its target.
    noise = np_rng.standard_normal(pixels.shape, dtype=np.float32)
    amplitude, quality = 4.0 + 30.0 * target / hi, 85
    data = b""
    for _ in range(8):
        noisy = pixels + amplitude * noise
        buf = io.BytesIO()
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
        data = buf.getvalue()
        if lo <= len(data) <= hi and abs(len(data) - target) < 0.35 * target:
            break
        amplitude = max(0.5, amplitude * (target / len(data)) ** 1.3)
        if amplitude > 80:
            amplitude, quality = 80.0, min(98, quality + 5)
    return data


def _data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


def generate(spec: WorkloadSpec) -> Pool:
    rng = random.Random(spec.seed)
    sizes = TINY_SIZES if spec.tiny else FULL_SIZES
    lo, hi = (600, 6_000) if spec.tiny else (spec.min_image_bytes, spec.max_image_bytes)
    bodies, counts, image_sizes = [], [], []
    for _ in range(spec.requests):
        n = rng.choices(range(1, 13), weights=IMAGES_PER_REQUEST_WEIGHTS)[0]
        if spec.tiny:
            n = min(n, 3)
        distinct = n
        repeat = n >= 2 and rng.random() < spec.repeat_share
        if repeat:
            distinct = n - 1
        urls = []
        for _ in range(distinct):
            jpeg = _textured_jpeg(rng, rng.choice(sizes), lo, hi)
            image_sizes.append(len(jpeg))
            urls.append(_data_url(jpeg))
        if repeat:
            urls.insert(rng.randrange(1, n), urls[rng.randrange(distinct)])
        content: list[dict] = [{"type": "text", "text": rng.choice(QUESTIONS)}]
        for i, url in enumerate(urls):
            # MUIRBench interleaves labels with images; the proxy must keep text where it was.
            if rng.random() < 0.5:
                content.append({"type": "text", "text": f"Image {i + 1}:"})
            content.append({"type": "image_url", "image_url": {"url": url}})
        body = {
            "model": spec.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 16,
            "temperature": 0.0,
        }
        bodies.append(orjson.dumps(body))
        counts.append(n)
    return Pool(bodies, counts, image_sizes)


def _save(pool: Pool, path: Path) -> None:
    meta = orjson.dumps(
        {
            "images_per_request": pool.images_per_request,
            "image_bytes": pool.image_bytes,
            "lengths": [len(b) for b in pool.bodies],
        }
    )
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(meta)))
        f.write(meta)
        for body in pool.bodies:
            f.write(body)
    os.replace(tmp, path)  # a crash mid-write must not leave a truncated cache behind


def load_pool(path: Path) -> Pool:
    with open(path, "rb") as f:
        (meta_len,) = struct.unpack("<Q", f.read(8))
        meta = orjson.loads(f.read(meta_len))
        bodies = [f.read(n) for n in meta["lengths"]]
    return Pool(bodies, meta["images_per_request"], meta["image_bytes"], path)


def get_pool(spec: WorkloadSpec, cache_dir: Path, api: str = "chat") -> Pool:
    """The mix for `spec`, written for `api` (API_PATHS): the same requests through any door."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if api == "chat" else f"-{api}"
    path = cache_dir / f"{spec.kind}-seed{spec.seed}-n{spec.requests}-{cache_key(spec)}{suffix}.bin"
    if path.exists():
        try:
            return load_pool(path)
        except (OSError, ValueError, struct.error):
            pass  # unreadable cache: regenerate below
    pool = generate(spec) if api == "chat" else get_pool(spec, cache_dir)
    if api != "chat":
        pool = Pool([in_api(body, api) for body in pool.bodies], pool.images_per_request, pool.image_bytes)
    _save(pool, path)
    pool.path = path
    return pool


API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def in_api(body: bytes, api: str) -> bytes:
    """One of the mix's chat bodies as the same request in the Responses or Messages API."""
    chat = orjson.loads(body)
    (message,) = chat["messages"]
    if api == "responses":
        parts = [
            {"type": "input_text", "text": part["text"]}
            if part["type"] == "text"
            else {"type": "input_image", "image_url": part["image_url"]["url"]}
            for part in message["content"]
        ]
        out = {"model": chat["model"], "input": [{"role": "user", "content": parts}]}
        out.update(max_output_tokens=chat["max_tokens"], temperature=chat["temperature"])
        return orjson.dumps(out)
    blocks = []
    for part in message["content"]:
        if part["type"] == "text":
            blocks.append(part)
            continue
        header, data = part["image_url"]["url"].split(",", 1)
        media_type = header.removeprefix("data:").removesuffix(";base64")
        blocks.append({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}})
    out = {"model": chat["model"], "max_tokens": chat["max_tokens"], "temperature": chat["temperature"]}
    out["messages"] = [{"role": "user", "content": blocks}]
    return orjson.dumps(out)


# --- Chats for real engines ------------------------------------------------------------------------
# Sizes a chat client sends; the tiny model's processor scales each down to at most 224x224 (64
# image tokens), so even 16 images fit its 2048-token context.
CHAT_SIZES = ((448, 448), (336, 336), (640, 480), (480, 640), (224, 224))
# What later turns carry as the assistant's earlier replies. A chat client re-sends the real reply;
# a fixed one keeps every arm's bodies byte-identical, so answers stay comparable across arms.
EARLIER_REPLY = "Noted. Ask me about these images."
FOLLOW_UPS = (
    "And compared with the new ones?",
    "Which of all the images so far is the brightest?",
    "Is anything from the first images repeated here?",
)


@dataclass(frozen=True)
class ChatMixSpec:
    """A MUIRBench-like mix with the repeats real traffic has.

    - images per request follow MUIRBench's 1..12 (mean ~4.3), some requests list one image twice;
    - `popular_share` of image slots are drawn from `popular_images` shared images (Zipf-like
      weights), the way a few images (a logo, a product shot) recur across users;
    - `multi_turn_share` of conversations have 2..`max_turns` turns; each turn adds new images and
      re-sends every earlier image, as chat clients do, up to `max_images` per request.
    """

    kind: ClassVar[str] = "chats"
    seed: int = 1234
    conversations: int = 64
    popular_images: int = 16
    popular_share: float = 0.25
    repeat_share: float = 0.2
    multi_turn_share: float = 0.3
    max_turns: int = 3
    max_images: int = 12
    min_image_bytes: int = 8_000
    max_image_bytes: int = 40_000
    max_tokens: int = 16
    model: str = MODEL


@dataclass
class ChatMix:
    # conversations[c][t]: the body of turn t of conversation c, ready to send.
    conversations: list[list[bytes]]
    # images (with repeats) in each turn's body, in the same shape.
    images: list[list[int]]

    @property
    def requests(self) -> int:
        return sum(map(len, self.conversations))

    @property
    def mean_images(self) -> float:
        flat = [n for turns in self.images for n in turns]
        return sum(flat) / max(1, len(flat))

    def summary(self) -> dict:
        turns = [len(t) for t in self.conversations]
        return {
            "conversations": len(self.conversations),
            "requests": self.requests,
            "multi_turn_conversations": sum(1 for n in turns if n > 1),
            "mean_images_per_request": round(self.mean_images, 2),
        }


def streamed_body(model: str, messages: list[dict], max_tokens: int) -> bytes:
    """A turn as the benchmark sends it: greedy and seeded (answers comparable with the single
    instance's), streamed with usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return orjson.dumps(body)


def generate_chats(spec: ChatMixSpec) -> ChatMix:
    rng = random.Random(spec.seed)
    lo, hi = spec.min_image_bytes, spec.max_image_bytes
    popular = [_data_url(_textured_jpeg(rng, rng.choice(CHAT_SIZES), lo, hi)) for _ in range(spec.popular_images)]
    popularity = [1.0 / (rank + 1) ** 1.1 for rank in range(len(popular))]

    def fresh_or_popular() -> str:
        if popular and rng.random() < spec.popular_share:
            return rng.choices(popular, weights=popularity)[0]
        return _data_url(_textured_jpeg(rng, rng.choice(CHAT_SIZES), lo, hi))

    conversations, image_counts = [], []
    for _ in range(spec.conversations):
        turns = rng.randint(2, spec.max_turns) if rng.random() < spec.multi_turn_share else 1
        messages: list[dict] = []
        bodies, counts, sent = [], [], 0
        for turn in range(turns):
            room = spec.max_images - sent
            if room < 1:
                break
            n = min(room, rng.choices(range(1, 13), weights=IMAGES_PER_REQUEST_WEIGHTS)[0])
            urls = [fresh_or_popular() for _ in range(n)]
            if n >= 2 and rng.random() < spec.repeat_share:
                urls[rng.randrange(1, n)] = urls[0]
            question = rng.choice(QUESTIONS) if turn == 0 else rng.choice(FOLLOW_UPS)
            content: list[dict] = [{"type": "text", "text": question}]
            for url in urls:
                content.append({"type": "image_url", "image_url": {"url": url}})
            if messages:
                messages.append({"role": "assistant", "content": EARLIER_REPLY})
            messages.append({"role": "user", "content": content})
            sent += n
            bodies.append(streamed_body(spec.model, messages, spec.max_tokens))
            counts.append(sent)
        conversations.append(bodies)
        image_counts.append(counts)
    return ChatMix(conversations, image_counts)


AGENT_SYSTEM = "You operate a web browser for the user. Each step shows the current screen."
AGENT_STEPS = ("Open the settings page.", "Find the search box.", "Type the order number.", "Press the button.")
# What an agent framework puts before the first step besides its system prompt: its tools,
# described in text. Cycled through (numbered) until the preamble reaches its length.
AGENT_TOOLS = (
    ("click", "x: int, y: int", "press the primary button at pixel (x, y) of the current screen"),
    ("type_text", "text: str", "type the text into the element that has the keyboard focus"),
    ("scroll", "dx: int, dy: int", "scroll the page under the pointer by dx, dy pixels"),
    ("key", "combo: str", "press a key combination such as ctrl+l or enter"),
    ("wait", "seconds: float", "do nothing for a while so the page can finish loading"),
    ("open_url", "url: str", "load the address in the current tab"),
)


def agent_preamble(chars: int) -> str:
    """The system prompt and tool definitions every session opens with, about `chars` characters
    long (the tiny model's tokenizer makes about one token of each); the bare system prompt for 0."""
    lines = [AGENT_SYSTEM]
    if chars <= len(AGENT_SYSTEM):
        return AGENT_SYSTEM
    lines.append("Tools (answer with exactly one call per step):")
    n = 0
    while sum(map(len, lines)) + len(lines) < chars:
        name, params, does = AGENT_TOOLS[n % len(AGENT_TOOLS)]
        lines.append(f"- {name}_{n}({params}): {does}.")
        n += 1
    return "\n".join(lines)[:chars]


@dataclass(frozen=True)
class AgentSpec:
    """Agent sessions: each step adds one screenshot and re-sends the whole history with the
    agent's earlier replies, as computer-use agents do. 224x224 is 64 image tokens on the tiny
    model, so ten steps stay inside the local stack's --max-model-len.

    With `steps`, every session has exactly that many; `preamble_chars` makes the system message a
    shared preamble of tool definitions that long; with `shared_screens` K, each session's first
    screenshot is one of K screenshots every session draws from (the app's start page)."""

    kind: ClassVar[str] = "agent"
    seed: int = 1234
    conversations: int = 32
    min_turns: int = 6
    max_turns: int = 10
    screen: tuple[int, int] = (224, 224)
    min_image_bytes: int = 8_000
    max_image_bytes: int = 40_000
    max_tokens: int = 16
    model: str = MODEL
    steps: int | None = None
    preamble_chars: int = 0
    shared_screens: int = 0


def _shared_screens(spec: AgentSpec) -> list[str]:
    # Their own generator: sessions draw the same bodies as without them, apart from the first screen.
    rng = random.Random(f"shared-screens-{spec.seed}")
    return [
        _data_url(_textured_jpeg(rng, spec.screen, spec.min_image_bytes, spec.max_image_bytes))
        for _ in range(spec.shared_screens)
    ]


def generate_agent_sessions(spec: AgentSpec) -> ChatMix:
    rng = random.Random(spec.seed)
    system = agent_preamble(spec.preamble_chars) if spec.preamble_chars else AGENT_SYSTEM
    shared = _shared_screens(spec)
    conversations, image_counts = [], []
    for _ in range(spec.conversations):
        messages: list[dict] = [{"role": "system", "content": system}]
        bodies, counts = [], []
        steps = spec.steps or rng.randint(spec.min_turns, spec.max_turns)
        for turn in range(steps):
            if turn == 0 and shared:
                screen = rng.choice(shared)
            else:
                screen = _data_url(_textured_jpeg(rng, spec.screen, spec.min_image_bytes, spec.max_image_bytes))
            if turn:
                messages.append({"role": "assistant", "content": f"Done step {turn}. Next?"})
            step = {"type": "text", "text": f"Step {turn + 1}: {rng.choice(AGENT_STEPS)}"}
            messages.append({"role": "user", "content": [step, {"type": "image_url", "image_url": {"url": screen}}]})
            bodies.append(streamed_body(spec.model, messages, spec.max_tokens))
            counts.append(turn + 1)
        conversations.append(bodies)
        image_counts.append(counts)
    return ChatMix(conversations, image_counts)


def get_chats(spec: ChatMixSpec | AgentSpec, cache_dir: Path) -> ChatMix:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{spec.kind}-seed{spec.seed}-n{spec.conversations}-{cache_key(spec)}.json"
    try:
        raw = orjson.loads(path.read_bytes())
        return ChatMix([[b.encode() for b in c] for c in raw["conversations"]], raw["images"])
    except (OSError, ValueError, KeyError):
        pass  # absent or unreadable: generate below
    mix = generate_agent_sessions(spec) if isinstance(spec, AgentSpec) else generate_chats(spec)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(
        orjson.dumps({"conversations": [[b.decode() for b in c] for c in mix.conversations], "images": mix.images})
    )
    os.replace(tmp, path)
    return mix
