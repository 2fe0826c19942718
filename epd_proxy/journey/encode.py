"""Step 3: every group of one attempt to its encoder at once, with failover.

The pipeline places the items (`EncodeStep.place`, then plan.py groups them), this step sends
the groups, and the pipeline maps the answers back to items (match.py); the pipeline also
decides whether there is another attempt. Groups for a busy encoder may wait to share a
sub-request with other requests' groups (coalesce.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from epd_proxy.calls.upstream import Timeouts, Upstream
from epd_proxy.errors import BackendUnreachable, ProxyError
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.lanes import BUSY_INFLIGHT, Lanes, coalesce_key
from epd_proxy.fleet.routing import RoutingPolicy
from epd_proxy.journey.coalesce import Coalescer, SendAlone, Work
from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.plan import EncoderGroup
from epd_proxy.journey.subrequest import (
    FORWARDED_FIELDS,
    Dumps,
    Encoded,
    IdMint,
    Observed,
    encoder_body,
    post_encoder,
)
from epd_proxy.journey.trace import Trace
from epd_proxy.ops.metrics import Metrics

log = logging.getLogger("epd_proxy.encode")


class EncodeStep:
    """A group that fails with a transport error, timeout or 5xx is sent again to the least busy
    other encoder (up to `failovers` times); one that still fails cancels the others and fails
    the attempt.

    Where the items go is the policy's (scheduler.ExpectedFinish by default). With `coalesce`, an
    image group bound for a busy encoder (lanes.BUSY_INFLIGHT of this proxy's sub-requests in
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
        self.coalescer = Coalescer(
            upstream,
            metrics,
            observed,
            timeouts=timeouts,
            max_batch_size=max_batch_size,
            send_uuid=send_uuid,
            ids=self.ids,
            clock=clock,
        )

    def place(self, items: Sequence[MediaItem], trace: Trace) -> list[Instance]:
        """One live encoder per item."""
        encoders = self.live()
        if not encoders:
            raise ProxyError(
                503, "the request has media but no encoder is live", stage="route", error_type="service_unavailable"
            )
        if self._place is None:
            return self.policy.choose(encoders, [item.uuid for item in items])
        assignment, hits = self._place(encoders, items, self.max_batch_size, self.clock())
        if hits:
            trace.affinity_hits += hits
            self.metrics.affinity_hits.inc(hits)
        return assignment

    async def run(
        self,
        body: dict[str, Any],
        items: Sequence[MediaItem],
        groups: Sequence[EncoderGroup[Instance]],
        consumer_zmq: str | None,
        trace: Trace,
        dumps: Dumps = orjson.dumps,
    ) -> list[Encoded]:
        """Each group's answer, in the order of `groups`."""
        trace.encoder_requests += len(groups)
        key = coalesce_key(body, FORWARDED_FIELDS, consumer_zmq) if self.coalesce else None
        return await _all_or_first_failure(
            [self._send_group(body, items, group, consumer_zmq, trace, dumps, key) for group in groups]
        )

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
                        return await self.coalescer.wait_to_share(lane, work)
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
                self.coalescer.drain(lane, encoder)
        trace.subrequest_share += 1.0
        return Encoded(encoder, reply.ec_transfer_params, transfer_ids)

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
