"""Who may take traffic now: the registry says who is in the fleet, this component says which of
those members routing may use.

Two independent kinds of signal feed it, in the spirit of Envoy's split between active health
checking and outlier detection:

- Active checks (prober.py): `fail_threshold` failed `GET /health` in a row mark an instance
  *down*; it stays out until a check (or a request) succeeds.
- Passive outlier detection on live traffic, three signals each with its own threshold (0 turns
  the answer signals off), as Envoy counts them:
  - transport: `fail_threshold` transport failures in a row (refused, reset, connect timeout);
  - 5xx: `consecutive_5xx` answers with a 5xx status in a row;
  - gateway: `consecutive_gateway_failure` gateway failures in a row, that is 502, 503 and 504
    answers and transport failures alike, so an instance that alternates between refusing and
    answering 503 still adds up.
  Any answer below 500 (4xx included: the client's fault) ends every run; any answer ends the
  transport run (the instance is reachable); a 5xx other than 502-504 ends the gateway run.
  Whichever signal reaches its threshold first *ejects* the instance for the ejection time,
  doubled for every ejection that was not followed by a success, up to a cap, and the snapshot
  says which signal it was.
  When that time is over it is *half-open*: it takes traffic again, a success makes it healthy,
  one more failure that a signal counts ejects it again at once.

The 5xx default (5) is Envoy's, and it matters for vLLM: it answers 400 to a bad request, but an
input that raises something it does not classify, or a generation that ends with
`finish_reason="error"`, is a 500 (vllm/entrypoints/serve/exception_handling/error_response.py),
so one bad request must not eject; the pipeline also charges a request's 5xx to an instance at
most once across its retries. A passing active check ends a transport ejection (it reached the
instance) but not one for answers: `GET /health` says nothing about what the instance answers to
real work.

A timeout after the connection was made says "this generation is long", not "this instance is
broken", so callers do not report it. Ejections per role are bounded by `max_ejection_percent` and
never take the last instance of a role out of rotation: only active checks, which ask the instance
itself, may leave a role empty.

Everything is judged lazily against an injectable clock, so there are no timers and tests can
drive time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from epd_proxy.calls.upstream import CONNECT_TIMEOUT, REFUSED, RESET
from epd_proxy.fleet.backends import Instance

log = logging.getLogger("epd_proxy.health")

HEALTHY, HALF_OPEN, EJECTED, DOWN = "healthy", "half_open", "ejected", "down"
# Why outlier detection ejected an instance.
TRANSPORT, GATEWAY, FIVE_XX = "transport", "gateway", "5xx"
EJECTION_REASONS = (TRANSPORT, GATEWAY, FIVE_XX)
GATEWAY_STATUSES = frozenset({502, 503, 504})
# What says the instance itself is unreachable. Not: an answer of any status, a timeout after the
# connection was made (headers, idle: the work is long), a wait for our own pool, or an answer cut
# off midway (the instance was reachable; the stream's own error reaches the client).
_INSTANCE_FAILURES = frozenset({REFUSED, RESET, CONNECT_TIMEOUT})


def counts_against_instance(failure_kind: str) -> bool:
    """Whether a backend-call failure of this kind (see upstream.py) feeds outlier detection."""
    return failure_kind in _INSTANCE_FAILURES


@dataclass(slots=True)
class _Record:
    role: str
    # Consecutive transport failures on live traffic.
    failures: int = 0
    # Consecutive answers with a 5xx status.
    answers_5xx: int = 0
    # Consecutive gateway failures: 502/503/504 answers and transport failures.
    gateway_failures: int = 0
    # Consecutive failed active checks.
    check_failures: int = 0
    # Ejections with no success in between: sets the length of the next one.
    streak: int = 0
    ejections_total: int = 0
    ejected_until: float | None = None
    # The signal behind the current ejection (EJECTION_REASONS), until a success ends it.
    ejection_reason: str | None = None
    down: bool = False
    # Start of the current spell out of rotation (ejected or down, without a success since).
    out_since: float | None = None
    checked_at: float | None = None
    check_problem: str | None = None
    last_problem: str | None = None


class Health:
    def __init__(
        self,
        *,
        fail_threshold: int = 3,
        consecutive_5xx: int = 5,
        consecutive_gateway_failure: int = 5,
        ejection_time_s: float = 30.0,
        max_ejection_time_s: float = 300.0,
        max_ejection_percent: int = 50,
        panic_when_all_down: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fail_threshold = fail_threshold
        self.consecutive_5xx = consecutive_5xx
        self.consecutive_gateway_failure = consecutive_gateway_failure
        self.ejection_time_s = ejection_time_s
        self.max_ejection_time_s = max(max_ejection_time_s, ejection_time_s)
        self.max_ejection_percent = max_ejection_percent
        # Static mode: the operator listed these instances, so when active checks call every one
        # of a role down, trying one still beats refusing every request until the next check.
        self.panic_when_all_down = panic_when_all_down
        self._clock = clock
        self._records: dict[str, _Record] = {}
        # URLs ejected or down (possibly with an expired ejection): empty means nothing to filter.
        self._out: set[str] = set()
        self._ejection_listeners: list[Callable[[str, str, str], None]] = []
        self._unreachable_listeners: list[Callable[[Instance], None]] = []

    def on_ejection(self, listener: Callable[[str, str, str], None]) -> None:
        """Call `listener(role, url, reason)` on every ejection (metrics count them by reason)."""
        self._ejection_listeners.append(listener)

    def on_unreachable(self, listener: Callable[[Instance], None]) -> None:
        """Call `listener(inst)` on every transport failure and failed check (DNS discovery then
        asks again whether the instance is still there)."""
        self._unreachable_listeners.append(listener)

    # -- membership events (the registry calls these) -----------------------------------------------
    def joined(self, inst: Instance) -> None:
        self._records[inst.url] = _Record(inst.role)
        self._out.discard(inst.url)

    def rejoined(self, inst: Instance) -> None:
        """Registered again: whoever re-registers it vouches for it, so its history is dropped."""
        if inst.url in self._out:
            log.warning("%s %s registered again: back in rotation", inst.role, inst.url)
        self.joined(inst)

    def left(self, inst: Instance) -> None:
        self._records.pop(inst.url, None)
        self._out.discard(inst.url)

    # -- routing ----------------------------------------------------------------------------------------
    def available(self, members: Sequence[Instance]) -> Sequence[Instance]:
        """The members that may take traffic now (one role's members, in registry order)."""
        if not self._out:
            return members
        now = self._clock()
        routable = [m for m in members if self._routable(m.url, now)]
        if routable or not members:
            return routable
        # Passive ejection alone never empties a role (the budget prevents it, and this covers
        # a fleet that shrank under it): whoever no active check calls down stays.
        not_down = [m for m in members if not self._is_down(m.url)]
        if not_down:
            return not_down
        return list(members) if self.panic_when_all_down else []

    def in_rotation(self, inst: Instance) -> bool:
        return inst.url not in self._out or self._routable(inst.url, self._clock())

    def _routable(self, url: str, now: float) -> bool:
        rec = self._records.get(url)
        if rec is None:
            return True
        return not rec.down and (rec.ejected_until is None or now >= rec.ejected_until)

    def _is_down(self, url: str) -> bool:
        rec = self._records.get(url)
        return rec is not None and rec.down

    def state(self, url: str) -> str:
        rec = self._records.get(url)
        if rec is None:
            return HEALTHY
        return self._state(rec, self._clock())

    @staticmethod
    def _state(rec: _Record, now: float) -> str:
        if rec.down:
            return DOWN
        if rec.ejected_until is None:
            return HEALTHY
        return EJECTED if now < rec.ejected_until else HALF_OPEN

    # -- passive outlier detection ----------------------------------------------------------------------
    def succeeded(self, inst: Instance) -> None:
        """The instance answered with a status no signal counts (below 500, or a 5xx whose signals
        are off): it is alive and doing its work, so every run ends."""
        rec = self._records.get(inst.url)
        if rec is None:
            return
        rec.failures = rec.answers_5xx = rec.gateway_failures = 0
        if inst.url in self._out:
            self._recover(inst.url, rec, "answered a request")

    def answered(self, inst: Instance, status: int, detail: str = "") -> None:
        """The instance answered with this HTTP status; `detail` says what it said (for the record)."""
        gateway = status in GATEWAY_STATUSES
        counted = status >= 500 and (self.consecutive_5xx > 0 or (gateway and self.consecutive_gateway_failure > 0))
        if not counted:
            self.succeeded(inst)
            return
        rec = self._records.get(inst.url)
        if rec is None:
            return
        rec.failures = 0  # it answered, so it is reachable
        rec.answers_5xx += 1
        rec.gateway_failures = rec.gateway_failures + 1 if gateway else 0
        problem = f"HTTP {status}: {detail[:200]}" if detail else f"HTTP {status}"
        signal = GATEWAY if gateway and self.consecutive_gateway_failure > 0 else FIVE_XX
        self._count_failure(inst.url, rec, signal, problem)

    def failed(self, inst: Instance, reason: str) -> None:
        """A transport failure: refused, reset, or no connection within the connect timeout. It
        neither counts towards nor ends a run of 5xx answers: there was no answer."""
        rec = self._records.get(inst.url)
        if rec is None:
            return
        rec.failures += 1
        rec.gateway_failures += 1
        self._count_failure(inst.url, rec, TRANSPORT, reason)
        for listener in self._unreachable_listeners:
            listener(inst)

    def _count_failure(self, url: str, rec: _Record, signal: str, problem: str) -> None:
        rec.last_problem = problem
        now = self._clock()
        state = self._state(rec, now)
        if state in (EJECTED, DOWN):
            return  # a request that was already under way when it left the rotation
        tripped = self._tripped(rec)
        if state == HALF_OPEN and tripped is None:
            tripped = signal, 1, 1  # on probation: one failure is enough
        if tripped is not None:
            self._eject(url, rec, now, *tripped, problem)

    def _tripped(self, rec: _Record) -> tuple[str, int, int] | None:
        """The first signal whose run reached its threshold: (signal, run, threshold)."""
        for signal, run, threshold in (
            (TRANSPORT, rec.failures, self.fail_threshold),
            (GATEWAY, rec.gateway_failures, self.consecutive_gateway_failure),
            (FIVE_XX, rec.answers_5xx, self.consecutive_5xx),
        ):
            if threshold > 0 and run >= threshold:
                return signal, run, threshold
        return None

    def _eject(self, url: str, rec: _Record, now: float, signal: str, run: int, threshold: int, problem: str) -> None:
        if not self._budget_allows(url, rec.role, now):
            if run != threshold:
                return  # said once per run of failures, not on every failed request
            log.warning(
                "%s %s: %d %s failure(s) in a row (last: %s) but it stays in rotation: ejecting it would "
                "exceed --max-ejection-percent %d or leave the role without an instance",
                rec.role,
                url,
                run,
                signal,
                problem,
                self.max_ejection_percent,
            )
            return
        duration = min(self.ejection_time_s * 2**rec.streak, self.max_ejection_time_s)
        rec.streak += 1
        rec.ejections_total += 1
        rec.ejected_until = now + duration
        rec.ejection_reason = signal
        rec.failures = rec.answers_5xx = rec.gateway_failures = 0
        if rec.out_since is None:
            rec.out_since = now
        self._out.add(url)
        log.warning(
            "%s %s ejected for %gs after %d %s failure(s) in a row (ejection %d in a row; last: %s)",
            rec.role,
            url,
            duration,
            run,
            signal,
            rec.streak,
            problem,
        )
        for listener in self._ejection_listeners:
            listener(rec.role, url, signal)

    def _budget_allows(self, url: str, role: str, now: float) -> bool:
        members = ejected = out = 0
        for other_url, other in self._records.items():
            if other.role != role:
                continue
            members += 1
            if other_url == url:
                continue
            state = self._state(other, now)
            if state == EJECTED:
                ejected += 1
            if state in (EJECTED, DOWN):
                out += 1
        allowed = members * self.max_ejection_percent // 100
        return ejected + 1 <= allowed and members - out - 1 >= 1

    # -- active checks ---------------------------------------------------------------------------------
    def checked(self, inst: Instance, problem: str | None) -> None:
        """One active check's result: None when `GET /health` answered 200, else why not."""
        rec = self._records.get(inst.url)
        if rec is None:
            return  # left the fleet while the check was under way
        now = self._clock()
        rec.checked_at = now
        rec.check_problem = problem
        if problem is None:
            rec.check_failures = 0
            rec.failures = 0
            if inst.url not in self._out:
                return
            if rec.ejected_until is not None and rec.ejection_reason != TRANSPORT:
                # It is reachable, but the check does not exercise what its answers failed at.
                if rec.down:
                    rec.down = False
                    log.warning(
                        "%s %s passed its health check; still ejected for %s", rec.role, inst.url, rec.ejection_reason
                    )
                return
            self._recover(inst.url, rec, "passed its health check")
            return
        rec.check_failures += 1
        rec.last_problem = problem
        for listener in self._unreachable_listeners:
            listener(inst)
        if not rec.down and rec.check_failures >= self.fail_threshold:
            rec.down = True
            if rec.out_since is None:
                rec.out_since = now
            self._out.add(inst.url)
            log.warning(
                "%s %s is down: %d health checks in a row failed (last: %s)",
                rec.role,
                inst.url,
                rec.check_failures,
                problem,
            )

    def _recover(self, url: str, rec: _Record, why: str) -> None:
        was = self._state(rec, self._clock())
        rec.down = False
        rec.ejected_until = None
        rec.ejection_reason = None
        rec.streak = 0
        rec.check_failures = 0
        rec.out_since = None
        self._out.discard(url)
        if was != HALF_OPEN:
            log.warning("%s %s is back in rotation: it %s", rec.role, url, why)

    # -- housekeeping and reporting ----------------------------------------------------------------------
    def out_longer_than(self, seconds: float) -> list[str]:
        """URLs out of rotation (ejected, half-open or down, no success since) for longer than this."""
        now = self._clock()
        return [
            url
            for url, rec in self._records.items()
            if rec.out_since is not None and now - rec.out_since > seconds and url in self._out
        ]

    def snapshot(self, members: Iterable[Instance]) -> list[dict[str, Any]]:
        """Read-only view per instance, for /health, /status and metrics."""
        now = self._clock()
        out = []
        for inst in members:
            rec = self._records.get(inst.url) or _Record(inst.role)
            state = self._state(rec, now)
            out.append(
                {
                    "url": inst.url,
                    "role": inst.role,
                    "state": state,
                    "in_rotation": state in (HEALTHY, HALF_OPEN),
                    "inflight": inst.inflight,
                    "consecutive_failures": max(rec.failures, rec.check_failures),
                    "consecutive_5xx": rec.answers_5xx,
                    "consecutive_gateway_failures": rec.gateway_failures,
                    "ejections": rec.ejections_total,
                    "ejected_for_s": round(rec.ejected_until - now, 3)
                    if rec.ejected_until and state == EJECTED
                    else None,
                    # Which signal ejected it (EJECTION_REASONS), while ejected or half-open.
                    "ejection_reason": rec.ejection_reason,
                    # Since it last left the rotation, with no success since (half-open included).
                    "out_for_s": round(now - rec.out_since, 3) if rec.out_since is not None else None,
                    "last_check_age_s": round(now - rec.checked_at, 3) if rec.checked_at is not None else None,
                    "last_check": None if rec.checked_at is None else (rec.check_problem or "ok"),
                    "last_problem": rec.last_problem,
                }
            )
        return out
