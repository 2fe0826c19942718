"""What the encoder scheduler knows of each encoder (its lane), and which queued groups share a
sub-request. Pure: no sockets and no clocks of its own; encode.py and coalesce.py feed it what
happened and send what it decides, and placement (scheduler.py) reads it.

A lane is four small parts, by what they hold: its speed estimate (speed.py), its outstanding
work and queue (`Outstanding`), its share governor (sharing.py) and whether it is suspect
(`Suspicion`); code outside fleet/ calls the lane's methods, never the parts' fields.

- **Speed** is learnt per encoder from what this proxy sees: the time each sub-request held the
  encoder (from when it was sent, or from when the previous one finished if that was later, to
  its answer) against its cost in image-equivalents (cost.py), smoothed over the last few dozen
  answers, with a sub-request's fixed cost at the measured third of an image. An encoder's
  backlog (`Lane.backlog_s`, the one definition placement, the consumer's last resort and the
  autoscaling gauge share) is then its outstanding sub-requests and load (in flight and queued
  here) at that speed, in seconds, less what it worked off since. When a sub-request is far overdue, and when an encoder's silence means it
  stalls, is stalls.py's judgement.
- **Coalescing** (`take_batch`): with two of this proxy's sub-requests in flight an encoder is
  busy (one computing, one being prepared: vLLM's API server processes media while its engine
  runs the previous request); image groups of different requests that arrive meanwhile wait and
  go together when one finishes (sharing.py). Only groups whose encoder bodies would be identical apart from
  their media share a sub-request (`subrequest.coalesce_key` in journey/).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.fairness import CONTENDED_GROUP_ITEMS, CONTENDED_INFLIGHT, Behind, Ledger
from epd_proxy.fleet.sharing import Queued, Sharing, take_batch
from epd_proxy.fleet.speed import PRIOR_FIXED_RATIO, Speed

# Sub-requests of ours in flight at which an encoder is busy (`Lanes.slots`): one is ready as one ends.
BUSY_INFLIGHT = 2
# A suspect encoder gets no placements for this long, then some again: how it comes back when
# nothing of ours is left there to answer.
SUSPECT_HOLD_S = 5.0
# Shortest wait to share a sub-request before a group goes alone (timer granularity).
PATIENCE_FLOOR_S = 0.02
# Encoders that left, remembered so a call still finishing there does not bring a lane back.
DEPARTED_ENTRIES = 4096


class Outstanding:
    """This proxy's work on one encoder: in flight, and queued here to share a sub-request."""

    __slots__ = ("inflight", "inflight_load", "subs", "load", "busy_since", "waiting")

    def __init__(self) -> None:
        # Sub-requests of this proxy in flight to it, and their cost in image-equivalents.
        self.inflight = 0
        self.inflight_load = 0.0
        # Outstanding work (in flight and queued): sub-requests and their cost.
        self.subs = 0
        self.load = 0.0
        # Since when the encoder has worked on our oldest sub-request in flight (serially).
        self.busy_since = 0.0
        self.waiting: deque[Any] = deque()

    def queued(self, work: Queued) -> None:
        """In vLLM's order (`Request.__lt__`): by priority, then arrival; equal priorities, the
        usual case, append."""
        waiting = self.waiting
        if not waiting or waiting[-1].priority <= work.priority:
            waiting.append(work)
        else:
            at = next(n for n, other in enumerate(waiting) if other.priority > work.priority)
            waiting.insert(at, work)
        self.subs += 1
        self.load += work.cost

    def pop_oldest(self) -> Queued:
        work = self.waiting.popleft()
        self.subs -= 1
        self.load -= work.cost
        return work

    def unqueued(self, work: Queued) -> bool:
        try:
            self.waiting.remove(work)
        except ValueError:
            return False
        self.subs -= 1
        self.load -= work.cost
        return True

    def sent(self, works: Sequence[Queued]) -> None:
        """Queued groups (already off the queue) left as one sub-request."""
        self.subs -= len(works) - 1
        self.inflight += 1
        self.inflight_load += sum(work.cost for work in works)

    def finished(self, cost: float) -> None:
        self.inflight -= 1
        self.inflight_load -= cost
        self.subs -= 1
        self.load -= cost


class Suspicion:
    """Whether an encoder is suspect: a sub-request of ours was far overdue there and nothing has
    answered since. It gets no placements until `until` (on the caller's clock)."""

    __slots__ = ("suspect", "until", "answered_sent")

    def __init__(self) -> None:
        self.suspect = False
        self.until = 0.0
        # When the latest-sent of its answered sub-requests was sent: how recent the work is
        # that it is known to turn round (stalls.progressed_elsewhere).
        self.answered_sent = float("-inf")

    def stalled(self, now: float) -> bool:
        first = not self.suspect
        self.suspect = True
        self.until = now + SUSPECT_HOLD_S
        return first

    def answered(self, sent: float) -> None:
        self.suspect = False
        self.until = 0.0
        if sent > self.answered_sent:
            self.answered_sent = sent


class LaneGauges(NamedTuple):
    """A lane's values in /metrics (ops/collectors.SCHEDULER_GAUGES order), None where not known yet."""

    item_s: float | None
    fixed_s: float | None
    queued_items: int
    share_limit: int
    suspect: int


class Lane:
    """One encoder as this proxy's scheduler sees it: speed estimate, outstanding work and queue,
    share governor, suspicion."""

    __slots__ = ("url", "gone", "speed", "work", "share", "suspicion")

    def __init__(self, url: str) -> None:
        self.url = url
        # It left the fleet: nothing new starts on it.
        self.gone = False
        self.speed = Speed()
        self.work = Outstanding()
        self.share = Sharing()
        self.suspicion = Suspicion()

    # -- outstanding work ------------------------------------------------------------------------
    def started(self, cost: float, now: float = 0.0) -> None:
        """A sub-request costing `cost` is on its way (not from the queue)."""
        work = self.work
        self._starting(now)
        work.inflight += 1
        work.inflight_load += cost
        work.subs += 1
        work.load += cost

    def queued(self, work: Queued) -> None:
        self.work.queued(work)

    def evict(self) -> None:
        """Its encoder left, was ejected or stalls: every waiting group moves elsewhere now."""
        while self.work.waiting:
            self.work.pop_oldest().move()

    def unqueued(self, work: Queued) -> bool:
        """A waiting group whose request went away; False if it was no longer waiting."""
        return self.work.unqueued(work)

    def gave_up(self, work: Queued) -> bool:
        """A waiting group goes alone, having waited longer than the backlog explained; False if
        it was no longer waiting."""
        if not self.work.unqueued(work):
            return False
        self.share.gave_up()
        return True

    def busy(self, slots: int = BUSY_INFLIGHT) -> bool:
        """`slots` of our sub-requests in flight (`Lanes.slots`): a new group waits to share."""
        return self.work.inflight >= slots

    def has_waiting(self) -> bool:
        return bool(self.work.waiting)

    def can_send_queued(self, slots: int = BUSY_INFLIGHT) -> bool:
        """Groups wait and the encoder, still in the fleet, has room for another sub-request."""
        return bool(self.work.waiting) and self.work.inflight < slots and not self.gone

    def outstanding(self) -> int:
        """Our sub-requests there, in flight and queued."""
        return self.work.subs

    def leftover(self) -> float:
        """Everything still counted there; 0 once each sub-request and group has ended."""
        work = self.work
        return work.inflight + work.subs + work.load + len(work.waiting) + len(self.share.shared)

    def silent_s(self, now: float) -> float:
        """Seconds since the encoder began our oldest sub-request in flight there, or last answered."""
        return now - self.work.busy_since

    def backlog_s(self, now: float | None, fixed_s: float, item_s: float, behind: Behind | None = None) -> float:
        """Our work outstanding there, in seconds (in flight and queued; with `behind`, not the queued
        groups a request goes ahead of) at `now`, at `Lanes.costs`' speed, less what it did since our
        oldest sub-request there began (nothing without a clock): what placement, the last resort and
        `epd_encoder_backlog_seconds` read. One never measured is at least as far behind as that
        sub-request is old, or one hung on its first request would soon look idle."""
        work = self.work
        backlog = fixed_s * work.subs + item_s * work.load
        if behind is not None:
            backlog -= self.queued_s(fixed_s, item_s, behind)
        if now is None or not work.inflight:
            return backlog
        silent = now - work.busy_since
        backlog -= silent
        if not self.speed.measured and silent > backlog:
            return silent
        return backlog if backlog > 0.0 else 0.0

    def queued_s(self, fixed_s: float, item_s: float, behind: Behind) -> float:
        """The part of `backlog_s` queued here, not yet sent, whose groups are `behind` (a request)."""
        later = behind(self.work.waiting, fixed_s, item_s)
        return fixed_s * len(later) + item_s * sum(work.cost for work in later)

    def patience(self, cost: float, now: float) -> float:
        """How long a group costing `cost` queued at `now` may wait to share before it goes
        alone: three times what the backlog ahead of it and its own work should take."""
        known = self.speed.known()
        if known is None:
            return PATIENCE_FLOOR_S * 5
        fixed_s, item_s = known
        finish = self.backlog_s(now, fixed_s, item_s) + fixed_s + item_s * cost
        return max(PATIENCE_FLOOR_S, 3.0 * finish)

    def next_batch(
        self,
        cap: int,
        now: float = 0.0,
        timeout_s: float | None = None,
        rank: Callable[[str | None], float] | None = None,
    ) -> list[Any]:
        """The waiting groups the next sub-request carries, now counted in flight; `rank` puts the
        least-served tenant's first (fairness.Ledger.rank)."""
        self._starting(now)
        batch = take_batch(self.work.waiting, self.share_limit(cap, now, timeout_s), rank)
        self.work.sent(batch)
        return batch

    def finished(self, cost: float, sent: float, done: float | None) -> None:
        """A sub-request costing `cost` sent at `sent` ended: answered at `done`, or failed (None)."""
        self.work.finished(cost)
        if done is not None:
            self.suspicion.answered(sent)  # it answers again
            self.speed.observe(cost, sent, done)
            self.work.busy_since = done

    # -- suspicion -------------------------------------------------------------------------------
    def stalled(self, now: float) -> bool:
        """A sub-request is far overdue: suspect (True if it was not already)."""
        return self.suspicion.stalled(now)

    def avoid(self, now: float) -> bool:
        return self.suspicion.suspect and now < self.suspicion.until

    # -- sharing ---------------------------------------------------------------------------------
    def share_limit(self, cap: int, now: float, timeout_s: float | None) -> int:
        """Items the next shared sub-request may hold (0: it carries one group only)."""
        return self.share.limit(cap, now, timeout_s, self.speed)

    def share_failed(self, items: int, now: float) -> None:
        """A shared sub-request of `items` failed although each member went through alone."""
        self.share.failed(items, now)

    def shared_ok(self, items: int) -> None:
        self.share.ok(items)

    def charged_to_request(self) -> None:
        self.share.charged_to_request()

    def shared_opened(self, request_id: str, members: list[str]) -> None:
        """A shared sub-request of its own id `request_id` carries the requests `members`."""
        self.share.opened(request_id, members)

    def shared_closed(self, request_id: str) -> None:
        self.share.closed(request_id)

    # -- speed -----------------------------------------------------------------------------------
    @property
    def queued_items(self) -> int:
        return sum(work.size for work in self.work.waiting)

    def stale(self, now: float) -> bool:
        return self.work.inflight == 0 and self.speed.stale(now)

    def _starting(self, now: float) -> None:
        """Staleness is decided as work starts, not at its answer: more may start before that
        answer (a request's groups start after placement, so another request can be placed between)."""
        if not self.work.inflight:
            if self.stale(now):
                self.speed.restart()
            self.work.busy_since = now

    # -- views -----------------------------------------------------------------------------------
    def gauges(self) -> LaneGauges:
        speed = self.speed
        return LaneGauges(
            speed.item_s, speed.fixed_s, self.queued_items, self.share.gauge(), int(self.suspicion.suspect)
        )

    def view(self) -> dict[str, Any]:
        speed, share = self.speed, self.share
        return {
            "url": self.url,
            "ms_per_item": None if speed.item_s is None else round(speed.item_s * 1000, 3),
            "ms_per_subrequest": None if speed.fixed_s is None else round(speed.fixed_s * 1000, 3),
            "samples": speed.samples,
            "inflight": self.work.inflight,
            "suspect": self.suspicion.suspect,
            "queued": len(self.work.waiting),
            "queued_items": self.queued_items,
            "merge_limit": share.merge_limit,
            "coalescing": share.paused_until == 0.0,
            "backoffs": share.backoffs,
            "refusals_charged_to_requests": share.charged_requests,
            "impatient": share.impatient,
            "shared_inflight": dict(share.shared),
        }


class Lanes:
    """Every encoder's lane, created on first use and dropped when the encoder leaves the fleet."""

    def __init__(self, fairness: Ledger | None = None) -> None:
        # With --tenants: who has been served what, which orders every lane's queue.
        self.fairness = fairness
        self._lanes: dict[Instance, Lane] = {}
        self._departed: OrderedDict[Instance, None] = OrderedDict()
        self._departed_worked_s = 0.0

    def of(self, encoder: Instance) -> Lane:
        lane = self._lanes.get(encoder)
        if lane is None:
            lane = Lane(encoder.url)
            if encoder not in self._departed:
                self._lanes[encoder] = lane
        return lane

    def avoided(self, now: float) -> bool:
        """Whether any encoder is suspect and in its hold (`Lane.avoid`)."""
        return any(lane.suspicion.until > now for lane in self._lanes.values())

    def all(self) -> list[Lane]:
        return list(self._lanes.values())

    # Fleet membership events (registry.Watcher).
    def joined(self, inst: Instance) -> None: ...

    def rejoined(self, inst: Instance) -> None: ...

    def left(self, inst: Instance) -> None:
        lane = self._lanes.pop(inst, None)
        if lane is not None:
            lane.gone = True
            lane.evict()
            self._departed_worked_s += lane.speed.worked_s
        self._departed[inst] = None
        if len(self._departed) > DEPARTED_ENTRIES:
            self._departed.popitem(last=False)

    def ejected(self, url: str) -> None:
        """Health took it out of rotation (health.Health.on_ejection)."""
        for encoder, lane in self._lanes.items():
            if encoder.url == url:
                lane.evict()

    def worked_s(self) -> float:
        """Seconds every encoder spent on this proxy's sub-requests, those that left included."""
        return self._departed_worked_s + sum(lane.speed.worked_s for lane in self._lanes.values())

    def group_cap(self, max_batch: int, now: float) -> int:
        """The most items one sub-request may carry at `now` (0: no limit): `max_batch`, and while
        tenants compete (--tenants, `Ledger.competing`) at most fairness.CONTENDED_GROUP_ITEMS."""
        if self.fairness is None or not self.fairness.competing(now):
            return max_batch
        return min(max_batch, CONTENDED_GROUP_ITEMS) if max_batch else CONTENDED_GROUP_ITEMS

    def slots(self, now: float) -> int:
        """How many of our sub-requests an encoder runs at once at `now`: BUSY_INFLIGHT, and while
        tenants compete fairness.CONTENDED_INFLIGHT."""
        competing = self.fairness is not None and self.fairness.competing(now)
        return CONTENDED_INFLIGHT if competing else BUSY_INFLIGHT

    def charge(self, lane: Lane, tenant: str | None, cost: float, members: int = 1) -> None:
        """With --tenants, `tenant` is charged its part of a sub-request to `lane`: its media's
        `cost` at the encoder's speed and its share of the sub-request's fixed cost among `members`."""
        fairness = self.fairness
        if fairness is None or tenant is None:
            return
        known = lane.speed.known()
        if known is None:
            fixed, per_item = self.costs([lane, *self._lanes.values()])
            known = fixed[0], per_item[0]
        fairness.charge_encoder(tenant, known[0] / members + known[1] * cost)

    def backlogs(self, lanes: Sequence[Lane], now: float) -> list[float]:
        """Each lane's `Lane.backlog_s` at `now`, at the speeds `costs` gives it."""
        fixed, per_item = self.costs(lanes, now)
        return [lane.backlog_s(now, f, i) for lane, f, i in zip(lanes, fixed, per_item)]

    def costs(self, lanes: Sequence[Lane], now: float | None = None) -> tuple[list[float], list[float]]:
        """Seconds per sub-request and per image-equivalent of each lane; one without answers yet, or stale
        at `now`, is taken to be as fast as the mean of the others (or 1 unit per item when none
        has answered)."""
        figures = [lane.speed.known() for lane in lanes]
        stale = now is not None and any(lane.stale(now) for lane in lanes)
        own = [None if stale and now is not None and lane.stale(now) else f for lane, f in zip(lanes, figures)]
        known = [f for f in own if f is not None]
        if known:
            fixed = sum(f[0] for f in known) / len(known)
            item = sum(f[1] for f in known) / len(known)
        else:
            fixed, item = PRIOR_FIXED_RATIO, 1.0
        return [f[0] if f else fixed for f in own], [f[1] if f else item for f in own]
