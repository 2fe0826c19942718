"""Cross-request coalescing: image groups waiting for a busy encoder, sent together.

A group bound for an encoder with lanes.BUSY_INFLIGHT of this proxy's sub-requests in flight
waits in that encoder's lane; when one of them finishes, the oldest waiting group goes out with
later groups of the same key (sharing.take_batch) as one shared sub-request, whose answer is
split back into each group's share (match.split_params) as if each had been sent alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import orjson

from epd_proxy.calls.upstream import Payload
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.fairness import pay_riders
from epd_proxy.fleet.lanes import Lane, Lanes
from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.match import split_params
from epd_proxy.journey.subrequest import (
    Dumps,
    Encoded,
    EncoderReply,
    IdMint,
    Outgoing,
    Sender,
    encoder_body,
    encoder_parts,
)
from epd_proxy.journey.trace import Trace
from epd_proxy.ops import tracing
from epd_proxy.ops.metrics import Metrics

log = logging.getLogger("epd_proxy.encode")


@dataclass(frozen=True, slots=True)
class Resend:
    """What a group that waited to share a sub-request, or was sent alone and far overdue, is
    told instead of its answer: send it again on its own. It waited longer than its encoder's
    backlog explains (`cause` None), or the shared sub-request it was in failed (`cause`), so
    that one request's bad image never fails another's. `moved`: it waited for an encoder that
    left, was ejected or stalls, so it goes to another. `overdue`: the sub-request it was in was
    cancelled that many seconds after it was sent, far past its expected time (stalls.py): it
    goes to another encoder as a failover. `verdict` hears how it fared alone."""

    cause: ProxyError | None = None
    verdict: Verdict | None = None
    moved: bool = False
    overdue: float | None = None


class Verdict:
    """Whose fault a refused (4xx) or unsplittable shared sub-request was, found by the split
    retry: each member, sent alone, reports how it fared. One refused alone is the culprit and
    its request is charged; if every member went through, the share itself was at fault (too
    long a prompt, an encoder that reports no positions) and the lane backs off. A member that
    went away says nothing, and without a full hearing nothing is charged."""

    __slots__ = ("lane", "items", "pending", "guilty", "unheard", "charge")

    def __init__(self, lane: Lane, items: int, members: int, charge: Callable[[Lane, int, str], None]) -> None:
        self.lane = lane
        self.items = items
        self.pending = members
        self.guilty = self.unheard = 0
        self.charge = charge

    def heard(self, failure: BaseException | Resend | None) -> None:
        """How one member fared alone: answered (None), failed, or told to go again (unheard)."""
        if failure is None:
            pass
        elif isinstance(failure, ProxyError) and failure.answered is not None and 400 <= failure.answered < 500:
            self.guilty += 1
        else:
            self.unheard += 1
        self.pending -= 1
        if self.pending == 0:
            if self.guilty:
                self.charge(self.lane, self.items, "request")
            elif not self.unheard:
                self.charge(self.lane, self.items, "encoder")


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
    priority: int = 0
    # Times its group was moved off an encoder where it was far overdue.
    moves: int = 0
    batch: Batch | None = None
    timer: asyncio.TimerHandle | None = None
    # Its request's span of the wait (tracing on), which the sub-request that carries it links to.
    waiting: Any = None
    queued_at: float = 0.0

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def cost(self) -> float:
        return sum(item.cost for item in self.items)

    @property
    def tenant(self) -> str | None:
        return self.trace.tenant

    @property
    def owed(self) -> dict[str, float]:
        return self.trace.riders

    @property
    def tenants(self) -> tuple[str | None, ...]:
        """Whose turn in the queue it is: its request's tenant and those waiting for its encodes."""
        return (self.trace.tenant, *self.trace.riders) if self.trace.riders else (self.trace.tenant,)

    def move(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        _settle(self, Resend(moved=True))


@dataclass(eq=False, slots=True)
class Batch:
    """The groups one queued sub-request carries; `live` of them still have a request waiting."""

    works: list[Work]
    task: asyncio.Task | None
    live: int
    sending: bool = False
    done: bool = False
    # Its members were moved off a stalled encoder: the call goes on for no one.
    abandoned: bool = False


@dataclass(eq=False)
class Coalescer:
    """The waiting groups of every lane and the tasks that send them."""

    sender: Sender
    metrics: Metrics
    _: KW_ONLY
    ids: IdMint
    stalled: Callable[[Lane, Instance, int], bool]
    # Every lane, and with --tenants the ledger that orders their queues and is charged each send.
    lanes: Lanes
    # Tasks sending queued sub-requests; held so they are not collected mid-flight.
    _senders: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)

    async def wait_to_share(self, lane: Lane, work: Work) -> Encoded | Resend:
        # A healthy encoder works off its backlog in about the estimated time; one that stalls
        # (its sub-requests running into the timeout) must not hold queued groups behind it.
        work.queued_at = self.sender.clock()
        patience = lane.patience(work.cost, work.queued_at)
        if self.sender.options.timeouts.total is not None:
            patience = min(patience, self.sender.options.timeouts.total / 4)
        lane.queued(work)
        work.timer = asyncio.get_running_loop().call_later(patience, self._impatient, lane, work)
        try:
            with work.trace.stage("encode.wait_to_share", **{"epd.items": work.size}) as waiting:
                work.waiting = waiting.span
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

    def drain(self, lane: Lane, encoder: Instance) -> None:
        """Send what waits in `lane` while the encoder has room, one sending task per slot."""
        while lane.can_send_queued(self.lanes.slots(self.sender.clock())):
            batch = self._next_batch(lane)
            task = asyncio.get_running_loop().create_task(self._send_queued(lane, encoder, batch))
            batch.task = task
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)

    def _next_batch(self, lane: Lane) -> Batch:
        options = self.sender.options
        fairness = self.lanes.fairness
        now = self.sender.clock()
        cap, rank = self.lanes.group_cap(options.max_batch_size, now), None if fairness is None else fairness.rank
        works = lane.next_batch(cap, now, options.timeouts.total, rank)
        if fairness is not None:
            # Charged as it is chosen: the next choice, perhaps for another free slot before this
            # one is sent, must already count it.
            for work in works:
                self.lanes.charge(lane, work.tenant, work.cost, len(works))
                self._charge_riders(lane, work, len(works))
        return self._batch(works)

    def _charge_riders(self, lane: Lane, work: Work, members: int) -> None:
        """Each tenant `work` stood for pays for the items it waits for, once; paid up, it lifts no more."""
        for tenant, paid in pay_riders(work.trace.riders, work.cost):
            self.lanes.charge(lane, tenant, paid, members)

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
        if lane.gave_up(work):
            _settle(work, Resend())

    async def _send_queued(self, lane: Lane, encoder: Instance, batch: Batch) -> None:
        """Send queued sub-requests on one of the lane's slots until nothing waits."""
        try:
            while True:
                await self._send_batch(lane, encoder, batch)
                if not lane.can_send_queued(self.lanes.slots(self.sender.clock())):
                    return
                batch = self._next_batch(lane)
                batch.task = asyncio.current_task()
        finally:
            if lane.has_waiting():
                self.drain(lane, encoder)

    async def _send_batch(self, lane: Lane, encoder: Instance, batch: Batch) -> None:
        """One queued sub-request; every group in it learns its own share of the answer, or how
        it failed."""
        works = batch.works
        if batch.live == 0:
            # Every request in it went away before it left: nothing to send.
            lane.finished(sum(work.cost for work in works), 0.0, None)
            batch.done = True
            return
        batch.sending = True
        transfer_ids = [self.ids.transfer_id() for work in works for _ in work.items]
        out = self._outgoing(lane, encoder, works)
        shared = len(works) > 1
        movable = works[0].consumer_zmq is None
        try:
            shares = await self.sender.send(
                out,
                lambda: self._payload(works, transfer_ids),
                lambda: tracing.queued_subrequest([work.waiting for work in works], encoder.url, out.items),
                lambda after: self._overdue(lane, encoder, batch, after, movable),
                lambda reply: self._split(reply, works, encoder),
            )
        except ProxyError as exc:
            if shared:
                self._shared_failed(lane, encoder, works, exc)
            else:
                _settle(works[0], exc)
            return
        except BaseException as exc:
            self._never_answered(batch, exc)
            return
        finally:
            if shared:
                lane.shared_closed(out.request_id)
            batch.done = True
        if shared:
            lane.shared_ok(out.items)
        _deliver(works, shares, transfer_ids, encoder)

    def _outgoing(self, lane: Lane, encoder: Instance, works: list[Work]) -> Outgoing:
        """The sub-request that carries `works`, under an id of its own when they are several."""
        items = sum(work.size for work in works)
        head = works[0]
        sent = self.sender.clock()
        for work in works:
            # The queue's part of the wait ends here: from now on the request waits for the
            # encoder's own work, which its trace counts as the encoders' time.
            waited = sent - work.queued_at
            self.metrics.share_wait.observe(waited)
            work.trace.share_wait_s = max(work.trace.share_wait_s, waited)
        if len(works) == 1:
            request_id = self.ids.child_request_id(head.trace.request_id, head.items[0].index)
            trace = head.trace
        else:
            # Its own id: no client's id labels the others' media, in the encoder's logs too.
            request_id = self.ids.shared_request_id()
            members = [work.trace.request_id for work in works]
            lane.shared_opened(request_id, members)
            for work in works:
                work.trace.shared.append(request_id)
            log.info(
                "shared encoder sub-request %s to %s: %d items of %d members %s",
                request_id,
                encoder.url,
                items,
                len(works),
                " ".join(members),
            )
            # Health dedups a 5xx per request; this sub-request is its own.
            trace = Trace(request_id)
        cost = sum(work.cost for work in works)
        return Outgoing(encoder, lane, request_id, trace, items, cost, sent, max(work.moves for work in works))

    def _payload(self, works: list[Work], transfer_ids: list[str]) -> Payload:
        if len(works) > 1:
            return coalesced_payload(works, transfer_ids, self.sender.options.send_uuid)
        head = works[0]
        body = encoder_body(
            head.body,
            head.items,
            send_uuid=self.sender.options.send_uuid,
            transfer_ids=transfer_ids,
            consumer_zmq=head.consumer_zmq,
        )
        return head.dumps(body)

    def _split(self, reply: EncoderReply, works: list[Work], encoder: Instance) -> list[dict[str, Any] | None]:
        if len(works) == 1:
            return [reply.ec_transfer_params]
        self.metrics.coalesced.labels(encoder.url).inc()
        return list(split_params(reply.ec_transfer_params, [work.size for work in works], encoder.url))

    @staticmethod
    def _never_answered(batch: Batch, exc: BaseException) -> None:
        """Cancelled (every request in it went away, or the proxy stops) or a fault here: no
        request may wait for an answer that will never come."""
        cancelled = isinstance(exc, asyncio.CancelledError)
        if cancelled and batch.abandoned:
            # Its members went elsewhere; the encoder learns it from the closed call.
            task = asyncio.current_task()
            assert task is not None  # a coroutine step runs in a task
            task.uncancel()
            return
        for work in batch.works:
            if not work.future.done():
                if cancelled:
                    work.future.cancel()
                else:
                    work.future.set_exception(exc)
        if cancelled:
            raise exc

    def _overdue(self, lane: Lane, encoder: Instance, batch: Batch, after: float, movable: bool) -> None:
        if batch.done:
            return
        elsewhere = self.stalled(lane, encoder, sum(work.size for work in batch.works))
        if not (elsewhere and movable):
            return  # a Mooncake push may still arrive under these transfer ids: never sent twice
        # Its members go elsewhere (the same uuids give the same embeddings), before their
        # own budgets run out; the stuck call ends for no one.
        batch.abandoned = True
        for work in batch.works:
            _settle(work, Resend(overdue=after))
        if batch.task is not None:
            batch.task.cancel()

    def _shared_failed(self, lane: Lane, encoder: Instance, works: list[Work], exc: ProxyError) -> None:
        log.info(
            "coalesced encoder sub-request of %d requests to %s failed (%s); resending each request's items alone",
            len(works),
            encoder.url,
            exc.message[:200],
        )
        self.metrics.split_retries.labels(encoder.url).inc()
        waiting = [work for work in works if not work.future.done()]
        verdict = None
        if waiting and (exc.stage == "match" or (exc.answered is not None and 400 <= exc.answered < 500)):
            verdict = Verdict(lane, sum(work.size for work in works), len(waiting), self._charge)
        for work in waiting:
            if exc.answered is not None and exc.answered >= 500:
                # Health counted this 5xx once already; the lone resend must not count it again.
                work.trace.charged_5xx.add(encoder.url)
            _settle(work, Resend(exc, verdict))

    def _charge(self, lane: Lane, items: int, charged: str) -> None:
        self.metrics.shared_refusals.labels(lane.url, charged).inc()
        if charged == "request":
            lane.charged_to_request()
        else:
            lane.share_failed(items, self.sender.clock())


def _settle(work: Work, outcome: Resend | BaseException) -> None:
    """Tell a group waiting for its share how it ends instead, unless it already knows."""
    if work.future.done():
        return
    if isinstance(outcome, Resend):
        work.future.set_result(outcome)
    else:
        work.future.set_exception(outcome)


def _deliver(
    works: list[Work], shares: list[dict[str, Any] | None], transfer_ids: list[str], encoder: Instance
) -> None:
    """Each group still waiting gets its share of the answer, under its own transfer ids."""
    offset = 0
    for work, params in zip(works, shares):
        ids = transfer_ids[offset : offset + work.size]
        offset += work.size
        if work.future.done():
            continue  # its request went away
        work.trace.subrequest_share += 1.0 / len(works)
        if len(works) > 1:
            work.trace.coalesced += 1
        work.future.set_result(Encoded(encoder, params, ids))


def coalesced_payload(works: Sequence[Work], transfer_ids: Sequence[str], send_uuid: bool) -> list:
    """One encoder body for several requests' groups of the same key: their media in order, each
    written by its own request (whose spliced buffer its parts point into), around the fields
    they share. `messages` comes first so the parts go at a fixed place."""
    head = works[0]
    shared = encoder_body(head.body, (), send_uuid=send_uuid, transfer_ids=transfer_ids, consumer_zmq=head.consumer_zmq)
    del shared["messages"]
    pieces: list = [b'{"messages":[{"role":"user","content":[']
    for n, work in enumerate(works):
        dumped = work.dumps(encoder_parts(work.items, send_uuid))
        written = dumped if isinstance(dumped, list) else [dumped]
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
