"""What the encoder scheduler knows of each encoder (its lane), and which queued groups share a
sub-request. Pure: no sockets and no clocks of its own; encode.py and coalesce.py feed it what
happened and send what it decides, and placement (scheduler.py) reads it.

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
  go together when one finishes. Only groups whose encoder bodies would be identical apart from
  their media share a sub-request (`subrequest.coalesce_key` in journey/).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, Protocol

from epd_proxy.fleet.backends import Instance

# A sub-request's fixed cost over one image's on real vLLM (7 ms against 21 ms of CPU on the
# tiny Qwen2-VL; PR 57095's GPU figures imply 0.31): the split of a cost until there are samples
# enough to fit both parts.
PRIOR_FIXED_RATIO = 0.35
# Sub-requests of this proxy in flight at which an encoder counts as busy.
BUSY_INFLIGHT = 2
# Items a coalesced sub-request grows to at most (or the batch cap, if lower). Past about four
# images a sub-request's fixed cost is a few percent of it; larger ones only make the first
# request in them wait for the last and risk the encoder's --max-model-len.
COALESCE_TARGET_ITEMS = 8
# The smallest share a back-off falls to: sharing two groups is the probe that tells whether the
# encoder takes shared sub-requests again (as TCP's slow start probes with a small window).
PROBE_ITEMS = 2
# How long sharing pauses after even a probe failed without any member being at fault, doubling
# on each failure in a row up to the maximum; the next probe follows the pause.
PAUSE_FLOOR_S = 1.0
PAUSE_MAX_S = 30.0
# A shared sub-request holds at most what the encoder does in this share of the encode timeout,
# so that behind the one ahead of it in flight it still ends well within each member's own budget.
SHARE_OF_TIMEOUT = 1 / 3
# A suspect encoder gets no placements for this long, then some again: how it comes back when
# nothing of ours is left there to answer.
SUSPECT_HOLD_S = 5.0
# Shortest wait to share a sub-request before a group goes alone (timer granularity).
PATIENCE_FLOOR_S = 0.02
# Weight of the newest sample in the speed fit: about the last 30 sub-requests count.
SMOOTHING = 0.03
# An encoder idle and unheard from this long is taken at the fleet's mean speed again, and what
# it is sent next starts a new estimate: otherwise one slow spell (vLLM's first requests, a pause,
# a test's injected delay) would leave it idle for as long as the others keep up.
STALE_S = 5.0
# Encoders that left, remembered so a call still finishing there does not bring a lane back.
DEPARTED_ENTRIES = 4096


class Queued(Protocol):
    """What the scheduler reads of a group waiting for a sub-request."""

    @property
    def key(self) -> bytes | None: ...
    # Items (what batch caps count) and their cost in image-equivalents (what time follows).
    @property
    def size(self) -> int: ...
    @property
    def cost(self) -> float: ...

    # vLLM's `priority`: lower values first, then arrival order.
    priority: int

    def move(self) -> None:
        """Its encoder went: it must go elsewhere at once."""


class Lane:
    """One encoder as this proxy's scheduler sees it: speed estimate, outstanding work, queue."""

    __slots__ = (
        "url",
        "inflight",
        "inflight_load",
        "suspect",
        "suspect_until",
        "waiting",
        "subs",
        "load",
        "fixed_s",
        "item_s",
        "samples",
        "last_done",
        "answered_sent",
        "busy_since",
        "merge_limit",
        "paused_until",
        "pause_s",
        "backoffs",
        "charged_requests",
        "impatient",
        "worked_s",
        "gone",
        "shared",
        "_k",
        "_t",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        # Sub-requests of this proxy in flight to it, and their cost in image-equivalents.
        self.inflight = 0
        self.inflight_load = 0.0
        # A sub-request of ours was far overdue there, and nothing has answered since; it gets
        # no placements until `suspect_until` (on the caller's clock).
        self.suspect = False
        self.suspect_until = 0.0
        self.waiting: deque[Any] = deque()
        # Outstanding work (in flight and queued): sub-requests and their cost.
        self.subs = 0
        self.load = 0.0
        # Estimated seconds per sub-request and per image-equivalent; None until the first answer.
        self.fixed_s: float | None = None
        self.item_s: float | None = None
        self.samples = 0
        self.last_done = 0.0
        # When the latest-sent of its answered sub-requests was sent: how recent the work is
        # that it is known to turn round (stalls.progressed_elsewhere).
        self.answered_sent = float("-inf")
        # Since when the encoder has worked on our oldest sub-request in flight (serially).
        self.busy_since = 0.0
        # Items a coalesced sub-request may hold. A refused or unsplittable shared answer that
        # the split retry pins on no member (each went through alone) is the share's fault: the
        # limit halves down to a probe of PROBE_ITEMS, then sharing pauses; each shared answer
        # that splits doubles it back. One a member caused is charged to that request only.
        self.merge_limit = COALESCE_TARGET_ITEMS
        # Until when (on the caller's clock) nothing shares; 0.0: sharing.
        self.paused_until = 0.0
        self.pause_s = PAUSE_FLOOR_S
        self.backoffs = 0
        self.charged_requests = 0
        # Queued groups sent alone after waiting longer than the backlog explained.
        self.impatient = 0
        # Seconds the encoder spent on this proxy's answered sub-requests (the autoscaler's busy time).
        self.worked_s = 0.0
        # It left the fleet: nothing new starts on it.
        self.gone = False
        # Shared sub-requests in flight: their own request id -> the request ids they carry.
        self.shared: dict[str, list[str]] = {}
        self._k = self._t = 0.0

    # -- outstanding work ------------------------------------------------------------------------
    def started(self, cost: float, now: float = 0.0) -> None:
        """A sub-request costing `cost` is on its way (not from the queue)."""
        if not self.inflight:
            self._afresh_if_stale(now)
            self.busy_since = now
        self.inflight += 1
        self.inflight_load += cost
        self.subs += 1
        self.load += cost

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

    def evict(self) -> None:
        """Its encoder left, was ejected or stalls: every waiting group moves elsewhere now."""
        while self.waiting:
            work = self.waiting.popleft()
            self.subs -= 1
            self.load -= work.cost
            work.move()

    def unqueued(self, work: Queued) -> bool:
        """A waiting group whose request went away; False if it was no longer waiting."""
        try:
            self.waiting.remove(work)
        except ValueError:
            return False
        self.subs -= 1
        self.load -= work.cost
        return True

    def backlog_s(self, now: float | None, fixed_s: float, item_s: float) -> float:
        """Seconds of our work outstanding there (in flight and queued) at `now`, at the speed
        `Lanes.costs` gives it, less what it worked off since our oldest sub-request there began
        (nothing without a clock): what placement, the consumer's last resort and
        `epd_encoder_backlog_seconds` read. One never measured is at least as far behind as
        that sub-request is old, or one hung on its first request would soon look idle."""
        backlog = fixed_s * self.subs + item_s * self.load
        if now is None or not self.inflight:
            return backlog
        silent = now - self.busy_since
        backlog -= silent
        if self.item_s is None and silent > backlog:
            return silent
        return backlog if backlog > 0.0 else 0.0

    def patience(self, cost: float, now: float) -> float:
        """How long a group costing `cost` queued at `now` may wait to share before it goes
        alone: three times what the backlog ahead of it and its own work should take."""
        if self.item_s is None or self.fixed_s is None:
            return PATIENCE_FLOOR_S * 5
        finish = self.backlog_s(now, self.fixed_s, self.item_s) + self.fixed_s + self.item_s * cost
        return max(PATIENCE_FLOOR_S, 3.0 * finish)

    def next_batch(self, cap: int, now: float = 0.0, timeout_s: float | None = None) -> list[Any]:
        """The waiting groups the next sub-request carries, now counted in flight."""
        if not self.inflight:
            self._afresh_if_stale(now)
            self.busy_since = now
        batch = take_batch(self.waiting, self.share_limit(cap, now, timeout_s))
        self.subs -= len(batch) - 1
        self.inflight += 1
        self.inflight_load += sum(work.cost for work in batch)
        return batch

    def stalled(self, now: float) -> bool:
        """A sub-request is far overdue: suspect (True if it was not already)."""
        first = not self.suspect
        self.suspect = True
        self.suspect_until = now + SUSPECT_HOLD_S
        return first

    def avoid(self, now: float) -> bool:
        return self.suspect and now < self.suspect_until

    def share_limit(self, cap: int, now: float, timeout_s: float | None) -> int:
        """Items the next shared sub-request may hold (0: it carries one group only)."""
        if now < self.paused_until:
            return 0
        limit = min(cap, self.merge_limit) if cap else self.merge_limit
        # Shared groups are images, each at most one image-equivalent (cost.py): counting them
        # at one each errs on the short side.
        if timeout_s is not None and self.item_s is not None and self.fixed_s is not None:
            fits = int((SHARE_OF_TIMEOUT * timeout_s - self.fixed_s) / self.item_s)
            limit = min(limit, fits)
        return limit

    def sharing(self, now: float) -> bool:
        return now >= self.paused_until

    def share_failed(self, items: int, now: float) -> None:
        """A shared sub-request of `items` failed although each member went through alone."""
        self.backoffs += 1
        if items > PROBE_ITEMS:
            self.merge_limit = max(PROBE_ITEMS, items // 2)
            return
        self.merge_limit = PROBE_ITEMS
        self.paused_until = now + self.pause_s
        self.pause_s = min(PAUSE_MAX_S, self.pause_s * 2)

    def shared_ok(self, items: int) -> None:
        self.paused_until = 0.0
        self.pause_s = PAUSE_FLOOR_S
        if items * 2 > self.merge_limit:
            self.merge_limit = min(COALESCE_TARGET_ITEMS, self.merge_limit * 2)

    def finished(self, cost: float, sent: float, done: float | None) -> None:
        """A sub-request costing `cost` sent at `sent` ended: answered at `done`, or failed (None)."""
        self.inflight -= 1
        self.inflight_load -= cost
        self.subs -= 1
        self.load -= cost
        if done is not None:
            self.suspect = False  # it answers again
            self.suspect_until = 0.0
            if sent > self.answered_sent:
                self.answered_sent = sent
            self.observe(cost, sent, done)
            self.busy_since = done

    # -- speed -----------------------------------------------------------------------------------
    def observe(self, cost: float, sent: float, done: float) -> None:
        """One answered sub-request: it held the encoder from when it was sent, or from when the
        previous answer came if that was later (it queued behind it), until its own answer.

        The estimate is one speed per encoder, seconds per image-equivalent (an item's cost, or
        the fixed part of a sub-request at PRIOR_FIXED_RATIO of one): time held over cost held,
        each smoothed. Fitting the fixed and per-item parts apart from live samples was tried
        and is unstable: a few milliseconds of jitter in when answers are read move the fit's
        fixed part by tens of times, while the ratio of the sums stays put."""
        start = sent if sent > self.last_done else self.last_done
        if done > self.last_done:
            self.last_done = done
        held = done - start
        if held <= 0:
            return
        self.worked_s += held
        self.samples += 1
        weight = max(SMOOTHING, 1.0 / self.samples)
        self._k += weight * (cost + PRIOR_FIXED_RATIO - self._k)
        self._t += weight * (held - self._t)
        self.item_s = self._t / self._k
        self.fixed_s = PRIOR_FIXED_RATIO * self.item_s

    @property
    def queued_items(self) -> int:
        return sum(work.size for work in self.waiting)

    def stale(self, now: float) -> bool:
        return self.item_s is not None and self.inflight == 0 and now - self.last_done > STALE_S

    def _afresh_if_stale(self, now: float) -> None:
        """Decided as work starts, not at its answer: more may start before that answer (a
        request's groups start after placement, so another request can be placed between)."""
        if self.stale(now):
            self.samples = 0
            self._k = self._t = 0.0

    def view(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ms_per_item": None if self.item_s is None else round(self.item_s * 1000, 3),
            "ms_per_subrequest": None if self.fixed_s is None else round(self.fixed_s * 1000, 3),
            "samples": self.samples,
            "inflight": self.inflight,
            "suspect": self.suspect,
            "queued": len(self.waiting),
            "queued_items": self.queued_items,
            "merge_limit": self.merge_limit,
            "coalescing": self.paused_until == 0.0,
            "backoffs": self.backoffs,
            "refusals_charged_to_requests": self.charged_requests,
            "impatient": self.impatient,
            "shared_inflight": dict(self.shared),
        }


class Lanes:
    """Every encoder's lane, created on first use and dropped when the encoder leaves the fleet."""

    def __init__(self) -> None:
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
        return any(lane.suspect_until > now for lane in self._lanes.values())

    def all(self) -> list[Lane]:
        return list(self._lanes.values())

    # Fleet membership events (registry.Watcher).
    def joined(self, inst: Instance) -> None:
        pass

    def rejoined(self, inst: Instance) -> None:
        pass

    def left(self, inst: Instance) -> None:
        lane = self._lanes.pop(inst, None)
        if lane is not None:
            lane.gone = True
            lane.evict()
            self._departed_worked_s += lane.worked_s
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
        return self._departed_worked_s + sum(lane.worked_s for lane in self._lanes.values())

    def backlogs(self, lanes: Sequence[Lane], now: float) -> list[float]:
        """Each lane's `Lane.backlog_s` at `now`, at the speeds `costs` gives it."""
        fixed, per_item = self.costs(lanes, now)
        return [lane.backlog_s(now, f, i) for lane, f, i in zip(lanes, fixed, per_item)]

    def costs(self, lanes: Sequence[Lane], now: float | None = None) -> tuple[list[float], list[float]]:
        """Seconds per sub-request and per image-equivalent of each lane; one without answers yet, or stale
        at `now`, is taken to be as fast as the mean of the others (or 1 unit per item when none
        has answered)."""
        stale_at = now if now is not None and any(lane.stale(now) for lane in lanes) else None
        # Each lane's (per sub-request, per item) seconds; None while unknown, or stale at `now`.
        speeds = [
            None
            if lane.fixed_s is None or lane.item_s is None or (stale_at is not None and lane.stale(stale_at))
            else (lane.fixed_s, lane.item_s)
            for lane in lanes
        ]
        known = [speed for speed in speeds if speed is not None]
        if len(known) < len(speeds):
            if known:
                mean = (sum(f for f, _ in known) / len(known), sum(i for _, i in known) / len(known))
            else:
                mean = (PRIOR_FIXED_RATIO, 1.0)
            known = [speed or mean for speed in speeds]
        return [f for f, _ in known], [i for _, i in known]


def take_batch(waiting: deque[Any], limit: int) -> list[Any]:
    """The next sub-request's groups, leaving the rest waiting in order: the oldest group, and
    after it every later group with the same key that still fits within `limit` items."""
    head = waiting.popleft()
    batch = [head]
    size = head.size
    if head.key is None or size >= limit or not waiting:
        return batch
    kept: list[Any] = []
    while waiting:
        work = waiting.popleft()
        if work.key == head.key and size + work.size <= limit:
            batch.append(work)
            size += work.size
            if size >= limit:
                break
        else:
            kept.append(work)
    waiting.extendleft(reversed(kept))
    return batch
