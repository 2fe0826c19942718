"""Encoder sub-requests on the wire: their bodies (pure), their ids, and sending one.

What the encode step (encode.py) and cross-request coalescing (coalesce.py) both send, and how
(`Sender`): a group alone and a sub-request from the queue keep the same books.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from epd_proxy.calls.upstream import Payload, Timeouts, Upstream
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import CHAT_PATH, Instance
from epd_proxy.fleet.lanes import Lane
from epd_proxy.fleet.stalls import overdue_after
from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.trace import Trace
from epd_proxy.ops.metrics import Metrics

Dumps = Callable[[Any], Payload]
# Awaits one backend call and tells health how it went (the pipeline's, shared by every stage).
Observed = Callable[[Instance, Awaitable[Any], Trace], Awaitable[Any]]

log = logging.getLogger("epd_proxy.encode")

# Without these the encoder processes media with default options while the consumer applies the
# client's, and vLLM fails with "Attempted to assign N = N multimodal tokens to M placeholders".
FORWARDED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")
# An encoder answers a few hundred bytes per item (its `ec_transfer_params`); even at
# --max-media-items 256 that is well under this, and anything larger is not an encoder's answer.
MAX_ENCODER_ANSWER_BYTES = 1 << 20


def coalesce_key(body: dict[str, Any], forwarded: Sequence[str], consumer_zmq: str | None) -> bytes | None:
    """What must be identical for two requests' images to share an encoder sub-request: every
    byte of the encoder body except its media (`encoder_body` builds it from the model,
    the `forwarded` fields and the Mooncake consumer address, which also names the consumer's
    data-parallel rank). Compared as written, not as parsed: key order reaches vLLM's hashes.

    What else an encoder-only vLLM 0.32 instance reads of a chat request, and why it is not
    here: the proxy sends it none of it. Sampling fields, `max_tokens`, `tools` and
    `structured_outputs` shape generation, which an encoder never runs
    (`Scheduler.update_from_output` stops it once the prompt is consumed); `chat_template`,
    `chat_template_kwargs` and `add_generation_prompt` change only the text tokens around the
    placeholders; `cache_salt` salts prefix-cache block hashes, and an encoder-only instance
    runs with prefix caching off (`VllmConfig`) while media hashes never include it
    (`ProcessorInputs.get_mm_hashes` folds in only `mm_processor_kwargs` and that modality's
    `media_io_kwargs`); `vllm_xargs` and `kv_transfer_params` are refused from clients or not
    forwarded. LoRA is chosen by `model`, which is in the key (tower and connector LoRA change
    the embeddings), and so are `priority` (the encoder's scheduling order) and `session_id`
    (kept on the engine's request, in its KV events).
    """
    fields = {name: body[name] for name in forwarded if name in body}
    try:
        return orjson.dumps([body.get("model"), fields, consumer_zmq])
    except orjson.JSONEncodeError:
        return None  # nested too deeply to write: its own sub-request says so (a 400)


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    """How an attempt's groups go to encoders, from `serve`'s options: read by the encode step and
    by the coalescer alike, so the two can never send under different rules."""

    timeouts: Timeouts
    # Images per sub-request; 0 = no cap.
    max_batch_size: int
    # Each item's uuid goes with it, so the encoder's cache keys are the consumer's (with the rewrite).
    send_uuid: bool
    # Other encoders a failed group is sent to.
    failovers: int
    coalesce: bool = True


class IdMint:
    """Transfer ids and child request ids from a per-process random stream seeded by the OS.

    They must be unique, not secret; drawing from the OS per id costs a system call each, and a
    request mints several.
    """

    def __init__(self) -> None:
        self._rng = random.Random(os.urandom(32))

    def transfer_id(self) -> str:
        return f"{self._rng.getrandbits(128):032x}"

    def shared_request_id(self) -> str:
        """A sub-request carrying several requests' groups is its own: no member's id names it."""
        return f"shared-{self._rng.getrandbits(64):016x}"

    def child_request_id(self, request_id: str, first_index: int) -> str:
        return f"{request_id}:{first_index}:{self._rng.getrandbits(24):06x}"


def encoder_parts(items: Sequence[MediaItem], send_uuid: bool) -> list[dict[str, Any]]:
    """The group's media parts as the encoder gets them: under the proxy's uuid where the consumer
    will name the item by it too."""
    return [{**item.part, "uuid": item.uuid} if send_uuid and item.named else item.part for item in items]


def encoder_body(
    client_body: dict[str, Any],
    items: Sequence[MediaItem],
    *,
    send_uuid: bool,
    transfer_ids: Sequence[str] = (),
    consumer_zmq: str | None = None,
) -> dict[str, Any]:
    """One user message holding only the group's media, nothing the encoder would have to sample."""
    body: dict[str, Any] = {
        "model": client_body.get("model"),
        "messages": [{"role": "user", "content": encoder_parts(items, send_uuid)}],
        "stream": False,
    }
    for name in FORWARDED_FIELDS:
        if name in client_body:
            body[name] = client_body[name]
    if consumer_zmq is not None:
        # The producer matches these by position: the engine may rehash, so no mm_hash is sent.
        body["ec_transfer_params"] = {
            "consumer_zmq": consumer_zmq,
            "ec_items": [{"transfer_id": tid} for tid in transfer_ids],
        }
    return body


@dataclass(frozen=True, slots=True)
class EncoderReply:
    encoder: Instance
    ec_transfer_params: dict[str, Any] | None


async def post_encoder(
    upstream: Upstream, encoder: Instance, payload: Payload, request_id: str, timeouts: Timeouts
) -> EncoderReply:
    headers = {"x-request-id": request_id, "Content-Type": "application/json"}
    answer = await upstream.call(
        encoder,
        "POST",
        CHAT_PATH,
        body=payload,
        headers=headers,
        timeouts=timeouts,
        stage="encode",
        what="Encoder request",
        # The same uuid gives the same embedding, so a sub-request may be sent again.
        idempotent=True,
        max_body=MAX_ENCODER_ANSWER_BYTES,
    )
    raw = answer.body
    if not 200 <= answer.status < 300:
        text = raw.decode("utf-8", "replace")[:2000]
        raise ProxyError(
            answer.status,
            f"Encoder request failed: {text}",
            stage="encode",
            backend=encoder.url,
            answered=answer.status,
        )
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        log.warning("encoder %s answered 200 with a body that is not JSON; its items stay raw media", encoder.url)
        return EncoderReply(encoder, None)
    params = parsed.get("ec_transfer_params") if isinstance(parsed, dict) else None
    return EncoderReply(encoder, params if isinstance(params, dict) else None)


@dataclass(frozen=True, slots=True)
class Encoded:
    """One group's share of an encoder's answer, as if the group had been sent alone."""

    encoder: Instance
    ec_transfer_params: dict[str, Any] | None
    transfer_ids: list[str]

    @property
    def backend(self) -> str:
        return self.encoder.url


# A watchdog that fires this late says the proxy's own event loop was held up (a CPU-starved
# host), not the encoder: it waits once more instead.
LOOP_LAG_S = 0.1


class Overdue:
    """Calls `fire` once a sub-request is `after` seconds old (stalls.overdue_after)."""

    __slots__ = ("_loop", "_after", "_fire", "_due", "_handle")

    def __init__(self, after: float, fire: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._after = after
        self._fire = fire
        self._arm()

    def _arm(self) -> None:
        self._due = self._loop.time() + self._after
        self._handle = self._loop.call_at(self._due, self._check)

    def _check(self) -> None:
        if self._loop.time() - self._due > LOOP_LAG_S:
            self._arm()
        else:
            self._fire()

    def cancel(self) -> None:
        self._handle.cancel()


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One sub-request about to leave, already counted in flight on its lane (`Lane.started`
    for a group alone, `Lane.next_batch` for one from the queue) at `sent`."""

    encoder: Instance
    lane: Lane
    request_id: str
    # Whose health verdicts it counts towards (a shared sub-request is its own).
    trace: Trace
    items: int
    cost: float
    sent: float
    # Moves off overdue encoders of its most moved group: each doubles its overdue time.
    moves: int


# What a sub-request's caller makes of the encoder's answer.
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Sender:
    """Sends one encoder sub-request and keeps its books: the metrics, a watch that calls
    `overdue(after)` once it is far past its expected time (stalls.overdue_after), its span,
    and its lane's outstanding work and speed when it ends. What an answer means, and how an
    overdue one moves, is the caller's."""

    upstream: Upstream
    metrics: Metrics
    observed: Observed
    options: EncodeOptions
    clock: Callable[[], float]

    async def send(
        self,
        out: Outgoing,
        payload: Callable[[], Payload],
        span: Callable[[], AbstractContextManager],
        overdue: Callable[[float], None],
        read: Callable[[EncoderReply], T],
    ) -> T:
        """What `read` makes of the answer; an answer it refuses (raises) counts as a failure, and
        teaches the lane nothing of the encoder's speed."""
        lane, encoder = out.lane, out.encoder
        done = None
        watch = None
        try:
            body = payload()
            self.metrics.encoder_subrequests.labels(encoder.url).inc()
            self.metrics.items_per_subrequest.observe(out.items)
            after = overdue_after(lane, out.cost, self.options.timeouts.total, out.moves)
            if after is not None:
                watch = Overdue(after, lambda: overdue(after))
            with span():
                reply = await self.observed(
                    encoder,
                    post_encoder(self.upstream, encoder, body, out.request_id, self.options.timeouts),
                    out.trace,
                )
            answer = read(reply)
            done = self.clock()
            return answer
        finally:
            if watch is not None:
                watch.cancel()
            lane.finished(out.cost, out.sent, done)
