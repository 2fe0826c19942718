"""Where an attempt's items go: placement by expected finish (pure, like lanes.py).

What an encoder costs (measured on real vLLM, see docs/scheduling.md): every
sub-request has a fixed cost of about a third of one image's, and an image the encoder saw
before under the same uuid costs about 0.4x a fresh one, but only on that encoder. So:

- **Placement by expected finish** (`ExpectedFinish.place`): item by item, the encoder where the
  request's encoding would finish first: its backlog (lanes.Lane.backlog_s) plus this request's
  items placed there so far, a new sub-request paying the fixed cost. A slow or busy
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

What it knows of each encoder (speed, backlog, queue) is in lanes.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.fairness import Behind
from epd_proxy.fleet.lanes import Lanes

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
# Content uuids remembered with the encoder that saw them last (about 2 MB).
AFFINITY_ENTRIES = 16384


@dataclass(frozen=True, slots=True)
class Key:
    """An item as placement sees it, for callers with no MediaItem (`choose`)."""

    uuid: str
    is_image: bool = True
    cost: float = 1.0


class Item(Protocol):
    """What placement reads of an item (a MediaItem or a Key)."""

    @property
    def uuid(self) -> str: ...
    @property
    def cost(self) -> float: ...  # in image-equivalents (cost.py)
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
        self,
        candidates: Sequence[Instance],
        items: Sequence[Item],
        cap: int,
        now: float | None = None,
        behind: Behind | None = None,
    ) -> tuple[list[Instance], int]:
        """One encoder per item, and how many items went to the encoder that saw them last.
        With `now`, what an encoder has worked off since our oldest sub-request there began
        counts as done. With `behind` (fairness.Ledger.behind: the queued groups this request
        goes ahead of), those groups' work is not before it: a chat's image beside a flood goes
        to the encoder whose running sub-request ends first, not to the shorter flood queue."""
        n = len(candidates)
        if n == 1:
            return [candidates[0]] * len(items), 0
        lanes = [self.lanes.of(encoder) for encoder in candidates]
        fixed, per_item = self.lanes.costs(lanes, now)
        adaptive = self.adaptive
        # Each encoder's expected finish: its backlog, then this request's items as they are placed.
        finish = [lane.backlog_s(now, f, i, behind) for lane, f, i in zip(lanes, fixed, per_item)]
        # An item that opens a sub-request pays the fixed cost in time, and the load-weighted
        # fixed cost in what it does to everyone else.
        opening = fixed
        load = sum(lane.outstanding() for lane in lanes) / n if adaptive else 0.0
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
            cost = item.cost
            lowest, slack = math.inf, 0.0
            for step in range(n):
                e = order[step]
                k = open_items[e]
                if image and k and (not cap or k < cap):
                    done = finish[e] + per_item[e] * cost
                    score = done if done > request_finish else request_finish
                else:
                    done = finish[e] + opening[e] + per_item[e] * cost
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
            best_finish = finish[best] + (opening[best] if best_opens else 0.0) + per_item[best] * cost
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
                            done = finish[h] + (opening[h] if opens else 0.0) + per_item[h] * cost
                            score = (done if done > request_finish else request_finish) + (penalty[h] if opens else 0.0)
                            saving = REPEAT_SAVING * per_item[h] * cost * (1.0 + min(load, REPEAT_SAVING_LOAD_CAP))
                            if score - saving <= best_score or (
                                # Costing no more sub-requests than the best: bounded by load alone.
                                (best_opens or not opens)
                                and done <= HOT_BOUND * sum(finish) / n + opening[h] + per_item[h] * cost
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
