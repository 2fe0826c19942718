"""An encoder that joins during a slow spell, replayed on the scheduler's pure parts (lanes.py and
scheduler.py) with a driven clock: how long it can go without a placement once the spell is over,
and that what it was sent is counted out again whatever happened to it.

The replay is the DNS test's move (tests/http/test_dns.py): a fast encoder with a long history
serves single-image requests at a fixed concurrency; a new encoder joins while every encoder is
slowed, is measured slow, and the slowness is lifted. Sub-requests run concurrently on an encoder
(as on the fake, which sleeps), and groups wait to share one while BUSY_INFLIGHT are in flight,
as the encode step and the coalescer do.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import pytest

from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.lanes import BUSY_INFLIGHT, Lanes
from epd_proxy.fleet.scheduler import ExpectedFinish, Key
from epd_proxy.fleet.speed import PRIOR_FIXED_RATIO, STALE_S
from tests.unit.fleet.test_scheduler import fleet, serve

CONCURRENCY = 4
SLOW_S = 0.3


@dataclass(eq=False)
class Group:
    client: int
    key: bytes = b"k"
    size: int = 1
    cost: float = 1.0
    priority: int = 0

    def move(self) -> None:
        raise AssertionError("nothing leaves in this replay")


@dataclass
class Replay:
    """Closed-loop clients over two encoders; `placed` records (time, encoder) of every placement."""

    fast_s: float
    lifted_at: float
    joins_at: float
    consumer_s: float = 0.002
    policy: ExpectedFinish = field(default_factory=lambda: ExpectedFinish(affinity=False))
    placed: list[tuple[float, Instance]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.old, self.new = fleet(2)
        self.lanes: Lanes = self.policy.lanes
        serve(self.lanes.of(self.old), [1] * 300, self.fast_s)  # a long history, fast
        self.start = self.lanes.of(self.old).speed.last_done
        self._events: list = []
        self._order = itertools.count()

    def _at(self, when: float, *event) -> None:
        heapq.heappush(self._events, (when, next(self._order), event))

    def _held(self, now: float) -> float:
        return SLOW_S if now < self.lifted_at else self.fast_s

    def _send(self, now: float, encoder: Instance, groups: list[Group]) -> None:
        self._at(now + self._held(now), "answer", encoder, groups, now)

    def run(self, until: float) -> None:
        """Clients send until `until`, then what is under way finishes."""
        for client in range(CONCURRENCY):
            self._at(self.start + client * 0.001, "request", client)
        n = 0
        while self._events:
            now, _, event = heapq.heappop(self._events)
            if event[0] == "request":
                if now > until:
                    continue
                n += 1
                live = [self.old, self.new] if now >= self.joins_at else [self.old]
                encoder = self.policy.place(live, [Key(f"{event[1]}-{n}")], 0, now)[0][0]
                self.placed.append((now, encoder))
                lane = self.lanes.of(encoder)
                group = Group(event[1])
                if lane.work.inflight >= BUSY_INFLIGHT:
                    lane.queued(group)
                else:
                    lane.started(1, now)
                    self._send(now, encoder, [group])
            else:
                _, encoder, groups, sent = event
                lane = self.lanes.of(encoder)
                lane.finished(sum(group.cost for group in groups), sent, now)
                for group in groups:
                    self._at(now + self.consumer_s, "request", group.client)
                while lane.work.waiting and lane.work.inflight < BUSY_INFLIGHT:
                    self._send(now, encoder, lane.next_batch(8, now))

    def longest_wait_of_new(self, since: float, until: float) -> float:
        """The longest time from `since` to `until` that the new encoder went without a placement."""
        times = [since, *(t for t, encoder in self.placed if encoder is self.new and since <= t <= until), until]
        return max(later - earlier for earlier, later in itertools.pairwise(times))


@pytest.mark.parametrize("fast_s", [0.002, 0.02])
@pytest.mark.parametrize("spell_s", [0.5, 2.0, 8.0])
def test_an_encoder_that_joined_during_a_fleet_wide_slow_spell_waits_at_most_stale_s_for_work(fast_s, spell_s):
    replay = Replay(fast_s, lifted_at=0.0, joins_at=0.0)
    replay.joins_at = replay.start + 0.1
    replay.lifted_at = replay.joins_at + spell_s
    end = replay.lifted_at + 4 * STALE_S
    replay.run(until=end)
    assert any(encoder is replay.new for _, encoder in replay.placed), "the new encoder got nothing"
    # Its last slow answer comes at most SLOW_S after the lift; idle and unheard from for
    # STALE_S it is taken at the fleet's mean, which beats or ties (rotation) the busy one.
    assert replay.longest_wait_of_new(replay.lifted_at, end) <= SLOW_S + STALE_S + 4 * fast_s
    new = replay.lanes.of(replay.new)
    assert new.speed.item_s < 2 * fast_s  # measured afresh, not averaged with the spell
    for lane in replay.lanes.all():
        assert (
            lane.work.inflight,
            lane.work.inflight_load,
            lane.work.subs,
            lane.work.load,
            len(lane.work.waiting),
        ) == (0, 0, 0, 0, 0)


def test_an_encoder_probed_by_two_sub_requests_at_once_after_its_slow_spell_is_measured_afresh():
    """A request's groups start as tasks after it is placed, so another request can be placed
    before they do: two sub-requests may start on an encoder taken at the fleet's mean. Their
    answers must restart its estimate as one would, or it keeps its slow spell's and waits
    another STALE_S for work, again and again."""
    old, new = encoders = fleet(2)
    policy = ExpectedFinish(affinity=False)
    fast, slow = policy.lanes.of(old), policy.lanes.of(new)
    serve(fast, [1] * 40, 0.002)
    serve(slow, [1] * 40, SLOW_S)
    now = slow.speed.last_done + STALE_S + 1.0
    fast.speed.last_done = now  # answering all along
    fast.started(1, now)
    assert [policy.place(encoders, [Key(uuid)], 0, now)[0][0] for uuid in "ab"] == [new, new]
    slow.started(1, now)
    slow.started(1, now)
    slow.finished(1, now, now + 0.003)
    slow.finished(1, now, now + 0.004)
    assert slow.speed.item_s == pytest.approx(0.002 / (1 + PRIOR_FIXED_RATIO), rel=0.5)
    # As fast as the other, which is busy: the next image goes to it.
    fast.started(1, now + 0.004)
    assert policy.place(encoders, [Key("c")], 0, now + 0.005)[0][0] is new
