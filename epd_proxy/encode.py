"""Step 3: encoder sub-requests: their bodies (pure) and sending them (fail fast, fail over)."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.backends import CHAT_PATH, Instance
from epd_proxy.errors import ProxyError
from epd_proxy.extract import MediaItem
from epd_proxy.upstream import Payload, Timeouts, Upstream

log = logging.getLogger("epd_proxy.encode")

# Without these the encoder processes media with default options while the consumer applies the
# client's, and vLLM fails with "Attempted to assign N = N multimodal tokens to M placeholders".
FORWARDED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")
# An encoder answers a few hundred bytes per item (its `ec_transfer_params`); even at
# --max-media-items 256 that is well under this, and anything larger is not an encoder's answer.
MAX_ENCODER_ANSWER_BYTES = 1 << 20


class IdMint:
    """Transfer ids and child request ids from a per-process random stream seeded by the OS.

    They must be unique, not secret; drawing from the OS per id costs a system call each, and a
    request mints several.
    """

    def __init__(self) -> None:
        self._rng = random.Random(os.urandom(32))

    def transfer_id(self) -> str:
        return f"{self._rng.getrandbits(128):032x}"

    def child_request_id(self, request_id: str, first_index: int) -> str:
        return f"{request_id}:{first_index}:{self._rng.getrandbits(24):06x}"


def encoder_body(
    client_body: dict[str, Any],
    items: Sequence[MediaItem],
    *,
    send_uuid: bool,
    transfer_ids: Sequence[str] = (),
    consumer_zmq: str | None = None,
) -> dict[str, Any]:
    """One user message holding only the group's media, nothing the encoder would have to sample."""
    content = [{**item.part, "uuid": item.uuid} if send_uuid else item.part for item in items]
    body: dict[str, Any] = {
        "model": client_body.get("model"),
        "messages": [{"role": "user", "content": content}],
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
