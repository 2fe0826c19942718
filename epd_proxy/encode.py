"""Step 3: encoder sub-requests: their bodies (pure), sending them, fan-out and failover.

One attempt's encode plans the groups (plan.py), sends them all at once and maps every answer
back to its items (match.py); the pipeline decides whether there is another attempt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.backends import CHAT_PATH, Instance
from epd_proxy.errors import BackendUnreachable, ProxyError
from epd_proxy.extract import MediaItem
from epd_proxy.match import Matches, match_group
from epd_proxy.metrics import Metrics
from epd_proxy.plan import EncoderGroup, plan_groups
from epd_proxy.routing import RoutingPolicy
from epd_proxy.trace import Trace
from epd_proxy.upstream import Payload, Timeouts, Upstream

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


class EncodeStep:
    """Every group of one attempt to its encoder at once. A group that fails with a transport
    error, timeout or 5xx is sent again to the least busy other encoder (up to `failovers` times);
    one that still fails cancels the others and fails the attempt."""

    def __init__(
        self,
        upstream: Upstream,
        metrics: Metrics,
        policy: RoutingPolicy,
        live: Callable[[], Sequence[Instance]],
        observed: Observed,
        *,
        timeouts: Timeouts,
        max_batch_size: int,
        send_uuid: bool,
        failovers: int,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.policy = policy
        self.live = live
        self.observed = observed
        self.timeouts = timeouts
        self.max_batch_size = max_batch_size
        self.send_uuid = send_uuid
        self.failovers = failovers
        self.ids = IdMint()

    async def run(
        self,
        body: dict[str, Any],
        items: Sequence[MediaItem],
        consumer_zmq: str | None,
        trace: Trace,
        dumps: Dumps = orjson.dumps,
    ) -> Matches:
        matches = Matches()
        if not items:
            return matches
        started = time.perf_counter()
        encoders = self.live()
        if not encoders:
            raise ProxyError(
                503, "the request has media but no encoder is live", stage="route", error_type="service_unavailable"
            )
        assignment = self.policy.choose(encoders, [item.uuid for item in items])
        groups = plan_groups(items, assignment, self.max_batch_size)
        trace.encoder_requests += len(groups)
        results = await _all_or_first_failure(
            [self._send_group(body, items, group, consumer_zmq, trace, dumps) for group in groups]
        )
        audio_in_video = _truthy_option(body, "use_audio_in_video")
        for group, (reply, transfer_ids) in zip(groups, results):
            match_group(
                [items[i] for i in group.indices],
                transfer_ids,
                reply.ec_transfer_params,
                matches,
                audio_in_video=audio_in_video,
                push_mode=consumer_zmq is not None,
                backend=reply.encoder.url,
            )
        trace.encode_s += time.perf_counter() - started
        return matches

    async def _send_group(
        self,
        body: dict[str, Any],
        items: Sequence[MediaItem],
        group: EncoderGroup[Instance],
        consumer_zmq: str | None,
        trace: Trace,
        dumps: Dumps,
    ) -> tuple[EncoderReply, list[str]]:
        """Send one group; on a transport error, timeout or 5xx, fail over to another encoder."""
        group_items = [items[i] for i in group.indices]
        encoder = group.encoder
        tried: list[Instance] = []
        while True:
            transfer_ids = [self.ids.transfer_id() for _ in group_items]
            sub_body = encoder_body(
                body,
                group_items,
                send_uuid=self.send_uuid,
                transfer_ids=transfer_ids,
                consumer_zmq=consumer_zmq,
            )
            tried.append(encoder)
            self.metrics.encoder_subrequests.labels(encoder.url).inc()
            self.metrics.items_per_subrequest.observe(len(group_items))
            try:
                reply = await self.observed(
                    encoder,
                    post_encoder(
                        self.upstream,
                        encoder,
                        dumps(sub_body),
                        self.ids.child_request_id(trace.request_id, group.indices[0]),
                        self.timeouts,
                    ),
                    trace,
                )
                return reply, transfer_ids
            except ProxyError as exc:
                worth_retrying = isinstance(exc, BackendUnreachable) or exc.status >= 500
                fallback = self._failover_target(tried) if worth_retrying else None
                if fallback is None:
                    raise
                log.warning(
                    "request %s: encoder %s failed (%s); retrying its %d item(s) on %s",
                    trace.request_id,
                    encoder.url,
                    exc.message,
                    len(group_items),
                    fallback.url,
                )
                trace.encoder_failovers += 1
                self.metrics.failovers.labels(encoder.url).inc()
                encoder = fallback

    def _failover_target(self, tried: list[Instance]) -> Instance | None:
        if len(tried) > self.failovers:
            return None
        others = [e for e in self.live() if e not in tried]
        if not others:
            return None
        return min(others, key=lambda e: e.inflight)


async def _all_or_first_failure(coros: list) -> list:
    """Run concurrently; the first failure cancels the rest (one failed group fails the request,
    so the others are not worth waiting for) and is raised as itself, not as a group."""
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coro) for coro in coros]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


def _truthy_option(body: dict[str, Any], name: str) -> bool:
    kwargs = body.get("mm_processor_kwargs")
    return isinstance(kwargs, dict) and bool(kwargs.get(name))
