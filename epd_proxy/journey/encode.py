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

from epd_proxy.calls.upstream import Payload, Timeouts, Upstream
from epd_proxy.errors import BackendUnreachable, ProxyError
from epd_proxy.fleet.backends import CHAT_PATH, Instance
from epd_proxy.fleet.routing import RoutingPolicy
from epd_proxy.fleet.scheduler import BUSY_INFLIGHT, Lane, Lanes, coalesce_key
from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.match import Matches, match_group, split_params
from epd_proxy.journey.plan import EncoderGroup, plan_groups
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


class SendAlone(Exception):
    """A group that waited to share a sub-request goes out on its own instead: it waited longer
    than its encoder's backlog explains (`cause` None), or the shared sub-request it was in failed
    (`cause`), so that one request's bad image never fails another's."""

    def __init__(self, cause: ProxyError | None = None) -> None:
        super().__init__(cause.message if cause is not None else "waited too long to share")
        self.cause = cause


@dataclass(eq=False, slots=True)
class Work:
    """One request's image group for one encoder, waiting (or sent) to share a sub-request."""

    key: bytes
    items: list[MediaItem]
    body: dict[str, Any]
    consumer_zmq: str | None
    trace: Trace
    dumps: Dumps
    future: asyncio.Future
    batch: Batch | None = None
    timer: asyncio.TimerHandle | None = None

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass(eq=False, slots=True)
class Batch:
    """The groups one queued sub-request carries; `live` of them still have a request waiting."""

    works: list[Work]
    task: asyncio.Task | None
    live: int
    sending: bool = False
    done: bool = False


class EncodeStep:
    """Every group of one attempt to its encoder at once. A group that fails with a transport
    error, timeout or 5xx is sent again to the least busy other encoder (up to `failovers` times);
    one that still fails cancels the others and fails the attempt.

    Where the items go is the policy's (scheduler.ExpectedFinish by default). With `coalesce`, an
    image group bound for a busy encoder (scheduler.BUSY_INFLIGHT of this proxy's sub-requests in
    flight there) waits in that encoder's lane and goes out with other requests' groups of the
    same key when one of them finishes; with spare capacity nothing waits."""

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
        lanes: Lanes | None = None,
        coalesce: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.policy = policy
        self._place = getattr(policy, "place", None)
        self.live = live
        self.observed = observed
        self.timeouts = timeouts
        self.max_batch_size = max_batch_size
        self.send_uuid = send_uuid
        self.failovers = failovers
        self.lanes = lanes if lanes is not None else getattr(policy, "lanes", None) or Lanes()
        # A cap of one image per sub-request leaves nothing to share.
        self.coalesce = coalesce and max_batch_size != 1
        self.clock = clock
        self.ids = IdMint()
        # Tasks sending queued sub-requests; held so they are not collected mid-flight.
        self._senders: set[asyncio.Task] = set()

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
        if self._place is not None:
            assignment, hits = self._place(encoders, items, self.max_batch_size, self.clock())
            if hits:
                trace.affinity_hits += hits
                self.metrics.affinity_hits.inc(hits)
        else:
            assignment = self.policy.choose(encoders, [item.uuid for item in items])
        groups = plan_groups(items, assignment, self.max_batch_size)
        trace.encoder_requests += len(groups)
        key = coalesce_key(body, FORWARDED_FIELDS, consumer_zmq) if self.coalesce else None
        results = await _all_or_first_failure(
            [self._send_group(body, items, group, consumer_zmq, trace, dumps, key) for group in groups]
        )
        audio_in_video = _truthy_option(body, "use_audio_in_video")
        for group, encoded in zip(groups, results):
            match_group(
                [items[i] for i in group.indices],
                encoded.transfer_ids,
                encoded.ec_transfer_params,
                matches,
                audio_in_video=audio_in_video,
                push_mode=consumer_zmq is not None,
                backend=encoded.encoder.url,
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
        key: bytes | None,
    ) -> Encoded:
        """Send one group (sharing a sub-request if its encoder is busy); on a transport error,
        timeout or 5xx, fail over to another encoder."""
        group_items = [items[i] for i in group.indices]
        encoder = group.encoder
        tried: list[Instance] = []
        # Only the first send may wait to share; a resend goes out at once, on its own.
        share = key is not None and all(item.is_image for item in group_items)
        while True:
            tried.append(encoder)
            try:
                if share:
                    share = False
                    lane = self.lanes.of(encoder)
                    if lane.inflight >= BUSY_INFLIGHT:
                        future = asyncio.get_running_loop().create_future()
                        work = Work(key, group_items, body, consumer_zmq, trace, dumps, future)
                        return await self._wait_to_share(lane, work)
                return await self._send_alone(encoder, group_items, group.indices[0], body, consumer_zmq, trace, dumps)
            except SendAlone as alone:
                exc = alone.cause
                if isinstance(exc, BackendUnreachable):
                    fallback = self._failover_target(tried)
                    if fallback is None:
                        raise exc from None
                    self._note_failover(trace, encoder, exc, len(group_items), fallback)
                    encoder = fallback
                # Anything the encoder answered may be another request's fault, and a group that
                # waited too long is not at fault either: alone on the same encoder, without
                # spending a failover on it.
                else:
                    tried.pop()
            except ProxyError as exc:
                worth_retrying = isinstance(exc, BackendUnreachable) or exc.status >= 500
                fallback = self._failover_target(tried) if worth_retrying else None
                if fallback is None:
                    raise
                self._note_failover(trace, encoder, exc, len(group_items), fallback)
                encoder = fallback

    def _note_failover(self, trace: Trace, encoder: Instance, exc: ProxyError, count: int, fallback: Instance) -> None:
        log.warning(
            "request %s: encoder %s failed (%s); retrying its %d item(s) on %s",
            trace.request_id,
            encoder.url,
            exc.message,
            count,
            fallback.url,
        )
        trace.encoder_failovers += 1
        self.metrics.failovers.labels(encoder.url).inc()

    async def _send_alone(
        self,
        encoder: Instance,
        group_items: list[MediaItem],
        first_index: int,
        body: dict[str, Any],
        consumer_zmq: str | None,
        trace: Trace,
        dumps: Dumps,
    ) -> Encoded:
        """One group as its own sub-request, from the request's own task (so its cancellation
        cancels the sub-request)."""
        transfer_ids = [self.ids.transfer_id() for _ in group_items]
        sub_body = encoder_body(
            body,
            group_items,
            send_uuid=self.send_uuid,
            transfer_ids=transfer_ids,
            consumer_zmq=consumer_zmq,
        )
        payload = dumps(sub_body)
        self.metrics.encoder_subrequests.labels(encoder.url).inc()
        self.metrics.items_per_subrequest.observe(len(group_items))
        lane = self.lanes.of(encoder)
        sent = self.clock()
        lane.started(len(group_items), sent)
        done = None
        try:
            reply = await self.observed(
                encoder,
                post_encoder(
                    self.upstream,
                    encoder,
                    payload,
                    self.ids.child_request_id(trace.request_id, first_index),
                    self.timeouts,
                ),
                trace,
            )
            done = self.clock()
        finally:
            lane.finished(len(group_items), sent, done)
            if lane.waiting:
                self._drain(lane, encoder)
        trace.subrequest_share += 1.0
        return Encoded(encoder, reply.ec_transfer_params, transfer_ids)

    # -- coalescing --------------------------------------------------------------------------------
    async def _wait_to_share(self, lane: Lane, work: Work) -> Encoded:
        # A healthy encoder works off its backlog in about the estimated time; one that stalls
        # (its sub-requests running into the timeout) must not hold queued groups behind it.
        patience = lane.patience(work.size)
        if self.timeouts.total is not None:
            patience = min(patience, self.timeouts.total / 4)
        lane.queued(work)
        work.timer = asyncio.get_running_loop().call_later(patience, self._impatient, lane, work)
        try:
            return await work.future
        except asyncio.CancelledError:
            # The request went away (its client, or another of its groups failed). Waiting, it
            # simply leaves; in flight, the sub-request goes on for the others in it, unless
            # none is left.
            work.timer.cancel()
            if not lane.unqueued(work):
                batch = work.batch
                if batch is not None and not batch.done:
                    batch.live -= 1
                    if batch.live == 0 and batch.sending and batch.task is not None:
                        batch.task.cancel()
            raise

    def _drain(self, lane: Lane, encoder: Instance) -> None:
        """Send what waits in `lane` while the encoder has room, one sending task per slot."""
        while lane.waiting and lane.inflight < BUSY_INFLIGHT:
            batch = self._batch(lane.next_batch(self.max_batch_size, self.clock()))
            task = asyncio.get_running_loop().create_task(self._send_queued(lane, encoder, batch))
            batch.task = task
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)

    @staticmethod
    def _batch(works: list[Work]) -> Batch:
        batch = Batch(works, None, len(works))
        for work in works:
            work.batch = batch
            if work.timer is not None:
                work.timer.cancel()
        return batch

    @staticmethod
    def _impatient(lane: Lane, work: Work) -> None:
        if lane.unqueued(work):
            lane.impatient += 1
            _settle(work, SendAlone())

    async def _send_queued(self, lane: Lane, encoder: Instance, batch: Batch) -> None:
        """Send queued sub-requests on one of the lane's slots until nothing waits."""
        try:
            while True:
                await self._send_batch(lane, encoder, batch)
                if not lane.waiting or lane.inflight >= BUSY_INFLIGHT:
                    return
                batch = self._batch(lane.next_batch(self.max_batch_size, self.clock()))
                batch.task = asyncio.current_task()
        finally:
            if lane.waiting:
                self._drain(lane, encoder)

    async def _send_batch(self, lane: Lane, encoder: Instance, batch: Batch) -> None:
        """One queued sub-request; every group in it learns its own share of the answer, or how
        it failed."""
        works = batch.works
        items = [item for work in works for item in work.items]
        if batch.live == 0:
            # Every request in it went away before it left: nothing to send.
            lane.finished(len(items), 0.0, None)
            batch.done = True
            return
        batch.sending = True
        shared = len(works) > 1
        transfer_ids = [self.ids.transfer_id() for _ in items]
        head = works[0]
        request_id = self.ids.child_request_id(head.trace.request_id, head.items[0].index)
        sent = self.clock()
        done = None
        try:
            try:
                if shared:
                    request_id += f"+{len(works) - 1}"
                    payload = coalesced_payload(works, transfer_ids, self.send_uuid)
                    # Health dedups a 5xx per request; this sub-request is its own.
                    trace = Trace(request_id)
                else:
                    payload = head.dumps(
                        encoder_body(
                            head.body,
                            head.items,
                            send_uuid=self.send_uuid,
                            transfer_ids=transfer_ids,
                            consumer_zmq=head.consumer_zmq,
                        )
                    )
                    trace = head.trace
                self.metrics.encoder_subrequests.labels(encoder.url).inc()
                self.metrics.items_per_subrequest.observe(len(items))
                reply = await self.observed(
                    encoder, post_encoder(self.upstream, encoder, payload, request_id, self.timeouts), trace
                )
                if shared:
                    self.metrics.coalesced.labels(encoder.url).inc()
                    shares = split_params(reply.ec_transfer_params, [work.size for work in works], encoder.url)
                else:
                    shares = [reply.ec_transfer_params]
                done = self.clock()
            except ProxyError as exc:
                if shared:
                    self._shared_failed(lane, encoder, works, exc)
                else:
                    _settle(head, exc)
                return
            except BaseException as exc:
                # Cancelled (every request in it went away, or the proxy stops) or a fault here:
                # no request may wait for an answer that will never come.
                cancelled = isinstance(exc, asyncio.CancelledError)
                for work in works:
                    if not work.future.done():
                        if cancelled:
                            work.future.cancel()
                        else:
                            work.future.set_exception(exc)
                if cancelled:
                    raise
                return
        finally:
            lane.finished(len(items), sent, done)
            batch.done = True
        if shared:
            lane.shared_ok(len(items))
        offset = 0
        for work, params in zip(works, shares):
            ids = transfer_ids[offset : offset + work.size]
            offset += work.size
            if work.future.done():
                continue  # its request went away
            work.trace.subrequest_share += 1.0 / len(works)
            if shared:
                work.trace.coalesced += 1
            work.future.set_result(Encoded(encoder, params, ids))

    def _shared_failed(self, lane: Lane, encoder: Instance, works: list[Work], exc: ProxyError) -> None:
        log.info(
            "coalesced encoder sub-request of %d requests to %s failed (%s); resending each request's items alone",
            len(works),
            encoder.url,
            exc.message[:200],
        )
        self.metrics.split_retries.labels(encoder.url).inc()
        if exc.stage == "match":
            lane.positions = False  # it does not say which entry is whose: share no more
        elif exc.answered is not None and 400 <= exc.answered < 500:
            lane.refused_shared()
        for work in works:
            if exc.answered is not None and exc.answered >= 500:
                # Health counted this 5xx once already; the lone resend must not count it again.
                work.trace.charged_5xx.add(encoder.url)
            _settle(work, SendAlone(exc))

    def _failover_target(self, tried: list[Instance]) -> Instance | None:
        if len(tried) > self.failovers:
            return None
        others = [e for e in self.live() if e not in tried]
        if not others:
            return None
        return min(others, key=lambda e: e.inflight)


def _settle(work: Work, exc: BaseException) -> None:
    if not work.future.done():
        work.future.set_exception(exc)


def coalesced_payload(works: Sequence[Work], transfer_ids: Sequence[str], send_uuid: bool) -> list:
    """One encoder body for several requests' groups of the same key: their media in order, each
    written by its own request (whose spliced buffer its parts point into), around the fields
    they share. `messages` comes first so the parts go at a fixed place."""
    head = works[0]
    shared = encoder_body(head.body, (), send_uuid=send_uuid, transfer_ids=transfer_ids, consumer_zmq=head.consumer_zmq)
    del shared["messages"]
    pieces: list = [b'{"messages":[{"role":"user","content":[']
    for n, work in enumerate(works):
        written = work.dumps(encoder_parts(work.items, send_uuid))
        if not isinstance(written, list):
            written = [written]
        first, last = bytes(written[0]), bytes(written[-1])
        if n:
            pieces.append(b",")
        if len(written) == 1:
            pieces.append(first[1:-1])
            continue
        pieces.append(first[1:])
        pieces.extend(written[1:-1])
        pieces.append(last[:-1])
    pieces.append(b"]}],")
    pieces.append(orjson.dumps(shared)[1:])
    return pieces


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
