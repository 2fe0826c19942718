"""When an encoder's silence means something: a sub-request far past its expected time, an
encoder that stalls while the fleet works, and what counts against its health. Pure, like
lanes.py: the caller passes its clock's `now` and acts on the verdicts (encode.py).

- **Overdue** (`overdue_after`): a sub-request unanswered OVERDUE_FACTOR times past what its
  encoder should take for its cost and what is in flight ahead of it, and at least
  OVERDUE_FLOOR_S, is moved to another encoder: that spends one of its group's failovers, and
  each move doubles the group's overdue time on the next encoder, so an item that is slow
  everywhere settles where it is instead of being cancelled again and again.
- **Lagging** (`laggards`): an encoder with work in flight that has answered nothing for
  LAG_FLOOR_S, and for several times what one of its sub-requests should take, while another
  trusted encoder answered work sent after its last answer or sits idle, gets no new work until
  it answers. That is cheap to be wrong about (its first answer clears it), so it acts within
  about a second, long before the overdue floor.
- **Health** (`progressed_elsewhere`): an overdue sub-request counts as a gateway failure
  towards outlier ejection only if another encoder turned round work sent after this one last
  answered. An item slow on every encoder, or a fleet that is slow as a whole (CPU engines
  sharing cores with prefill), ejects no one.
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_proxy.fleet.lanes import Lane, Lanes

# Three times past the expected time, and never before 10 s: vLLM's first requests are slow, and
# a CPU engine's sub-request may wait behind prefill on shared cores (on real vLLM CPU engines a
# 1 s floor moved healthy encoders' work again and again). Never later than this share of the
# encode timeout, so the work moves while its requests' budgets still allow.
OVERDUE_FACTOR = 3.0
OVERDUE_FLOOR_S = 10.0
OVERDUE_SHARE_OF_TIMEOUT = 0.75
# Silence, with work in flight, after which an encoder that the fleet outpaces gets no new work.
LAG_FLOOR_S = 1.0


def overdue_after(lane: Lane, cost: float, timeout_s: float | None, moves: int = 0) -> float | None:
    """Seconds after which a sub-request costing `cost` just sent to `lane` is far overdue, for
    a group moved `moves` times already; None while nothing is known of the encoder's speed."""
    known, work = lane.speed.known(), lane.work
    if known is None:
        return None
    fixed_s, item_s = known
    expected = fixed_s * work.inflight + item_s * max(work.inflight_load, cost)
    after = max(OVERDUE_FLOOR_S, OVERDUE_FACTOR * expected) * 2**moves
    if timeout_s is not None:
        after = min(after, OVERDUE_SHARE_OF_TIMEOUT * timeout_s)
    return after


def progressed_elsewhere(lanes: Sequence[Lane], lane: Lane) -> bool:
    """Another of `lanes` answered a sub-request sent after `lane` last answered (or began its
    current work): the fleet turns work round while this encoder does not."""
    return any(other is not lane and other.suspicion.answered_sent > lane.work.busy_since for other in lanes)


def laggards(lanes: Lanes, candidates: Sequence[Lane], now: float) -> list[Lane]:
    """The `candidates` (the encoders in rotation) that lag at `now`, not already suspect."""
    silent = [
        lane
        for lane in candidates
        if lane.work.inflight and lane.silent_s(now) >= LAG_FLOOR_S and not lane.avoid(now) and not lane.gone
    ]
    if not silent:
        return []
    fixed, per_item = lanes.costs(candidates)
    speed = {id(lane): (f, c) for lane, f, c in zip(candidates, fixed, per_item)}
    trusted = [lane for lane in candidates if lane.speed.measured and not lane.avoid(now)]
    found = []
    for lane in silent:
        f, c = speed[id(lane)]
        one_sub_request = f + c * lane.work.inflight_load / lane.work.inflight
        if lane.silent_s(now) < OVERDUE_FACTOR * one_sub_request:
            continue
        since = lane.work.busy_since
        if any(
            other is not lane and (other.work.inflight == 0 or other.suspicion.answered_sent > since)
            for other in trusted
        ):
            found.append(lane)
    return found
