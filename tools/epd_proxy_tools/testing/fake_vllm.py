"""Fake vLLM servers that speak the EPD wire protocol: in-process for the tests, and a process of
them for the benchmark (`python -m epd_proxy_tools.testing.fake_vllm SPEC`, see `main`).

They model the behaviour the proxy must get right, not the model: an encoder derives the cache
identifier from uuid + processing options exactly when vLLM does, stores what a shared-storage EC
connector would, and reports `item_indices`; a consumer checks every `*_embeds` reference against
that store and fails the way vLLM does on a missing entry or a placeholder/token mismatch. A
consumer keeps a prefix cache keyed as vLLM's block hashes are (media by identifier, not pixels):
raw media inside the cached prefix needs nothing, outside it is loaded from the store, and only
what neither holds is encoded locally; one without a vision tower (`text_only`, vLLM's
--language-model-only) or with a modality's limit at 0 (`no_raw`) refuses such raw media with
vLLM's 400, before it loads any item (which is what the proxy's media probe reads). Given
`kv_events`, a consumer keeps vLLM's block cache instead, counts tokens as its stable tokenisation
gives them, and publishes vLLM's KV events over ZMQ (fake_kv_events.py).

Failures during generation take vLLM's shape (vllm/entrypoints/openai/chat_completion/serving.py):
a streaming request has already answered 200 and sent its first (role) chunk when the engine
reports `finish_reason="error"`, so the error arrives in-band as `data: {"error": {...}}` followed
by `data: [DONE]`; a non-streaming request answers 500 with the same error object.

The tests inject faults (`Faults`); the benchmark gives the servers a cost model (`Costs`) and
reads per-phase counters (`GET /stats`). The handlers answer through an `Exchange`, so one fake runs
behind two front ends: aiohttp's server for the tests (`FakeVLLM.app`), and for the benchmark the
lean server of `bare_server`, whose cost per message does not make the harness the bottleneck.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import signal
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple, Protocol

import blake3
import orjson
from aiohttp import web

from epd_proxy.fleet.capabilities import PROBE_REQUEST_ID
from epd_proxy_tools.testing import bare_server, fake_doors
from epd_proxy_tools.testing.fake_kv_events import KvEngine, KvEventsOptions, Served, tokenize

MEDIA_KEYS = {"image_url": "image", "audio_url": "audio", "input_audio": "audio", "video_url": "video"}
EMBEDS_KEYS = {"image_embeds": "image", "audio_embeds": "audio", "video_embeds": "video"}
# The placeholder metadata an EC producer publishes per modality (`embedding_fields` of the model's
# data parser, vllm/model_executor/models/qwen2_vl.py and qwen2_audio.py in 0.32).
GRID_FIELD = {"image": "image_grid_thw", "video": "video_grid_thw", "audio": "audio_num_tokens"}
# Processor kwargs scoped to one modality (vllm/multimodal/processing/inputs.py): an item's identifier
# folds in only its own modality's, plus every unscoped key.
SCOPED_PROCESSOR_KWARGS = {"image": "images_kwargs", "video": "videos_kwargs", "audio": "audio_kwargs"}
# How vLLM 0.32 gives a content part its kind (vllm/renderers/chat_utils.py): from `type` only when
# the type is known and the part has no uuid; otherwise from the first of these keys present. Kept
# apart from the proxy's own classifier on purpose, so a test can catch the two disagreeing.
VLLM_KEY_ORDER = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
VLLM_PART_TYPES = frozenset(
    {"text", "thinking", "input_text", "output_text", "input_image", "refusal", *VLLM_KEY_ORDER}
)


def vllm_part_kind(part: Any) -> str:
    """The kind vLLM's chat parser reads; ValueError (a 400 from the fake) where vLLM refuses."""
    if isinstance(part, str):
        return "text"
    part_type, uuid = part.get("type"), part.get("uuid")
    if isinstance(part_type, str) and part_type in VLLM_PART_TYPES and uuid is None:
        return "image_url" if part_type == "input_image" else part_type
    if part_type is None or uuid is not None:
        for key in VLLM_KEY_ORDER:
            if key in part:
                return key
        raise ValueError("Missing 'type' field in multimodal part.")
    raise ValueError(f"Unsupported chat content part type: {part_type!r}")


# Multibyte characters on purpose: a relay that re-chunks or decodes bytes would break them.
ANSWER_SUFFIX = " héllo wörld 世界 🙂"
MODEL = "tiny-vlm"
MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
SSE = "text/event-stream; charset=utf-8"
# vLLM's default (`--fingerprint-mode full`): its version and a hash of its config.
FINGERPRINT = "vllm-0.32.0-5f1c0a9e"
# vllm/exceptions.py QueueOverflowError: what admission control answers, status 503.
QUEUE_OVERFLOW = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)
# What aiohttp's json_response sent, which these answers came from.
JSON_TEXT = "application/json; charset=utf-8"


def _digest(*parts: Any) -> str:
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()


def media_id(media: str) -> str:
    """The identity of one item's media. blake3, the fastest hash at hand: hashing the media is
    most of what the fake spends in the benchmark, on the harness's core."""
    return blake3.blake3(media.encode("utf-8", "surrogatepass")).hexdigest()


def media_source(part: dict[str, Any], kind: str) -> str:
    value = part.get(kind)
    if isinstance(value, dict):
        return value.get("url") or _digest(value)
    return value if isinstance(value, str) else _digest(part)


def hash_factors(modality: str, body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM folds into an item's identifier besides the uuid (ProcessorInputs.get_mm_hashes):
    the processor kwargs but another modality's scoped ones (`videos_kwargs` does not touch an
    image), and this modality's own `media_io_kwargs`, whichever are non-empty."""
    factors: dict[str, Any] = {}
    media_io = body.get("media_io_kwargs")
    if isinstance(media_io, dict) and media_io.get(modality):
        factors["media_io_kwargs"] = {modality: media_io[modality]}
    processor = body.get("mm_processor_kwargs")
    if isinstance(processor, dict):
        others = set(SCOPED_PROCESSOR_KWARGS.values()) - {SCOPED_PROCESSOR_KWARGS[modality]}
        processor = {k: v for k, v in processor.items() if k not in others}
    if processor:
        factors["mm_processor_kwargs"] = processor
    return factors


def identifier(uuid: str | None, media: str, factors: dict[str, Any] | None) -> str:
    """vLLM's rule: the uuid verbatim when there are no hash factors, else a derived hash.
    `media` is the item's `media_id` (its content, hashed once)."""
    if uuid and not factors:
        return uuid
    return _digest("tiny-vlm", uuid or media, factors or {})


def placeholder_shape(modality: str, identity: str, factors: dict[str, Any] | None) -> list[int]:
    """A deterministic grid that changes with the processing options, like a resize would."""
    d = bytes.fromhex(identity)
    processor_kwargs = (factors or {}).get("mm_processor_kwargs") or {}
    scale = 2 if processor_kwargs.get("size") else 1
    if modality == "audio":
        return [8 + d[0] % 8]
    t = 2 if modality == "video" else 1
    return [t, (2 + d[0] % 4) * 2 * scale, (2 + d[1] % 4) * 2 * scale]


def tokens_of(modality: str, shape: list[int]) -> int:
    if modality == "audio":
        return shape[0]
    t, h, w = shape
    return t * h * w // 4


@dataclass
class ECStore:
    """What a shared-storage EC connector holds: identifier -> (media identity, shape). `pushes`
    is the Mooncake side: transfer id -> identifier of the embedding an encoder pushed under it."""

    entries: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    pushes: dict[str, str] = field(default_factory=dict)


class InjectedDrop(Exception):
    """Raised after closing the connection on purpose (not a cancellation by the caller)."""


class Answer(NamedTuple):
    """A whole response."""

    status: int
    body: bytes = b""
    content_type: str | None = None


class Exchange(Protocol):
    """One request and the means to answer it, as a front end gives it to the handlers: `reply` at
    once, or `start`, `write` and `end` a body in pieces; `drop` closes the connection, `gone` says
    whether the caller went away. `headers` answers `get` by lowercase name."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes
    gone: bool

    def reply(self, status: int, body: bytes = b"", content_type: str | None = None) -> None: ...

    async def start(self, status: int, content_type: str | None = None) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...

    def drop(self) -> None: ...


class _AiohttpExchange:
    """The `Exchange` of a request to aiohttp's server; `response` is what the handler returns."""

    def __init__(self, request: web.Request, body: bytes) -> None:
        self.method, self.path, self.headers, self.body = request.method, request.path, request.headers, body
        self._request = request
        self.response: web.StreamResponse | None = None

    @property
    def gone(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    def reply(self, status: int, body: bytes = b"", content_type: str | None = None) -> None:
        headers = {"Content-Type": content_type} if content_type else None
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start(self, status: int, content_type: str | None = None) -> None:
        self.response = web.StreamResponse(
            status=status, headers={"Content-Type": content_type} if content_type else None
        )
        await self.response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        await self.response.write(data)

    async def end(self) -> None:
        await self.response.write_eof()

    def drop(self) -> None:
        self._request.transport.close()


@dataclass
class Faults:
    """Inject failures: the next `fail_times` requests answer `fail_status` with a vLLM error body
    before any processing (0 drops the connection, 200 answers `fail_body` as plain text); every
    request waits `delay_s` first.

    The next `generation_errors` consumer requests fail during generation as vLLM's engine does
    (`finish_reason="error"`): in-band after 200 when streaming, 500 otherwise. The next
    `cut_streams` streams are cut halfway (connection reset after 200); the next `stall_streams`
    streams send one chunk and then nothing until the caller goes away. The next `aborts`
    consumer requests are answered as vLLM answers a request it aborted before its engine ran it
    (`POST /pause`, a shutdown): 200 with no token generated; the next `late_aborts` non-streamed
    ones as it answers one aborted partway: 200 with the text generated so far. With a `gate`, every request waits
    until the test opens it: what happens while a backend holds them all."""

    fail_times: int = 0
    fail_status: int = 500
    fail_body: str = "injected failure"
    delay_s: float = 0.0
    # An encoder answers `bad_media_status` to every sub-request holding a media URL that
    # contains `bad_media`, as vLLM refuses an image it cannot decode: one client's bad image.
    bad_media: str = ""
    bad_media_status: int = 400
    generation_errors: int = 0
    cut_streams: int = 0
    stall_streams: int = 0
    aborts: int = 0
    late_aborts: int = 0
    gate: asyncio.Event | None = None

    def fail_next(self, times: int = 1, status: int = 500, body: str | None = None) -> None:
        self.fail_times, self.fail_status = times, status
        if body is not None:
            self.fail_body = body

    def _spend(self, budget: str) -> bool:
        """Whether one more of the faults counted down in attribute `budget` is due, spending it."""
        left = getattr(self, budget)
        if left > 0:
            setattr(self, budget, left - 1)
        return left > 0

    def generation_error(self) -> bool:
        return self._spend("generation_errors")

    def stall_stream(self) -> bool:
        return self._spend("stall_streams")

    def abort(self) -> bool:
        return self._spend("aborts")

    def late_abort(self, body: dict[str, Any]) -> bool:
        return not body.get("stream") and self._spend("late_aborts")

    async def apply(self, exchange: Exchange) -> Answer | None:
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_times > 0:
            self.fail_times -= 1
            if self.fail_status == 0:
                exchange.drop()
                raise InjectedDrop("fault injected: connection dropped")
            if self.fail_status == 200:
                return Answer(200, self.fail_body.encode(), "text/plain; charset=utf-8")
            error = {"error": {"message": self.fail_body, "type": "InternalServerError", "code": self.fail_status}}
            return Answer(self.fail_status, json.dumps(error).encode(), JSON_TEXT)
        return None

    def break_stream(self) -> bool:
        """Whether the next stream should be cut halfway (connection reset after status 200)."""
        return self._spend("cut_streams")


@dataclass(frozen=True)
class Costs:
    """The time a real server takes, for the benchmark. An encoder is one GPU: its sub-requests
    run back to back, each costing `request_s` plus `image_s` per media item, times `slowdown`
    (a fleet of mixed encoders: 3 is three times slower). An item whose engine identifier is
    among the last `cache_items` this encoder saw costs `repeat_factor` of a fresh one (vLLM's
    processor and encoder caches: about 0.4x, see docs/scheduling.md); another
    encoder has not seen it and pays in full. A consumer answers after `answer_s`; a stream sends
    its role event at once, its first token `first_token_s` later (the engine's prefill), and the
    rest `answer_s` after that."""

    request_s: float = 0.0
    image_s: float = 0.0
    answer_s: float = 0.0
    first_token_s: float = 0.0
    slowdown: float = 1.0
    repeat_factor: float = 1.0
    cache_items: int = 0
    # Sub-requests batched together as vLLM's engine steps do, each taking its own cost from when
    # it arrives, instead of back to back.
    parallel: bool = False


class PrefixCache:
    """A consumer's KV prefix cache: the chain of a prompt's pieces (a message's role, a text
    part, a media item by its identifier, each standing in for its blocks) hashed as vLLM's
    block hashes chain (vllm/v1/core/kv_cache_utils.py), least recently used first out."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._chains: OrderedDict[bytes, None] = OrderedDict()

    def cached(self, pieces: list[tuple[str, int, str]], salt: str | None = None) -> int:
        """How many leading pieces were cached; all of them are from now on. vLLM folds a
        request's `cache_salt` into its first block only, and every later block chains on it."""
        chain = b"" if salt is None else b"salt\0" + salt.encode()
        hits = 0
        missed = False
        for key, *_ in pieces:
            chain = hashlib.blake2b(chain + key.encode(), digest_size=16).digest()
            if not missed and chain in self._chains:
                self._chains.move_to_end(chain)
                hits += 1
                continue
            missed = True
            self._chains[chain] = None
            if len(self._chains) > self.capacity:
                self._chains.popitem(last=False)
        return hits


def text_tokens(text: str) -> int:
    return len(text) // 4 + 1


class SeenCache:
    """The identifiers an encoder saw last, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def seen(self, key: str) -> bool:
        """Whether `key` was among the last `capacity` seen; either way it is the latest now."""
        if self.capacity <= 0:
            self.misses += 1
            return False
        if key in self._keys:
            self._keys.move_to_end(key)
            self.hits += 1
            return True
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        self.misses += 1
        return False


class Counts:
    """Chat requests, media items and bytes received, per tag: the first character of the request
    id, which the benchmark's load generator sets to w/m/c for warm-up, measured and cool-down
    requests, so the harness can count exactly one phase. `images` are the items an encoder
    encoded or a consumer took as `*_embeds` references; `raw_images` the raw media a consumer got."""

    def __init__(self) -> None:
        self.requests: defaultdict[str, int] = defaultdict(int)
        self.images: defaultdict[str, int] = defaultdict(int)
        self.raw_images: defaultdict[str, int] = defaultdict(int)
        self.bytes_in: defaultdict[str, int] = defaultdict(int)
        # A consumer's prompt tokens, those its prefix cache held, and its raw media items by
        # what became of them: inside the cached prefix, loaded from the EC store, encoded here.
        self.prompt_tokens: defaultdict[str, int] = defaultdict(int)
        self.cached_tokens: defaultdict[str, int] = defaultdict(int)
        self.prefix_items: defaultdict[str, int] = defaultdict(int)
        self.ec_loads: defaultdict[str, int] = defaultdict(int)
        self.local_encodes: defaultdict[str, int] = defaultdict(int)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "requests": self.requests,
            "images": self.images,
            "raw_images": self.raw_images,
            "bytes_in": self.bytes_in,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefix_items": self.prefix_items,
            "ec_loads": self.ec_loads,
            "local_encodes": self.local_encodes,
        }


class Resolved(NamedTuple):
    seen: list[str]
    identifiers: list[str]
    references: int
    # (key, tokens, kind): kind is "role", "text" or the media item's modality.
    pieces: list[tuple[str, int, str]]
    raw: list[int]


@dataclass
class Seen:
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass(eq=False)
class FakeVLLM:
    """One fake server. role: 'encode' (EC producer), 'pd' (EC consumer, decodes), 'prefill'
    (EC consumer, returns KV handles), 'decode' (KV consumer, expects kv_transfer_params)."""

    role: str
    store: ECStore
    _: KW_ONLY
    report_indices: bool = True
    # Added to every item's `ec_transfer_params` entry, as a real producer adds its peer address.
    handles: dict[str, Any] = field(default_factory=dict)
    tokens_per_chunk: int = 3
    stream_pause_s: float = 0.0
    # Long runs (soak, benchmarks) turn recording off so the fake's memory stays flat.
    record: bool = True
    # A Mooncake EC consumer: every media item must arrive by a push under its own transfer id,
    # and each push serves one request.
    mooncake: bool = False
    # A Mooncake producer whose pushes to these consumer addresses never land (a reserve that
    # times out): it answers 200 all the same, as vLLM pushes after answering.
    unreachable_consumers: set[str] = field(default_factory=set)
    # An older encoder: `ec_transfer_params` holds only a bare `ec_items` list, no per-hash entries.
    legacy_params: bool = False
    # A server (or something in front of it) that answers success with another 2xx.
    success_status: int = 200
    costs: Costs = field(default_factory=Costs)
    # Bodies are written in pieces of this size (None: whole), `stream_pause_s` apart.
    piece_bytes: int | None = 7
    # Media (URL or `input_audio` data) this encoder reports with empty metadata, as a vLLM
    # producer does for a model whose parser declares no placeholder fields for the modality
    # (PlaceholderMetadataResolver), or for an item whose processed data it no longer holds.
    no_metadata: frozenset[str] = frozenset()
    text_only: bool = False
    # Modalities started with a limit per prompt of 0 (`--limit-mm-per-prompt '{"video": 0}'`);
    # `text_only` is all of them.
    no_raw: frozenset[str] = frozenset()
    # A PD, prefill or decode that keeps a block cache and publishes vLLM's KV events over ZMQ
    # (fake_kv_events.py); off, the fake keeps its cheaper piece-wise prefix cache and no socket.
    kv_events: KvEventsOptions | None = None
    # `vllm serve --enable-scale-out`: the render endpoints answer (else 403, as vLLM's do).
    scale_out: bool = False
    # `--enable-lora --lora-modules NAME=PATH ...`: the adapters' names, listed by /v1/models with
    # the base model as `parent`, each keying its blocks by its name (as vLLM 0.32 does).
    lora_modules: tuple[str, ...] = ()
    # `--max-num-queued-reqs`: with this many requests unfinished, vLLM's admission control
    # (`AsyncLLM.check_admission`) refuses the next with 503 before the engine sees it.
    max_queued: int | None = None
    prefix: PrefixCache = field(default_factory=PrefixCache, init=False)
    # When the encoder's GPU is free again. An exact clock rather than lock + sleep, so timer
    # rounding (1 ms in the event loop) does not add up across queued sub-requests.
    _free_at: float = field(default=0.0, init=False, repr=False)
    counts: Counts = field(default_factory=Counts, init=False)
    faults: Faults = field(default_factory=Faults, init=False)
    healthy: bool = field(default=True, init=False)
    # GET /health calls answered, so tests can tell how often the proxy checks.
    health_checks: int = field(default=0, init=False)
    # POST /v1/messages/count_tokens calls answered, so tests can tell whether one got through.
    token_counts: int = field(default=0, init=False)
    # The proxy's media probes answered (fleet/capabilities.py).
    media_probes: int = field(default=0, init=False)
    # Prompts rendered (POST .../render).
    renders: int = field(default=0, init=False)
    requests: list[Seen] = field(default_factory=list, init=False, repr=False)
    loaded_from_cache: int = field(default=0, init=False)
    encoded_locally: int = field(default=0, init=False)
    cancelled: int = field(default=0, init=False)
    # Why each generation failed (injected, or an EC transfer the consumer could not resolve).
    generation_failures: list[str] = field(default_factory=list, init=False)
    active: int = field(default=0, init=False)
    max_active: int = field(default=0, init=False)
    _ids: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)

    def __post_init__(self) -> None:
        self.cache = SeenCache(self.costs.cache_items)
        self.kv = KvEngine(self.kv_events) if self.kv_events is not None and self.role != "encode" else None

    def close(self) -> None:
        """Release the KV-event sockets (the HTTP side belongs to whichever server hosts the fake)."""
        if self.kv is not None:
            self.kv.close()

    def restart_engine(self) -> None:
        """As if the engine had restarted on the same ports: every cache empty, KV-event sequence
        numbers from 0, nothing left to replay."""
        self.prefix = PrefixCache()
        self.cache = SeenCache(self.costs.cache_items)
        if self.kv is not None:
            self.kv.restart()

    def routes(self) -> dict[tuple[str, str], Callable[[Exchange], Awaitable[Answer | None]]]:
        """Method and path -> handler. A handler returns a whole answer, or None once it has
        streamed one through the exchange."""
        return {
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", fake_doors.PATHS[fake_doors.RESPONSES]): self.responses,
            ("POST", fake_doors.PATHS[fake_doors.MESSAGES]): self.messages,
            ("POST", fake_doors.COUNT_TOKENS_PATH): self.count_tokens,
            ("GET", "/health"): self.health,
            ("GET", "/stats"): self.stats,
            ("GET", "/v1/models"): self.models,
            ("POST", "/start_profile"): self.profile,
            ("POST", "/stop_profile"): self.profile,
            ("GET", "/kv_event_sources"): self.kv_event_sources,
            ("POST", "/reset_prefix_cache"): self.reset_prefix_cache,
            ("POST", "/v1/chat/completions/render"): self.render,
            ("POST", fake_doors.PATHS[fake_doors.RESPONSES] + "/render"): self.render,
            ("POST", fake_doors.PATHS[fake_doors.MESSAGES] + "/render"): self.render,
        }

    def app(self) -> web.Application:
        """The fake under aiohttp's server, as the tests run it."""
        app = web.Application(client_max_size=256 * 1024 * 1024)
        for (method, path), handler in self.routes().items():
            app.router.add_route(method, path, _under_aiohttp(handler))

        async def release(_: web.Application) -> None:
            self.close()

        app.on_cleanup.append(release)
        return app

    def bare_handler(self) -> bare_server.Handler:
        """The fake under `bare_server`, as the benchmark hosts it."""
        routes = self.routes()

        async def serve(exchange: bare_server.Exchange) -> None:
            handler = routes.get((exchange.method, exchange.path))
            answer = Answer(404) if handler is None else await handler(exchange)
            if answer is not None:
                exchange.reply(*answer)

        return serve

    async def health(self, exchange: Exchange) -> Answer:
        self.health_checks += 1
        return Answer(200 if self.healthy else 503)

    async def stats(self, exchange: Exchange) -> Answer:
        cache = {"cache_hits": self.cache.hits, "cache_misses": self.cache.misses}
        return _json({"role": self.role, **self.counts.as_dict(), **cache})

    async def models(self, exchange: Exchange) -> Answer:
        adapters = [{"id": name, "object": "model", "parent": MODEL} for name in self.lora_modules]
        return Answer(200, json.dumps({**MODELS, "data": MODELS["data"] + adapters}).encode(), JSON_TEXT)

    def _lora(self, body: dict[str, Any]) -> str | None:
        """The adapter a request's `model` names, None for the base model."""
        model = body.get("model")
        return model if model in self.lora_modules else None

    async def profile(self, exchange: Exchange) -> Answer:
        return Answer(200)

    async def kv_event_sources(self, exchange: Exchange) -> Answer:
        """Where each data-parallel rank publishes, as vLLM 0.32 answers it: {} without events."""
        return _json(self.kv.sources() if self.kv is not None else {})

    async def reset_prefix_cache(self, exchange: Exchange) -> Answer:
        """vLLM's dev endpoint (VLLM_SERVER_DEV_MODE=1): the prefix cache emptied, and with KV
        events on an `AllBlocksCleared` published."""
        self.prefix = PrefixCache()
        if self.kv is not None:
            self.kv.reset_prefix_cache()
        return _json({"success": True})

    async def render(self, exchange: Exchange) -> Answer:
        """vLLM 0.32's render endpoints (`scale_out/render/serving.py`): the prompt's token ids in
        the fake's tokenisation, and per modality each item's identifier and placeholder range, as
        the consumer's blocks will carry them; 403 unless started with --enable-scale-out."""
        if not self.scale_out:
            message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
            error = {"message": message, "type": "PermissionDeniedError", "param": None, "code": 403}
            return _json({"error": error}, 403)
        api = next(
            (a for a in (fake_doors.RESPONSES, fake_doors.MESSAGES) if exchange.path.startswith(fake_doors.PATHS[a])),
            "chat",
        )
        try:
            body = orjson.loads(exchange.body)
            if api != "chat":
                body = fake_doors.chat_view(api, body)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("messages must be a list")
        except ValueError as exc:
            return _engine_error(f"invalid request: {exc}", status=400)
        resolved = self._resolve_media(body)
        if not isinstance(resolved, Resolved):
            return resolved
        self.renders += 1
        prompt = tokenize(resolved.pieces)
        kinds = [kind for _, _, kind in resolved.pieces if kind not in ("role", "text")]
        hashes: dict[str, list[str]] = {}
        places: dict[str, list[dict[str, int]]] = {}
        for kind, feature in zip(kinds, prompt.features):
            hashes.setdefault(kind, []).append(feature.identifier)
            places.setdefault(kind, []).append({"offset": feature.offset, "length": feature.length})
        features = {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": None} if hashes else None
        salt = body.get("cache_salt")
        return _json(
            {
                "request_id": f"chatcmpl-{next(self._ids)}",
                "token_ids": prompt.tokens,
                "features": features,
                "model": body.get("model"),
                "cache_salt": salt,
            }
        )

    async def responses(self, exchange: Exchange) -> Answer | None:
        return await self.chat(exchange, fake_doors.RESPONSES)

    async def messages(self, exchange: Exchange) -> Answer | None:
        return await self.chat(exchange, fake_doors.MESSAGES)

    async def count_tokens(self, exchange: Exchange) -> Answer:
        """The prompt's length, as vLLM renders it (the fakes count a token per message and per item)."""
        self.token_counts += 1
        try:
            view = fake_doors.chat_view(fake_doors.MESSAGES, {"max_tokens": 1, **orjson.loads(exchange.body)})
        except ValueError as exc:
            return Answer(400, fake_doors.error_body(fake_doors.MESSAGES, str(exc), 400), "application/json")
        tokens = sum(1 + len(m["content"] if isinstance(m.get("content"), list) else ()) for m in view["messages"])
        return _json({"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}})

    async def chat(self, exchange: Exchange, api: str = "chat") -> Answer | None:
        """Every API's request, run as the chat completion vLLM makes of it (fake_doors.py)."""
        try:
            raw = exchange.body
            body = orjson.loads(raw)
            if api != "chat":
                body = fake_doors.chat_view(api, body)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("messages must be a list")
        except ValueError as exc:
            if api != "chat":
                return Answer(400, fake_doors.error_body(api, str(exc), 400), "application/json")
            return _engine_error(f"invalid request: {exc}", status=400)
        answer = await self._chat(exchange, raw, body, api)
        if answer is not None and api != "chat" and answer.status >= 400:
            # vLLM's routers translate the chat error into the API's shape, status kept.
            error = orjson.loads(answer.body)["error"]
            return Answer(
                answer.status,
                fake_doors.error_body(api, error["message"], answer.status, error["type"]),
                "application/json",
            )
        return answer

    async def _chat(self, exchange: Exchange, raw: bytes, body: dict[str, Any], api: str) -> Answer | None:
        if self.role != "encode" and (exchange.headers.get("x-request-id") or "").startswith(PROBE_REQUEST_ID):
            # The proxy's media probe, answered as vLLM answers it but, like the health checks,
            # kept out of what the tests count and of the faults they inject.
            self.media_probes += 1
            refused = self._resolve_media(body)
            if isinstance(refused, Answer):
                return refused
        if self.record:
            self.requests.append(Seen({k.lower(): v for k, v in exchange.headers.items()}, body))
        tag = (exchange.headers.get("x-request-id") or "?")[:1]
        self.counts.requests[tag] += 1
        self.counts.bytes_in[tag] += len(raw)
        if self.role != "encode" and (problem := _sampling_problem(body) or _cache_salt_problem(body)):
            # vLLM's SamplingParams validation: a 400 before anything runs.
            return _engine_error(problem, status=400)
        if self.max_queued is not None and self.active >= self.max_queued:
            refusal = {"message": QUEUE_OVERFLOW, "type": "Service Unavailable", "param": None, "code": 503}
            return _json({"error": refusal}, 503)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            injected = await self.faults.apply(exchange)
            if injected is not None:
                return injected
            if self.role == "encode":
                return await self._encode(exchange, body, tag)
            return await self._consume(exchange, body, tag, api)
        except (asyncio.CancelledError, ConnectionResetError):
            # The caller went away: what a backend sees when the proxy cancels its sub-request.
            self.cancelled += 1
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            # vLLM validates requests with pydantic and answers 400; so does the fake.
            return _engine_error(f"invalid request: {type(exc).__name__}: {exc}", status=400)
        finally:
            self.active -= 1

    # -- encoder ---------------------------------------------------------------------------------
    async def _encode(self, exchange: Exchange, body: dict[str, Any], tag: str) -> Answer:
        bad = self.faults.bad_media
        if bad and bad.encode() in exchange.body:
            return _engine_error("Failed to load image: cannot identify image file", self.faults.bad_media_status)
        params: dict[str, Any] = {}
        push = body.get("ec_transfer_params") or {}
        push_items = push.get("ec_items") or [] if push.get("consumer_zmq") else None
        legacy_items = []
        position = 0
        work = 0.0  # in fresh images
        for part in body["messages"][0]["content"]:
            kind = vllm_part_kind(part)
            if kind not in MEDIA_KEYS:
                continue
            modality = MEDIA_KEYS[kind]
            media = media_source(part, kind)
            factors = hash_factors(modality, body)
            identity = media_id(media)
            key = identifier(part.get("uuid"), identity, factors)
            shape = placeholder_shape(modality, identity, factors)
            self.store.entries[key] = (identity, shape)
            work += self.costs.repeat_factor if self.cache.seen(key) else 1.0
            if push_items is not None:
                # A Mooncake producer takes each item's transfer id by position; without one it
                # falls back to an id of its own that no consumer can name.
                given = push_items[position] if position < len(push_items) else {}
                transfer_id = given.get("transfer_id") or f"{exchange.headers.get('x-request-id')}:{position}"
                if push.get("consumer_zmq") not in self.unreachable_consumers:
                    self.store.pushes[transfer_id] = key
            if self.legacy_params:
                legacy_items.append({"mm_hash": key})
            else:
                bare = media in self.no_metadata or (part.get(kind) or {}).get("data") in self.no_metadata
                metadata = {} if bare else {GRID_FIELD[modality]: [shape]}
                entry = params.setdefault(key, {"metadata": metadata, **self.handles})
                if self.report_indices:
                    entry.setdefault("item_indices", []).append(position)
            position += 1
        if legacy_items:
            params["ec_items"] = legacy_items
        self.counts.images[tag] += position
        cost = (self.costs.request_s + self.costs.image_s * work) * self.costs.slowdown
        if cost > 0 and self.costs.parallel:
            await asyncio.sleep(cost)
        elif cost > 0:
            now = asyncio.get_running_loop().time()
            self._free_at = max(now, self._free_at) + cost
            await asyncio.sleep(self._free_at - now)
        return _json(
            {
                "id": f"chatcmpl-enc-{next(self._ids)}",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
                "ec_transfer_params": params or None,
            },
            status=self.success_status,
        )

    # -- consumers -------------------------------------------------------------------------------
    def _resolve_media(self, body: dict[str, Any]) -> Resolved | Answer:
        """Each media item's identity and engine identifier as the consumer sees them, and how many
        came as `*_embeds` references; or vLLM's error for a bad reference."""
        seen: list[str] = []
        identifiers: list[str] = []
        references = 0
        # The prompt as the prefix cache chains it, and the piece of each raw media item.
        pieces: list[tuple[str, int, str]] = []
        raw: list[int] = []
        refused = frozenset(EMBEDS_KEYS.values()) if self.text_only else self.no_raw
        if problem := _over_limit(body, refused) or _mixed_modality(body):
            return _engine_error(problem, 400)
        for message in body["messages"]:
            pieces.append((f"<{message.get('role')}>", 1, "role"))
            content = message.get("content")
            if not isinstance(content, list):
                pieces.append((str(content), text_tokens(str(content)), "text"))
                continue
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    pieces.append((str(part.get("text")), text_tokens(str(part.get("text"))), "text"))
                kind = vllm_part_kind(part)
                if kind == "prompt_embeds":
                    return _engine_error("You must set `--enable-prompt-embeds` to input `prompt_embeds`.", 400)
                if kind in EMBEDS_KEYS or kind == "image_pil":
                    # A data-less reference: only the encoder cache can resolve it.
                    if kind == "image_pil":
                        kind, part = "image_embeds", {"image_embeds": {}, "uuid": part.get("uuid")}
                    modality = EMBEDS_KEYS[kind]
                    factors = hash_factors(modality, body)
                    key = identifier(part.get("uuid"), "", factors) if part.get("uuid") else None
                    stored = self.store.entries.get(key) if key else None
                    if stored is None:
                        return _engine_error(
                            "Expected number of multimodal embeddings to match number of input items: "
                            "1, but got len(mm_embeddings)=0"
                        )
                    identity, shape = stored
                    claimed = part[kind].get(GRID_FIELD[modality])
                    if claimed != shape:
                        have, want = tokens_of(modality, shape), tokens_of(modality, claimed or [0, 0, 0])
                        return _engine_error(
                            f"Attempted to assign {have} = {have} multimodal tokens to {want} placeholders"
                        )
                    self.loaded_from_cache += 1
                    references += 1
                    seen.append(f"{identity}:{shape}")
                    identifiers.append(key)
                    pieces.append((key, tokens_of(modality, shape), modality))
                elif kind in MEDIA_KEYS:
                    modality = MEDIA_KEYS[kind]
                    media = media_source(part, kind)
                    if media.startswith("data:") and "," not in media:
                        # Loaded only once every item was counted (multimodal/media/connector.py).
                        return _engine_error(f"Invalid data URL {media[:32]!r}: missing ',' separator.", 400)
                    factors = hash_factors(modality, body)
                    identity = media_id(media)
                    shape = placeholder_shape(modality, identity, factors)
                    key = identifier(part.get("uuid"), identity, factors)
                    seen.append(f"{identity}:{shape}")
                    identifiers.append(key)
                    raw.append(len(pieces))
                    pieces.append((key, tokens_of(modality, shape), modality))
        return Resolved(seen, identifiers, references, pieces, raw)

    def _compute(self, resolved: Resolved, tag: str, body: dict[str, Any], answer: str) -> Served | None:
        """What the engine computes of the prompt: vLLM's scheduler needs no encoder output for an
        item inside the prefix-cached tokens, loads one the EC connector has
        (`_try_schedule_encoder_inputs`), and encodes the rest itself. A decode instance's KV
        comes from prefill. With KV events on, the block cache of `fake_kv_events` decides what
        was cached, in tokens, and says so on the ZMQ socket."""
        served = None
        salt = body.get("cache_salt")  # checked on arrival: a string or None
        if self.kv is not None:
            prompt = tokenize(resolved.pieces)
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            generated = list(answer.encode())[: limit if isinstance(limit, int) and limit > 0 else None]
            served = self.kv.serve(prompt, generated, salt, self._lora(body))
        if self.role == "decode":
            hit = len(resolved.pieces)
        elif served is not None:
            hit = sum(1 for end in prompt.ends if end <= served.cached_tokens)
            self.counts.prompt_tokens[tag] += served.prompt_tokens
            self.counts.cached_tokens[tag] += served.cached_tokens
        else:
            hit = self.prefix.cached(resolved.pieces, salt)
            self.counts.prompt_tokens[tag] += sum(tokens for _, tokens, _ in resolved.pieces)
            self.counts.cached_tokens[tag] += sum(tokens for _, tokens, _ in resolved.pieces[:hit])
        for position in resolved.raw:
            key = resolved.pieces[position][0]
            if position < hit:
                self.counts.prefix_items[tag] += 1
            elif key in self.store.entries:
                self.loaded_from_cache += 1
                self.counts.ec_loads[tag] += 1
            else:
                self.encoded_locally += 1
                self.counts.local_encodes[tag] += 1
        return served

    def _usage(self, media: Resolved, served: Served | None, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's usage: with KV events on, from the tokens the block cache counted, and with
        `prompt_tokens_details` (--enable-prompt-tokens-details) what the cache held; decode
        reports prefill's hits, which prefill hands over in `kv_transfer_params`."""
        if served is None:
            return {"prompt_tokens": 10 + len(media.seen), "completion_tokens": 7, "total_tokens": 17 + len(media.seen)}
        usage: dict[str, Any] = {
            "prompt_tokens": served.prompt_tokens,
            "completion_tokens": served.completion_tokens,
            "total_tokens": served.prompt_tokens + served.completion_tokens,
        }
        if self.kv is not None and self.kv.options.prompt_tokens_details:
            cached = served.cached_tokens
            remote = (body.get("kv_transfer_params") or {}).get("remote_prefill_cached_tokens")
            if self.role == "decode" and isinstance(remote, int):
                cached = remote
            modalities: dict[str, int] = defaultdict(int)
            for _, tokens, kind in media.pieces:
                if kind not in ("role", "text"):
                    modalities[kind] += tokens
            usage["prompt_tokens_details"] = {
                "cached_tokens": cached,
                "created_cache_tokens": served.created_tokens,
                "multimodal_tokens": dict(modalities) or None,
            }
        return usage

    def _unresolved_push(self, body: dict[str, Any], identifiers: list[str]) -> str | None:
        """Why a Mooncake consumer cannot obtain some item's embedding, or None.

        Feature i takes `ec_items[i]` when its mm_hash is absent or equal to the feature's
        identifier, else the first entry naming that identifier (vLLM's
        ECMooncakeScheduler._request_transfer_id). The id must name a push of this very identifier
        (vLLM refuses an id that names another encoding, or waits for a push that never comes and
        fails the request as unavailable), and each occurrence needs its own push: two features
        resolving to one id leave the other occurrence's reservation orphaned.
        """
        params = body.get("ec_transfer_params") or {}
        items = [i for i in (params.get("ec_items") or []) if isinstance(i, dict)]
        used: set[str] = set()
        for index, ident in enumerate(identifiers):
            transfer_id = None
            candidates = ([items[index]] if index < len(items) else []) + items
            for n, item in enumerate(candidates):
                positional = n == 0 and index < len(items)
                if item.get("transfer_id") and (
                    item.get("mm_hash") == ident or (positional and item.get("mm_hash") is None)
                ):
                    transfer_id = str(item["transfer_id"])
                    break
            if transfer_id is None:
                return f"item {index} ({ident[:16]}) has no transfer id; its push never arrives"
            pushed = self.store.pushes.get(transfer_id)
            if pushed is None:
                return f"item {index}: no push under transfer id {transfer_id}"
            if pushed != ident:
                return f"item {index}: transfer id {transfer_id} names mm_hash {pushed[:16]}, not {ident[:16]}"
            if transfer_id in used:
                return f"item {index}: transfer id {transfer_id} already used by another occurrence"
            used.add(transfer_id)
        return None

    async def _consume(self, exchange: Exchange, body: dict[str, Any], tag: str, api: str = "chat") -> Answer | None:
        if self.role == "decode":
            kv = body.get("kv_transfer_params") or {}
            if not kv.get("remote_block_ids"):
                return _engine_error("decode instance got no kv_transfer_params from prefill", status=400)
        media = self._resolve_media(body)
        if isinstance(media, Answer):
            return media
        resolved, identifiers, references = media.seen, media.identifiers, media.references
        texts = [
            part.get("text", "") if isinstance(part, dict) else ""
            for m in body["messages"]
            for part in (m["content"] if isinstance(m.get("content"), list) else [{"text": m.get("content") or ""}])
        ]
        answer = "answer-" + _digest(texts, resolved)[:12] + ANSWER_SUFFIX
        served = self._compute(media, tag, body, answer)
        self.counts.images[tag] += references
        self.counts.raw_images[tag] += len(resolved) - references
        failure = "injected generation error" if self.faults.generation_error() else None
        if failure is None and self.mooncake:
            failure = self._unresolved_push(body, identifiers)
        if self.mooncake:
            # The request's end cancels the reservations it named, whatever its outcome.
            for item in (body.get("ec_transfer_params") or {}).get("ec_items") or []:
                if isinstance(item, dict) and item.get("transfer_id"):
                    self.store.pushes.pop(str(item["transfer_id"]), None)
        if failure is None and self.role != "prefill" and self.faults.abort():
            return await self._aborted(exchange, body, api)
        if failure is None and self.role != "prefill" and self.faults.late_abort(body):
            return _aborted_partway(api, f"chatcmpl-{next(self._ids)}", body.get("model"), answer)
        if failure is not None:
            self.generation_failures.append(failure)
            if body.get("stream") and self.role != "prefill":
                if api != "chat":
                    await exchange.start(200, SSE)
                    await exchange.write(fake_doors.stream_error(api, f"gen-{next(self._ids)}", body.get("model")))
                    await exchange.end()
                    return None
                return await self._stream_generation_error(exchange, f"chatcmpl-{next(self._ids)}", body.get("model"))
            return _engine_error("Internal server error")
        completion_id = f"chatcmpl-{next(self._ids)}"
        usage = self._usage(media, served, body)
        if self.role == "prefill":
            kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "fake-prefill",
                "remote_block_ids": [1, 2, 3],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
            }
            if served is not None:
                # vLLM 0.32's prefill hands its prefix hits to decode, which reports them.
                kv["remote_prefill_cached_tokens"] = served.cached_tokens
            if api != "chat":
                native = fake_doors.answer_json(
                    api, completion_id, body.get("model"), "x", {**usage, "completion_tokens": 1}, kv
                )
                return Answer(self.success_status, native, "application/json")
            return _json(
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "choices": [],
                    "usage": usage,
                    "kv_transfer_params": kv,
                },
                status=self.success_status,
            )
        if api != "chat":
            return await self._answer_natively(exchange, api, completion_id, body, answer, usage)
        if not body.get("stream"):
            completion = {
                "id": completion_id,
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
                "usage": usage,
            }
            cut, stall = self.faults.break_stream(), self.faults.stall_stream()
            if not (cut or stall):
                if self.costs.answer_s:
                    await asyncio.sleep(self.costs.answer_s)
                return _json(completion, status=self.success_status)
            # The body breaks off (or goes silent) after the headers: chunked, in pieces.
            await exchange.start(self.success_status, "application/json")
            return await self._write_paced(exchange, orjson.dumps(completion), cut, stall)
        return await self._stream(exchange, completion_id, body, answer, usage)

    async def _answer_natively(
        self, exchange: Exchange, api: str, answer_id: str, body: dict[str, Any], answer: str, usage: dict[str, int]
    ) -> Answer | None:
        if not body.get("stream"):
            return Answer(
                self.success_status, fake_doors.answer_json(api, answer_id, body.get("model"), answer, usage), JSON_TEXT
            )
        await exchange.start(self.success_status, SSE)
        pieces = [answer[i : i + self.tokens_per_chunk] for i in range(0, len(answer), self.tokens_per_chunk)]
        payload = b"".join(fake_doors.stream_frames(api, answer_id, body.get("model"), pieces, usage))
        await self._write_paced(exchange, payload, self.faults.break_stream(), self.faults.stall_stream())
        return None

    async def _aborted(self, exchange: Exchange, body: dict[str, Any], api: str) -> Answer | None:
        """What vLLM 0.32 answers for a request it aborted before generating (captured from a real
        server): chat `finish_reason="abort"`, or a stream of the role chunk (and the usage chunk
        when asked) then [DONE]; Messages and Responses their usual shapes, of no output token."""
        answer_id, model = f"chatcmpl-{next(self._ids)}", body.get("model")
        usage = {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}
        if api != "chat":
            if not body.get("stream"):
                return Answer(200, fake_doors.aborted_json(api, answer_id, model, usage), JSON_TEXT)
            await exchange.start(200, SSE)
            await exchange.write(fake_doors.aborted_stream(api, answer_id, model, usage))
            await exchange.end()
            return None
        if not body.get("stream"):
            return _aborted_chat(answer_id, model, "", usage)
        events = [_role_chunk(answer_id, model)]
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            events.append({**events[0], "choices": [], "usage": usage})
        await exchange.start(200, SSE)
        await exchange.write(b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n")
        await exchange.end()
        return None

    async def _stream_generation_error(self, exchange: Exchange, completion_id: str, model: Any) -> None:
        """vLLM's stream when the engine fails the request: the role chunk of the first iteration,
        then the GenerationError as an event, then [DONE], all after status 200."""
        await exchange.start(200, SSE)
        role = _role_chunk(completion_id, model)
        error = {
            "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
        }
        await exchange.write(b"data: " + orjson.dumps(role) + b"\n\n")
        await exchange.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await exchange.write(b"data: [DONE]\n\n")
        await exchange.end()

    async def _stream(
        self, exchange: Exchange, completion_id: str, body: dict[str, Any], answer: str, usage: dict[str, Any]
    ) -> None:
        await exchange.start(self.success_status, SSE)
        model = body.get("model")
        # vLLM's first event carries the role only; generated text follows.
        events = [_role_chunk(completion_id, model)]
        events += [
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "model": model,
                "choices": [
                    {"index": 0, "delta": {"content": answer[i : i + self.tokens_per_chunk]}, "finish_reason": None}
                ],
            }
            for i in range(0, len(answer), self.tokens_per_chunk)
        ]
        finished: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        }
        events.append(finished)
        # As vLLM: the fingerprint ends the choice's last chunk, unless usage was asked for; then a
        # chunk without choices follows with the usage, and the fingerprint moves there.
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            events.append({**finished, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT})
        else:
            finished["system_fingerprint"] = FINGERPRINT
        frames = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events]
        payload = b"".join(frames) + b"data: [DONE]\n\n"
        # The first token comes `first_token_s` after the role event, the rest `answer_s` after it.
        role_end = len(frames[0])
        pauses = {role_end: self.costs.first_token_s, role_end + len(frames[1]): self.costs.answer_s}
        await self._write_paced(exchange, payload, self.faults.break_stream(), self.faults.stall_stream(), pauses)

    async def _write_paced(
        self, exchange: Exchange, payload: bytes, cut: bool, stall: bool, pauses: dict[int, float] | None = None
    ) -> None:
        """Odd-sized writes cut through multibyte characters and SSE frames on purpose. A cut
        resets the connection at the first piece past halfway; a stall goes silent there until the
        caller goes away. At each offset of `pauses` the writing waits that many seconds."""
        halfway = len(payload) // 2
        step = self.piece_bytes or len(payload)
        holds = sorted(offset for offset, seconds in (pauses or {}).items() if seconds)
        start = 0
        while start < len(payload):
            if start >= halfway and cut:
                exchange.drop()
                raise InjectedDrop("fault injected: stream cut halfway")
            if start >= halfway and stall:
                while not exchange.gone:
                    await asyncio.sleep(0.02)
                self.cancelled += 1
                raise InjectedDrop("fault injected: stalled stream abandoned by the caller")
            if start in holds:
                await asyncio.sleep(pauses[start])
            end = min([start + step, len(payload), *(hold for hold in holds if hold > start)])
            await exchange.write(payload[start:end])
            await asyncio.sleep(self.stream_pause_s)
            start = end
        await exchange.end()


def _over_limit(body: dict[str, Any], refused: frozenset[str]) -> str | None:
    """vLLM's count of raw items against the limits per prompt (renderers/chat_utils.py, the item
    tracker's `add`): while the messages are read, before any item is loaded, the first raw item of
    a modality whose limit is 0 is a 400."""
    for message in body["messages"]:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            modality = MEDIA_KEYS.get(vllm_part_kind(part))
            if modality in refused:
                return f"At most 0 {modality}(s) may be provided in one prompt."
    return None


def _mixed_modality(body: dict[str, Any]) -> str | None:
    """vLLM's _resolve_items (renderers/chat_utils.py): raw media and embeddings of one modality in
    one request are a 400 while the request is parsed, before the engine looks anything up."""
    raw: set[str] = set()
    embeds: set[str] = set()
    for message in body["messages"]:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = vllm_part_kind(part)
            if kind in MEDIA_KEYS:
                raw.add(MEDIA_KEYS[kind])
            elif kind in EMBEDS_KEYS or kind == "image_pil":
                embeds.add(EMBEDS_KEYS.get(kind, "image"))
    for modality in ("image", "audio", "video"):
        if modality in raw and modality in embeds:
            return f"Mixing raw {modality} and embedding inputs is not allowed (parameter={modality}_embeds)"
    return None


def _sampling_problem(body: dict[str, Any]) -> str | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        # SamplingParams refuses a budget of no token, whichever door it came through.
        if type(value) is int and value < 1:
            return f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})"
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    min_tokens = body.get("min_tokens") or 0
    if isinstance(limit, int) and isinstance(min_tokens, int) and min_tokens > limit:
        return f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}."
    return None


def _cache_salt_problem(body: dict[str, Any]) -> str | None:
    """vLLM's request models check `cache_salt` before anything runs (validate_cache_salt)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(salt) > 128 or any(char in "@/\\\0" for char in salt):
        return "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
    return None


def _aborted_partway(api: str, answer_id: str, model: Any, answer: str) -> Answer:
    """What vLLM 0.32 answers for a non-streamed request it aborted partway (captured from a real
    server): chat `finish_reason="abort"` with the text so far, Messages the text without a
    `stop_reason`, Responses the text `completed` (nothing there says it was aborted)."""
    text = answer[: len(answer) // 2]
    usage = {"prompt_tokens": 7, "total_tokens": 7 + len(text), "completion_tokens": len(text)}
    if api != "chat":
        return Answer(200, fake_doors.answer_json(api, answer_id, model, text, usage, stop_reason=None), JSON_TEXT)
    return _aborted_chat(answer_id, model, text, usage)


def _aborted_chat(answer_id: str, model: Any, text: str, usage: dict[str, int]) -> Answer:
    """A non-streamed chat answer vLLM aborted, with what it generated before: `finish_reason="abort"`."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "abort"}
    return _json({"id": answer_id, "object": "chat.completion", "model": model, "choices": [choice], "usage": usage})


def _role_chunk(completion_id: str, model: Any) -> dict[str, Any]:
    """vLLM's first event of a chat stream, before anything is generated: the role alone."""
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return {"id": completion_id, "object": "chat.completion.chunk", "model": model, "choices": [role]}


def _json(obj: Any, status: int = 200) -> Answer:
    return Answer(status, orjson.dumps(obj), "application/json")


def _engine_error(message: str, status: int = 500) -> Answer:
    return _json({"error": {"message": message, "type": "InternalServerError", "param": None, "code": status}}, status)


def _under_aiohttp(
    handler: Callable[[Exchange], Awaitable[Answer | None]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(request: web.Request) -> web.StreamResponse:
        exchange = _AiohttpExchange(request, await request.read())
        answer = await handler(exchange)
        if answer is not None:
            exchange.reply(*answer)
        return exchange.response

    return serve


# The benchmark's streams: the answer in two tokens, each body written whole, as a server would.
BENCH_TOKENS_PER_CHUNK = 20


async def serve(spec: dict[str, Any]) -> None:
    """Host the servers of `spec` on 127.0.0.1, print one JSON line of their ports and serve
    until SIGTERM or until the parent process is gone. They share one EC store and keep no
    record of requests, so memory stays flat however long the benchmark runs. They run under
    `bare_server`: aiohttp's server would cost the harness's core twice the CPU per request."""
    loop = asyncio.get_running_loop()
    store = ECStore()
    servers, ports = [], {}
    fakes: list[FakeVLLM] = []
    for entry in spec["servers"]:
        costs = Costs(
            entry.get("request_ms", 0.0) / 1000,
            entry.get("image_ms", 0.0) / 1000,
            entry.get("answer_ms", 0.0) / 1000,
            slowdown=entry.get("slowdown", 1.0),
            repeat_factor=entry.get("repeat_factor", 1.0),
            cache_items=entry.get("cache_items", 0),
        )
        kv_events = entry.get("kv_events")
        fake = FakeVLLM(
            entry["role"],
            store,
            costs=costs,
            record=False,
            piece_bytes=None,
            tokens_per_chunk=BENCH_TOKENS_PER_CHUNK,
            kv_events=KvEventsOptions(**kv_events) if kv_events is not None else None,
        )
        fakes.append(fake)
        server = await bare_server.start_server(fake.bare_handler(), "127.0.0.1", entry.get("port", 0))
        servers.append(server)
        ports[entry["name"]] = server.sockets[0].getsockname()[1]
    sys.stdout.write(orjson.dumps({"ports": ports}).decode() + "\n")
    sys.stdout.flush()
    stop = loop.create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: stop.done() or stop.set_result(None))
    parent = os.getppid()
    # An orphaned host would hold its ports forever: leave when the harness is gone.
    while not stop.done() and os.getppid() == parent:
        await asyncio.wait([stop], timeout=1.0)
    for server in servers:
        server.close()
    for fake in fakes:
        fake.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m epd_proxy_tools.testing.fake_vllm '{"servers": [{"name", "role", "request_ms",
    "image_ms", "answer_ms", "slowdown", "repeat_factor", "cache_items", "port", "kv_events"}, ...]}'`:
    the benchmark's fakes, in a process of their own (see `Costs`; `kv_events` holds the fields of
    `KvEventsOptions`, and turns the block cache and its publisher on)."""
    argv = sys.argv[1:] if argv is None else argv
    spec = orjson.loads(argv[0])
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(spec))
    else:
        uvloop.run(serve(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
