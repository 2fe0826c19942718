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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from epd_proxy.calls.upstream import Payload, Upstream
from epd_proxy.errors import BackendUnreachable, ProxyError
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.lanes import Lane, Lanes
from epd_proxy.fleet.routing import RoutingPolicy
from epd_proxy.fleet.stalls import laggards, progressed_elsewhere
from epd_proxy.journey.coalesce import Coalescer, Resend, Work
from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.plan import EncoderGroup
from epd_proxy.journey.reuse import failed_holding_media
from epd_proxy.journey.subrequest import (
    FORWARDED_FIELDS,
    Dumps,
    Encoded,
    EncodeOptions,
    IdMint,
    Observed,
    Outgoing,
    Sender,
    coalesce_key,
    encoder_body,
)
from epd_proxy.journey.trace import Trace
from epd_proxy.ops.metrics import Metrics

log = logging.getLogger("epd_proxy.encode")


class EncodeStep:
    """A group that fails with a transport error, timeout or 5xx, or whose sub-request is far
    past its expected time (stalls.py), is sent again to another encoder: up to `failovers`
    times in all. One that still fails, or is overdue with no failover left, cancels the others
    and fails the attempt.

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
        options: EncodeOptions,
        lanes: Lanes | None = None,
        clock: Callable[[], float] = time.perf_counter,
        stalled: Callable[[Instance], None] = lambda encoder: None,
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self._place = getattr(policy, "place", None)
        self.live = live
        self.options = options
        self.lanes = lanes if lanes is not None else getattr(policy, "lanes", None) or Lanes()
        # A cap of one image per sub-request leaves nothing to share.
        self.coalesce = options.coalesce and options.max_batch_size != 1
        self.clock = clock
        # Tells health an encoder let a sub-request run far past its expected time.
        self.health_stalled = stalled
        self.ids = IdMint()
        self.sender = Sender(upstream, metrics, observed, options, clock)
        self.coalescer = Coalescer(self.sender, metrics, ids=self.ids, stalled=self._stalled, lanes=self.lanes)

    def place(
        self, items: Sequence[MediaItem], trace: Trace, priority: int = 0, avoid: Collection[Instance] = ()
    ) -> list[Instance]:
        """One live encoder per item; `priority` (the request's, vLLM's) places it in the queues;
        `avoid`ed encoders only when no other is live."""
        encoders = self.live()
        encoders = [e for e in encoders if e not in avoid] or encoders
        if not encoders:
            raise ProxyError(
                503, "the request has media but no encoder is live", stage="route", error_type="service_unavailable"
            )
        now = self.clock()
        for lane in laggards(self.lanes, [self.lanes.of(e) for e in encoders], now):
            # Cheap to be wrong about: no placements and its queue moves, nothing is cancelled
            # or counted against its health, and its next answer clears it.
            if lane.stalled(now):
                log.warning(
                    "encoder %s: nothing answered for %.1f s while another encoder answers or sits idle; no "
                    "new placements there until it answers",
                    lane.url,
                    lane.silent_s(now),
                )
            self.metrics.stalls.labels(lane.url).inc()
            lane.evict()
        if self.lanes.avoided(now):
            encoders = [e for e in encoders if not self.lanes.of(e).avoid(now)] or encoders
        if self._place is None:
            return self.policy.choose(encoders, [item.uuid for item in items])
        fairness = self.lanes.fairness
        behind = None
        if fairness is not None and trace.tenant is not None and len(encoders) > 1:
            behind = fairness.behind(trace.tenant, priority)
        assignment, hits = self._place(encoders, items, self.options.max_batch_size, now, behind)
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
        if key is not None and trace.isolated:
            # An isolated tenant's media share a sub-request with no other request's, yet wait in
            # the queue like everyone's: sent at once, its flood would take the encoders.
            key += f"|{trace.tenant}|{trace.request_id}".encode()
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
        """Send one group (sharing a sub-request if its encoder is busy), attempt after attempt:
        each ends in its answer, a `Resend` (it goes again alone, maybe elsewhere) or a failure
        that fails over to another encoder while there is one to try."""
        group_items = [items[i] for i in group.indices]
        # Only the first send to an encoder may wait to share; a resend goes out at once, alone.
        shareable = key is not None and all(item.is_image for item in group_items)
        route = Route(group.encoder, group_items, shareable)
        verdict = None
        while True:
            try:
                result = await self._attempt(route, body, consumer_zmq, trace, dumps, key)
            except ProxyError as exc:
                if verdict is not None:
                    verdict.heard(exc)
                    verdict = None
                if not self._fail_over(route, exc, trace):
                    raise
                continue
            except BaseException as exc:
                if verdict is not None:
                    verdict.heard(exc)
                raise
            if verdict is not None:
                verdict.heard(result if isinstance(result, Resend) else None)
            if isinstance(result, Encoded):
                return result
            verdict = result.verdict
            self._resend(route, result, trace)

    async def _attempt(
        self,
        route: Route,
        body: dict[str, Any],
        consumer_zmq: str | None,
        trace: Trace,
        dumps: Dumps,
        key: bytes | None,
    ) -> Encoded | Resend:
        """One send of the group to `route.encoder`: shared if it may share and the encoder is busy."""
        encoder, group_items = route.encoder, route.items
        route.tried.append(encoder)
        if route.share and key is not None:  # shareable: a key, and images only
            route.share = False
            lane = self.lanes.of(encoder)
            if lane.busy(self.lanes.slots(self.clock())):
                future = asyncio.get_running_loop().create_future()
                work = Work(
                    key, group_items, body, consumer_zmq, trace, dumps, future, request_priority(body), route.moves
                )
                return await self.coalescer.wait_to_share(lane, work)
        return await self._send_alone(encoder, group_items, body, consumer_zmq, trace, dumps, route.moves)

    def _resend(self, route: Route, alone: Resend, trace: Trace) -> None:
        """Where the group goes again on its own after `alone`."""
        encoder, cause = route.encoder, alone.cause
        if alone.overdue is not None or failed_holding_media(cause):
            _failed_holding_media(trace, encoder)
        route.tried.pop()
        if alone.overdue is not None:
            # Cancelled far past its expected time: another encoder, as a failover.
            route.tried.append(encoder)
            if len(route.tried) > self.options.failovers:
                raise _overdue_error(encoder, len(route.items), alone.overdue, route.moves)
            route.moves += 1
            fallback = self._elsewhere(encoder)
            why = f"no answer within {alone.overdue:.1f} s, far past its expected time"
            self._note_failover(trace, encoder, why, len(route.items), fallback)
            route.go(fallback)
        elif alone.moved or encoder not in self.live():
            # Its encoder left, was ejected or stalls: elsewhere, sharing there if busy.
            route.go(self._elsewhere(encoder))
        elif isinstance(cause, BackendUnreachable):
            # Timed out or unreachable with others' items in it: another encoder if there is
            # one, else alone on the same one (its own items may well fit).
            route.tried.append(encoder)
            target = self._failover_target(route.tried)
            if target is not None:
                self._note_failover(trace, encoder, cause.message, len(route.items), target)
                route.encoder = target
            else:
                route.tried.pop()
        # Anything the encoder answered may be another request's fault, and a group that waited
        # too long is not at fault either: alone on the same encoder, without spending a failover.

    def _fail_over(self, route: Route, exc: ProxyError, trace: Trace) -> bool:
        """After a failed send: whether it goes to another encoder (a transport error, timeout
        or 5xx, with a failover left) or fails as `exc`."""
        if failed_holding_media(exc):
            _failed_holding_media(trace, route.encoder)
        worth_retrying = isinstance(exc, BackendUnreachable) or exc.status >= 500
        fallback = self._failover_target(route.tried) if worth_retrying else None
        if fallback is None:
            return False
        self._note_failover(trace, route.encoder, exc.message, len(route.items), fallback)
        route.encoder = fallback
        return True

    def _elsewhere(self, encoder: Instance) -> Instance:
        """Where a group goes whose encoder left, was ejected or stalls: the least busy other
        encoder in rotation that is not suspect; failing that, any other, or itself if still live."""
        live = self.live()
        others = [e for e in live if e is not encoder]
        if not others:
            if encoder in live:
                return encoder
            raise ProxyError(
                503, "the request's encoder left and no other is live", stage="route", error_type="service_unavailable"
            )
        now = self.clock()
        trusted = [e for e in others if not self.lanes.of(e).avoid(now)] or others
        return min(trusted, key=lambda e: self.lanes.of(e).outstanding())

    def _stalled(self, lane: Lane, encoder: Instance, items: int) -> bool:
        """A sub-request there is far overdue: the encoder is suspect until it answers again and
        its queued groups move. Health counts it as a gateway failure only if another encoder
        turned round later work meanwhile (an item slow everywhere is no encoder's fault).
        Whether another encoder is live to move the stuck work to."""
        live = self.live()
        if lane.stalled(self.clock()):
            log.warning(
                "encoder %s: a sub-request of %d item(s) is far past its expected time; no new placements "
                "there until it answers",
                encoder.url,
                items,
            )
        self.metrics.stalls.labels(encoder.url).inc()
        if progressed_elsewhere([self.lanes.of(e) for e in live], lane):
            self.health_stalled(encoder)
        lane.evict()
        return any(e is not encoder for e in live)

    def _note_failover(self, trace: Trace, encoder: Instance, why: str, count: int, fallback: Instance) -> None:
        log.warning(
            "request %s: encoder %s failed (%s); retrying its %d item(s) on %s",
            trace.request_id,
            encoder.url,
            why,
            count,
            fallback.url,
        )
        trace.encoder_failovers += 1
        self.metrics.failovers.labels(encoder.url).inc()

    async def _send_alone(
        self,
        encoder: Instance,
        group_items: list[MediaItem],
        body: dict[str, Any],
        consumer_zmq: str | None,
        trace: Trace,
        dumps: Dumps,
        moves: int,
    ) -> Encoded | Resend:
        """One group as its own sub-request, from the request's own task (so its cancellation
        cancels the sub-request); a `Resend` if it was far overdue and moves elsewhere."""
        transfer_ids = [self.ids.transfer_id() for _ in group_items]
        lane = self.lanes.of(encoder)
        cost = sum(item.cost for item in group_items)
        sent = self.clock()
        lane.started(cost, sent)
        self.lanes.charge(lane, trace.tenant, cost)
        request_id = self.ids.child_request_id(trace.request_id, group_items[0].index)
        out = Outgoing(encoder, lane, request_id, trace, len(group_items), cost, sent, moves)
        task = asyncio.current_task()
        assert task is not None  # this code runs in one
        moving: list[float] = []

        def payload() -> Payload:
            body_out = encoder_body(
                body,
                group_items,
                send_uuid=self.options.send_uuid,
                transfer_ids=transfer_ids,
                consumer_zmq=consumer_zmq,
            )
            return dumps(body_out)

        def overdue(after: float) -> None:
            elsewhere = self._stalled(lane, encoder, len(group_items))
            # Sent again elsewhere only where that is safe: the same uuid gives the same
            # embedding, but a Mooncake push may still arrive under these transfer ids.
            if elsewhere and consumer_zmq is None:
                moving.append(after)
                task.cancel()

        try:
            reply = await self.sender.send(
                out,
                payload,
                lambda: trace.stage("encode.subrequest", encoder, **{"epd.items": len(group_items)}),
                overdue,
                lambda reply: reply,
            )
        except asyncio.CancelledError:
            if moving and task.uncancel() == 0:
                return Resend(overdue=moving[0])
            raise
        finally:
            if lane.has_waiting():
                self.coalescer.drain(lane, encoder)
        trace.subrequest_share += 1.0
        return Encoded(encoder, reply.ec_transfer_params, transfer_ids)

    def _failover_target(self, tried: list[Instance]) -> Instance | None:
        if len(tried) > self.options.failovers:
            return None
        others = [e for e in self.live() if e not in tried]
        if not others:
            return None
        return min(others, key=lambda e: e.inflight)


@dataclass(eq=False, slots=True)
class Route:
    """Where one group's attempts stand: the encoder it goes to next, those it was tried on (each
    failover spends one), its moves off overdue encoders (each doubles its overdue time) and
    whether the next send may wait to share."""

    encoder: Instance
    items: list[MediaItem]
    shareable: bool
    tried: list[Instance] = field(default_factory=list)
    moves: int = 0
    share: bool = False

    def __post_init__(self) -> None:
        self.share = self.shareable

    def go(self, encoder: Instance) -> None:
        """To another encoder, where it may wait to share again."""
        self.encoder = encoder
        self.share = self.shareable


def _overdue_error(encoder: Instance, items: int, after: float, moves: int) -> BackendUnreachable:
    return BackendUnreachable(
        f"encoder sub-request of {items} item(s) unanswered after {after:.1f} s, far past its expected time, "
        f"with no failover left ({moves} move(s) to other encoders; --encoder-failovers)",
        stage="encode",
        backend=encoder.url,
        timed_out=True,
    )


def _failed_holding_media(trace: Trace, encoder: Instance) -> None:
    """Remembered for the rest of the request: its media are not handed to a consumer."""
    if trace.media_failed_on is None:
        trace.media_failed_on = encoder.url


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


def request_priority(body: dict[str, Any]) -> int:
    """vLLM's `priority` (an int, 0 by default); anything else vLLM refuses, and it waits as 0."""
    value = body.get("priority", 0)
    return value if type(value) is int else 0
