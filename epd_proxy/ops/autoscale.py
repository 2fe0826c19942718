"""What an autoscaler needs per role, from what this proxy measured: arrivals, busy time, the
encoders' backlog, and a recommended replica count (docs/observability.md derives it).

Offered load by Little's law: the mean number of a role's requests in service is the arrival
rate times the mean service time, which is the busy seconds that arrived per second. Over the
last `window_s` it is (busy seconds completed + growth of the backlog still to work off) / window.
An encoder serves one sub-request at a time (the scheduler's model, measured on vLLM), so its
offered load is a number of fully busy encoders; a prefill or decode instance batches, and serves
`concurrency` requests at once at full load. Recommended replicas = ceil(load / (capacity per
replica x target utilisation)), at least one while the role has members.

Nothing here runs per request but adding to three floats: busy time and arrivals are read from
the finished request's record and from the scheduler's lanes when sampled (once a second, and
at every scrape). Samples sit on a fixed time grid (`keep_on_grid`): each slot keeps its first
sample and only the newest beyond it, so a scrape costs no memory however often scrapes come
(an unauthenticated `/metrics` or `/status.json` would otherwise add a sample each). Every
worker's load is its own work, so loads, rates and backlogs add up over workers and proxy
replicas; the recommendation is made from the sum (metrics.py, and in PromQL for several
replicas: deploy/).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL
from epd_proxy.fleet.lanes import Lanes

ROLES = (ENCODE, PREFILL, DECODE)
# The window's samples: one per 1/60 of the window, plus the newest.
WINDOW_SLOTS = 60
# The status page's backlog timeline: a point per second over the last ten minutes at most.
HISTORY_STEP_S = 1.0
HISTORY_POINTS = 600


@dataclass(frozen=True, slots=True)
class RoleFigures:
    arrival_rate: float  # per second: media items for encoders, requests for prefill and decode
    offered_load: float  # replicas' worth of work at full load (Little's law)
    backlog_s: float  # seconds of work outstanding (encoders only: lanes.Lane.backlog_s)


def recommended(load: float, capacity: float, utilisation: float, members: int) -> int:
    """Replicas that serve `load` at `utilisation` of a replica's `capacity`."""
    if members == 0 and load <= 0:
        return 0
    return max(1, math.ceil(load / (capacity * utilisation) - 1e-9))


def keep_on_grid(samples: deque, sample: tuple, step: float) -> None:
    """Add `sample` (its time first) to time-ordered `samples`, keeping the first sample of each
    `step`-long slot and the newest: when the last two share a slot, the newest replaces the last."""
    if len(samples) >= 2 and samples[-2][0] // step == samples[-1][0] // step:
        samples[-1] = sample
    else:
        samples.append(sample)


@dataclass(eq=False)
class Autoscale:
    lanes: Lanes
    _: KW_ONLY
    window_s: float = 60.0
    utilisation: float = 0.7
    concurrency: int = 16
    # The lanes' clock (encode.py's): the backlog counts what an encoder worked off since then.
    clock: Callable[[], float] = time.perf_counter
    busy_s: dict[str, float] = field(init=False, default_factory=lambda: {PREFILL: 0.0, DECODE: 0.0})
    arrived: dict[str, int] = field(init=False, default_factory=lambda: dict.fromkeys(ROLES, 0))
    # (time, busy seconds per role, arrivals per role, encoder backlog seconds), oldest first.
    _samples: deque[tuple[float, dict[str, float], dict[str, int], float]] = field(init=False, default_factory=deque)
    # (time, encoder backlog seconds) over the last minutes, for the status page.
    _backlog_history: deque[tuple[float, float]] = field(
        init=False, default_factory=lambda: deque(maxlen=HISTORY_POINTS)
    )

    @property
    def max_kept(self) -> int:
        """The most samples both stores hold together, whatever the rate of scrapes: the window's
        slots, the one before the window and the newest; the history's fixed length."""
        return WINDOW_SLOTS + 3 + HISTORY_POINTS

    def kept(self) -> int:
        return len(self._samples) + len(self._backlog_history)

    def finished(self, trace) -> None:
        """A request's part in each role it reached (routes.py, once per request)."""
        if trace.encoder_requests:
            self.arrived[ENCODE] += trace.items
        if trace.prefill_url is not None:
            self.arrived[PREFILL] += 1
            self.busy_s[PREFILL] += trace.prefill_s
        if trace.decode_url is not None:
            self.arrived[DECODE] += 1
            self.busy_s[DECODE] += trace.decode_ttfb_s + trace.relay_s

    def busy_totals(self) -> dict[str, float]:
        return {ENCODE: self.lanes.worked_s(), **self.busy_s}

    def backlog(self) -> dict[str, float]:
        """Each encoder's backlog (lanes.Lane.backlog_s): what the scheduler and the consumer's
        last resort go by."""
        lanes = self.lanes.all()
        return dict(zip((lane.url for lane in lanes), self.lanes.backlogs(lanes, self.clock())))

    def sample(self) -> None:
        now = self.clock()
        backlog = sum(self.backlog().values())
        keep_on_grid(
            self._samples, (now, self.busy_totals(), dict(self.arrived), backlog), self.window_s / WINDOW_SLOTS
        )
        keep_on_grid(self._backlog_history, (now, backlog), HISTORY_STEP_S)
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def backlog_timeline(self, span_s: float = 300.0) -> list[dict[str, float]]:
        """The encoders' summed backlog as sampled over the last `span_s`, oldest first."""
        self.sample()
        now = self.clock()
        return [
            {"ago_s": round(now - t, 1), "seconds": round(b, 4)} for t, b in self._backlog_history if now - t <= span_s
        ]

    def figures(self) -> dict[str, RoleFigures]:
        """Per role over the window (sampled now): nothing is known before two samples."""
        self.sample()
        (then, busy0, arrived0, backlog0), (now, busy1, arrived1, backlog1) = self._samples[0], self._samples[-1]
        span = now - then
        out = {}
        for role in ROLES:
            backlog = backlog1 if role == ENCODE else 0.0
            if span <= 0:
                out[role] = RoleFigures(0.0, 0.0, backlog)
                continue
            growth = backlog1 - backlog0 if role == ENCODE else 0.0
            load = max(0.0, (busy1[role] - busy0[role] + growth) / span)
            out[role] = RoleFigures((arrived1[role] - arrived0[role]) / span, load, backlog)
        return out

    def capacity(self, role: str) -> float:
        return 1.0 if role == ENCODE else float(self.concurrency)


# Per-role figures over the window: how workers' values combine (each is its own work: add up).
WINDOW_GAUGES = (
    ("epd_role_arrival_rate", "Arrivals per second over the autoscaling window: media items for encode, requests else"),
    ("epd_role_offered_load", "Replicas' worth of work arriving (Little's law: busy seconds arriving per second)"),
    ("epd_role_backlog_seconds", "Seconds of encoder work outstanding (in flight and queued), at the learnt speeds"),
)
TOTALS = (
    ("epd_role_arrivals", "Arrivals per role: media items for encode, requests for prefill and decode"),
    (
        "epd_role_busy_seconds",
        "Seconds the role's instances spent on this proxy's work (encode: per encoder, serially)",
    ),
)
ENCODER_BACKLOG = ("epd_encoder_backlog_seconds", "An encoder's outstanding work at its learnt speed, in seconds")
RECOMMENDED = (
    "epd_role_recommended_replicas",
    "Replicas that serve the offered load at the target utilisation (see docs/observability.md)",
)


def rows(autoscale: Autoscale):
    """(family name, labels, value) of every figure this process knows, recommendation aside."""
    figures = autoscale.figures()
    busy = autoscale.busy_totals()
    for role in ROLES:
        yield TOTALS[0][0], (role,), autoscale.arrived[role]
        yield TOTALS[1][0], (role,), busy[role]
        fig = figures[role]
        for (name, _), value in zip(WINDOW_GAUGES, (fig.arrival_rate, fig.offered_load, fig.backlog_s)):
            yield name, (role,), value
    for url, seconds in autoscale.backlog().items():
        yield ENCODER_BACKLOG[0], (url,), seconds


def recommendations(autoscale: Autoscale, loads: dict[str, float], members: Callable[[str], int]):
    for role in ROLES:
        load = loads.get(role, 0.0)
        yield role, recommended(load, autoscale.capacity(role), autoscale.utilisation, members(role))
