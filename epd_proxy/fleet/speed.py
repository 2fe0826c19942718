"""How fast one encoder turns this proxy's sub-requests round, learnt from its answers. Pure:
the lane (lanes.py) feeds it each answered sub-request on the caller's clock.

The estimate is one speed per encoder, seconds per image-equivalent (an item's cost, or the
fixed part of a sub-request at PRIOR_FIXED_RATIO of one): time held over cost held, each
smoothed. Fitting the fixed and per-item parts apart from live samples was tried and is
unstable: a few milliseconds of jitter in when answers are read move the fit's fixed part by
tens of times, while the ratio of the sums stays put.
"""

from __future__ import annotations

# A sub-request's fixed cost over one image's on real vLLM (7 ms against 21 ms of CPU on the
# tiny Qwen2-VL; PR 57095's GPU figures imply 0.31): the split of a cost until there are samples
# enough to fit both parts.
PRIOR_FIXED_RATIO = 0.35
# Weight of the newest sample in the speed fit: about the last 30 sub-requests count.
SMOOTHING = 0.03
# An encoder idle and unheard from this long is taken at the fleet's mean speed again, and what
# it is sent next starts a new estimate: otherwise one slow spell (vLLM's first requests, a pause,
# a test's injected delay) would leave it idle for as long as the others keep up.
STALE_S = 5.0


class Speed:
    """One encoder's speed estimate and the time it spent on our answered sub-requests."""

    __slots__ = ("fixed_s", "item_s", "samples", "last_done", "worked_s", "fixed_ratio", "_k", "_t")

    def __init__(self, fixed_ratio: float = PRIOR_FIXED_RATIO) -> None:
        # A sample's fixed part, in units of its cost (a prefill's claim holds its own).
        self.fixed_ratio = fixed_ratio
        # Estimated seconds per sub-request and per image-equivalent; None until the first answer.
        self.fixed_s: float | None = None
        self.item_s: float | None = None
        self.samples = 0
        self.last_done = 0.0
        # Seconds the encoder spent on this proxy's answered sub-requests (the autoscaler's busy time).
        self.worked_s = 0.0
        self._k = self._t = 0.0

    @property
    def measured(self) -> bool:
        return self.item_s is not None

    def known(self) -> tuple[float, float] | None:
        """(seconds per sub-request, seconds per image-equivalent), or None before any answer."""
        if self.fixed_s is None or self.item_s is None:
            return None
        return self.fixed_s, self.item_s

    def observe(self, cost: float, sent: float, done: float) -> None:
        """One answered sub-request: it held the encoder from when it was sent, or from when the
        previous answer came if that was later (it queued behind it), until its own answer."""
        start = sent if sent > self.last_done else self.last_done
        if done > self.last_done:
            self.last_done = done
        held = done - start
        if held <= 0:
            return
        self.worked_s += held
        self.samples += 1
        weight = max(SMOOTHING, 1.0 / self.samples)
        self._k += weight * (cost + self.fixed_ratio - self._k)
        self._t += weight * (held - self._t)
        self.item_s = self._t / self._k
        self.fixed_s = self.fixed_ratio * self.item_s

    def stale(self, now: float) -> bool:
        """Measured, but unheard from for STALE_S at `now` (the lane adds: and idle)."""
        return self.item_s is not None and now - self.last_done > STALE_S

    def restart(self) -> None:
        """What comes next starts a new estimate (the current one stands until then)."""
        self.samples = 0
        self._k = self._t = 0.0
