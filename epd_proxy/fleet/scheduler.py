"""The encoder scheduler's pure core: what it knows of each encoder, where an attempt's items go,
and which queued items share a sub-request. No sockets and no clocks of its own: encode.py feeds
it what happened and sends what it decides.

What an encoder costs (measured on real vLLM, see docs/scheduling.md): every
sub-request has a fixed cost of about a third of one image's, and an image the encoder saw
before under the same uuid costs about 0.4x a fresh one, but only on that encoder. So:

- **Speed** is learnt per encoder from what this proxy sees: the time each sub-request held the
  encoder (from when it was sent, or from when the previous one finished if that was later, to
  its answer) against its item count, smoothed over the last few dozen answers, with a
  sub-request's fixed cost at the measured third of an image. An encoder's backlog is then its
  outstanding sub-requests and items (in flight and queued here) at that speed, in seconds.
- **Placement by expected finish** (`ExpectedFinish.place`): item by item, the encoder where the
  request's encoding would finish first, a new sub-request paying the fixed cost; what an
  encoder has worked off since our oldest sub-request there began counts as done. A slow or busy
  encoder gets less because its finish lies later. Finishes within a quarter of an image's time
  of the earliest are ties, broken by a rotation like round robin's cursor.
- **Load-adaptive fan-out**: opening one more sub-request for a request also costs everyone
  queued behind it that fixed cost, so each new sub-request is charged the fixed cost times the
  mean number of sub-requests outstanding per encoder. Idle encoders charge nothing and a
  request's items spread for latency, as the reference does; as queues build, a request's items
  gather on fewer encoders in fewer, larger sub-requests. There is nothing to tune: the load and
  the costs are measured.
- **Repeats where they are cached**: each content uuid remembers the encoder it went to last
  (also across the turns of a conversation, which re-send earlier images). An item goes back
  there if that encoder is in rotation and either its finish is not later than the best by
  more than what the cache hit saves (under load, for the requests behind it too), or, costing
  no extra sub-request, its expected finish stays within 1.25x the fleet's mean plus one
  sub-request: the bound of consistent hashing with bounded loads, so a hot image cannot pile
  onto one encoder.
- **Coalescing** (`take_batch`): with two of this proxy's sub-requests in flight an encoder is
  busy (one computing, one being prepared: vLLM's API server processes media while its engine
  runs the previous request); image groups of different requests that arrive meanwhile wait and
  go together when one finishes. Only groups whose encoder bodies would be identical apart from
  their media share a sub-request (`coalesce_key`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from epd_proxy.fleet.backends import Instance

# A sub-request's fixed cost over one image's on real vLLM (7 ms against 21 ms of CPU on the
# tiny Qwen2-VL; PR 57095's GPU figures imply 0.31): the split of a cost until there are samples
# enough to fit both parts.
PRIOR_FIXED_RATIO = 0.35
# Share of an image's cost a cache hit saves (repeats cost about 0.4x where they were seen).
REPEAT_SAVING = 0.6
# Under load a hit also saves the requests queued behind it, up to this many of them.
REPEAT_SAVING_LOAD_CAP = 3.0
# An item follows its cached copy only while that encoder's finish is within this factor of the
# fleet's mean (the bound of consistent hashing with bounded loads).
HOT_BOUND = 1.25
# Finishes within this share of one image's time of the earliest count as ties, broken by
# rotation (two identical encoders' estimates differ by about that much).
TIE_TOLERANCE = 0.25
# Sub-requests of this proxy in flight at which an encoder counts as busy.
BUSY_INFLIGHT = 2
# Items a coalesced sub-request grows to at most (or the batch cap, if lower). Past about four
# images a sub-request's fixed cost is a few percent of it; larger ones only make the first
# request in them wait for the last and risk the encoder's --max-model-len.
COALESCE_TARGET_ITEMS = 8
# Shortest wait to share a sub-request before a group goes alone (timer granularity).
PATIENCE_FLOOR_S = 0.02
# Weight of the newest sample in the speed fit: about the last 30 sub-requests count.
SMOOTHING = 0.03
# Content uuids remembered with the encoder that saw them last (about 2 MB).
AFFINITY_ENTRIES = 16384
# An encoder idle and unheard from this long is taken at the fleet's mean speed again, and its
# next answer starts a new estimate: otherwise one slow spell (vLLM's first requests, a pause, a
# test's injected delay) would leave it idle for as long as the others keep up.
STALE_S = 5.0
# Encoders that left, remembered so a call still finishing there does not bring a lane back.
DEPARTED_ENTRIES = 4096


class Queued(Protocol):
    """What the scheduler reads of a group waiting for a sub-request."""

    key: bytes | None
    size: int


class Lane:
    """One encoder as this proxy's scheduler sees it: speed estimate, outstanding work, queue."""

    __slots__ = (
        "url",
        "inflight",
        "waiting",
        "subs",
        "items",
        "fixed_s",
        "item_s",
        "samples",
        "last_done",
        "busy_since",
        "merge_limit",
        "positions",
        "impatient",
        "_k",
        "_t",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        # Sub-requests of this proxy in flight to it.
        self.inflight = 0
        self.waiting: deque[Any] = deque()
        # Outstanding work (in flight and queued): sub-requests and items.
        self.subs = 0
        self.items = 0
        # Estimated seconds per sub-request and per item; None until the first answer.
        self.fixed_s: float | None = None
        self.item_s: float | None = None
        self.samples = 0
        self.last_done = 0.0
        # Since when the encoder has worked on our oldest sub-request in flight (serially).
        self.busy_since = 0.0
        # Items a coalesced sub-request may hold; halved when one is refused (too long a prompt
        # for the encoder, or a bad image: the split retry tells them apart only per request).
        self.merge_limit = COALESCE_TARGET_ITEMS
        # Whether its answers place entries by item_indices, which a shared answer needs.
        self.positions = True
        # Queued groups sent alone after waiting longer than the backlog explained.
        self.impatient = 0
        self._k = self._t = 0.0

    # -- outstanding work ------------------------------------------------------------------------
    def started(self, items: int, now: float = 0.0) -> None:
        """A sub-request of `items` is on its way (not from the queue)."""
        if not self.inflight:
            self.busy_since = now
        self.inflight += 1
        self.subs += 1
        self.items += items

    def queued(self, work: Queued) -> None:
        self.waiting.append(work)
        self.subs += 1
        self.items += work.size

    def unqueued(self, work: Queued) -> bool:
        """A waiting group whose request went away; False if it was no longer waiting."""
        try:
            self.waiting.remove(work)
        except ValueError:
            return False
        self.subs -= 1
        self.items -= work.size
        return True

    def patience(self, items: int) -> float:
        """How long a group of `items` queued now may wait to share before it goes alone:
        three times what the backlog ahead of it and its own work should take."""
        if self.item_s is None:
            return PATIENCE_FLOOR_S * 5
        backlog = self.fixed_s * (self.subs + 1) + self.item_s * (self.items + items)
        return max(PATIENCE_FLOOR_S, 3.0 * backlog)

    def next_batch(self, cap: int, now: float = 0.0) -> list[Any]:
        """The waiting groups the next sub-request carries, now counted in flight."""
        if not self.inflight:
            self.busy_since = now
        limit = (min(cap, self.merge_limit) if cap else self.merge_limit) if self.positions else 0
        batch = take_batch(self.waiting, limit)
        self.subs -= len(batch) - 1
        self.inflight += 1
        return batch

    def refused_shared(self) -> None:
        """A coalesced sub-request was refused (4xx): share less until shared ones succeed."""
        self.merge_limit = max(1, self.merge_limit // 2)

    def shared_ok(self, items: int) -> None:
        if items >= self.merge_limit and self.merge_limit < COALESCE_TARGET_ITEMS:
            self.merge_limit += 1

    def finished(self, items: int, sent: float, done: float | None) -> None:
        """A sub-request of `items` sent at `sent` ended: answered at `done`, or failed (None)."""
        self.inflight -= 1
        self.subs -= 1
        self.items -= items
        if done is not None:
            self.observe(items, sent, done)
            self.busy_since = done

    # -- speed -----------------------------------------------------------------------------------
    def observe(self, items: int, sent: float, done: float) -> None:
        """One answered sub-request: it held the encoder from when it was sent, or from when the
        previous answer came if that was later (it queued behind it), until its own answer.

        The estimate is one speed per encoder, seconds per item-equivalent (an item, or the
        fixed part of a sub-request at PRIOR_FIXED_RATIO of one): time held over items held,
        each smoothed. Fitting the fixed and per-item parts apart from live samples was tried
        and is unstable: a few milliseconds of jitter in when answers are read move the fit's
        fixed part by tens of times, while the ratio of the sums stays put."""
        if self.samples and sent - self.last_done > STALE_S and self.inflight == 0:
            self.samples = 0
            self._k = self._t = 0.0
        start = sent if sent > self.last_done else self.last_done
        if done > self.last_done:
            self.last_done = done
        held = done - start
        if held <= 0:
            return
        self.samples += 1
        weight = max(SMOOTHING, 1.0 / self.samples)
        self._k += weight * (items + PRIOR_FIXED_RATIO - self._k)
        self._t += weight * (held - self._t)
        self.item_s = self._t / self._k
        self.fixed_s = PRIOR_FIXED_RATIO * self.item_s

    @property
    def queued_items(self) -> int:
        return sum(work.size for work in self.waiting)

    def stale(self, now: float) -> bool:
        return self.samples > 0 and self.inflight == 0 and now - self.last_done > STALE_S

    def view(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ms_per_item": None if self.item_s is None else round(self.item_s * 1000, 3),
            "ms_per_subrequest": None if self.fixed_s is None else round(self.fixed_s * 1000, 3),
            "samples": self.samples,
            "inflight": self.inflight,
            "queued": len(self.waiting),
            "queued_items": self.queued_items,
            "merge_limit": self.merge_limit,
            "coalescing": self.positions,
            "impatient": self.impatient,
        }


class Lanes:
    """Every encoder's lane, created on first use and dropped when the encoder leaves the fleet."""

    def __init__(self) -> None:
        self._lanes: dict[Instance, Lane] = {}
        self._departed: OrderedDict[Instance, None] = OrderedDict()

    def of(self, encoder: Instance) -> Lane:
        lane = self._lanes.get(encoder)
        if lane is None:
            lane = Lane(encoder.url)
            if encoder not in self._departed:
                self._lanes[encoder] = lane
        return lane

    def all(self) -> list[Lane]:
        return list(self._lanes.values())

    # Fleet membership events (registry.Watcher).
    def joined(self, inst: Instance) -> None:
        pass

    def rejoined(self, inst: Instance) -> None:
        pass

    def left(self, inst: Instance) -> None:
        self._lanes.pop(inst, None)
        self._departed[inst] = None
        if len(self._departed) > DEPARTED_ENTRIES:
            self._departed.popitem(last=False)

    def costs(self, lanes: Sequence[Lane], now: float | None = None) -> tuple[list[float], list[float]]:
        """Seconds per sub-request and per item of each lane; one without answers yet, or stale
        at `now`, is taken to be as fast as the mean of the others (or 1 unit per item when none
        has answered)."""
        fixed = [lane.fixed_s for lane in lanes]
        stale = now is not None and any(lane.stale(now) for lane in lanes)
        if None not in fixed and not stale:
            return fixed, [lane.item_s for lane in lanes]
        fresh = [lane.item_s is not None and not (stale and lane.stale(now)) for lane in lanes]
        known = [lane for lane, ok in zip(lanes, fresh) if ok]
        if known:
            item = sum(lane.item_s for lane in known) / len(known)
            fixed = sum(lane.fixed_s for lane in known) / len(known)
        else:
            item, fixed = 1.0, PRIOR_FIXED_RATIO
        return (
            [lane.fixed_s if ok else fixed for lane, ok in zip(lanes, fresh)],
            [lane.item_s if ok else item for lane, ok in zip(lanes, fresh)],
        )


@dataclass(frozen=True, slots=True)
class Key:
    """An item as placement sees it, for callers with no MediaItem (`choose`)."""

    uuid: str
    is_image: bool = True


class Item(Protocol):
    uuid: str

    @property
    def is_image(self) -> bool: ...


class ExpectedFinish:
    """Placement by expected finish, with load-adaptive fan-out and cache affinity (see above).

    `place` is what the encode step calls; `choose` serves the RoutingPolicy interface."""

    def __init__(self, lanes: Lanes | None = None, *, affinity: bool = True, adaptive: bool = True) -> None:
        self.lanes = lanes if lanes is not None else Lanes()
        self.affinity = affinity
        self.adaptive = adaptive
        # Content uuid -> the encoder it was sent to last (an encoder that rejoins is a new one).
        self._home: OrderedDict[str, Instance] = OrderedDict()
        self._cursor = 0

    def choose(self, candidates: Sequence[Instance], keys: Sequence[str]) -> list[Instance]:
        return self.place(candidates, [Key(key) for key in keys], 0)[0]

    def place(
        self, candidates: Sequence[Instance], items: Sequence[Item], cap: int, now: float | None = None
    ) -> tuple[list[Instance], int]:
        """One encoder per item, and how many items went to the encoder that saw them last.
        With `now`, what an encoder has worked off since our oldest sub-request there began
        counts as done."""
        n = len(candidates)
        if n == 1:
            return [candidates[0]] * len(items), 0
        lanes = [self.lanes.of(encoder) for encoder in candidates]
        fixed, per_item = self.lanes.costs(lanes, now)
        adaptive = self.adaptive
        load = 0.0
        finish = []
        # An item that opens a sub-request pays the fixed cost in time, and the load-weighted
        # fixed cost in what it does to everyone else.
        opening = []
        for e in range(n):
            lane = lanes[e]
            f = fixed[e]
            backlog = f * lane.subs + per_item[e] * lane.items
            if now is not None and lane.inflight:
                backlog -= now - lane.busy_since
                if backlog < 0.0:
                    backlog = 0.0
            finish.append(backlog)
            opening.append(f + per_item[e])
            load += lane.subs
        load = load / n if adaptive else 0.0
        penalty = [load * f for f in fixed]
        # Images in this request's open sub-request on each encoder (0: none open).
        open_items = [0] * n
        start = self._cursor
        self._cursor = (start + len(items)) % n
        order = [(start + step) % n for step in range(n)]
        home = self._home if self.affinity else None
        position: dict[Instance, int] | None = None
        picks: list[Instance] = []
        hits = 0
        request_finish = 0.0
        scores = [0.0] * n
        for item in items:
            image = item.is_image
            lowest, slack = math.inf, 0.0
            for step in range(n):
                e = order[step]
                k = open_items[e]
                if image and k and (not cap or k < cap):
                    done = finish[e] + per_item[e]
                    score = done if done > request_finish else request_finish
                else:
                    done = finish[e] + opening[e]
                    score = (done if done > request_finish else request_finish) + penalty[e]
                scores[step] = score
                if score < lowest:
                    lowest, slack = score, TIE_TOLERANCE * per_item[e]
            # The first in the rotation among those as good as the best: estimates that close are
            # within their own noise, and rotating keeps every encoder's estimate current.
            good_enough = lowest + slack
            step = 0
            while scores[step] > good_enough:
                step += 1
            best, best_score = order[step], scores[step]
            k = open_items[best]
            best_opens = not image or not k or (cap > 0 and k >= cap)
            best_finish = finish[best] + (opening[best] if best_opens else per_item[best])
            if home is not None:
                uuid = item.uuid
                seen = home.get(uuid)
                if seen is None:
                    home[uuid] = candidates[best]
                    if len(home) > AFFINITY_ENTRIES:
                        home.popitem(last=False)
                else:
                    if seen is not candidates[best]:
                        if position is None:
                            position = {encoder: e for e, encoder in enumerate(candidates)}
                        h = position.get(seen)
                        if h is not None:
                            k = open_items[h]
                            opens = not image or not k or (cap > 0 and k >= cap)
                            done = finish[h] + (opening[h] if opens else per_item[h])
                            score = (done if done > request_finish else request_finish) + (penalty[h] if opens else 0.0)
                            saving = REPEAT_SAVING * per_item[h] * (1.0 + min(load, REPEAT_SAVING_LOAD_CAP))
                            if score - saving <= best_score or (
                                # Costing no more sub-requests than the best: bounded by load alone.
                                (best_opens or not opens) and done <= HOT_BOUND * sum(finish) / n + opening[h]
                            ):
                                best, best_finish, best_opens = h, done, opens
                        home[uuid] = candidates[best]
                    if home[uuid] is seen:
                        hits += 1
                    home.move_to_end(uuid)
            finish[best] = best_finish
            if image:
                open_items[best] = 1 if best_opens else open_items[best] + 1
            if best_finish > request_finish:
                request_finish = best_finish
            picks.append(candidates[best])
        return picks, hits


def coalesce_key(body: dict[str, Any], forwarded: Sequence[str], consumer_zmq: str | None) -> bytes | None:
    """What must be identical for two requests' images to share an encoder sub-request: every
    byte of the encoder body except its media (`encode.encoder_body` builds it from the model,
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
