"""While tenants compete (--tenants), how many requests each consumer prefills at once, and who
is sent to it next.

vLLM schedules a consumer's waiting prompts first come, first served, so a flood's prompts, once
sent, all run before an interactive tenant's next one. While two or more tenants have requests in
flight, the proxy sends each consumer (a PD, or a prefill in E+P+D) at most `--consumer-window`
requests that have not produced their first token yet. The others wait in the proxy, and the next
to go is the one of the best `priority`, then of the tenant with the fewest weighted tokens
(fairness.Ledger.token_rank), then the oldest. A tenant alone never waits here: idle share is not
held back. A request of a priority class (`priority` below 0, a grant of the tenants file) never
waits either, and takes no place: the window is there to keep the others' prompts from filling
the consumer's steps ahead of it, and a class prompt held until a flood prompt reached its first
token waited longer than in the engine's own queue (docs/benchmark.md).

A streamed request leaves the window at its first token; a non-streamed one (and an E+P+D
prefill) when its answer arrives, which for vLLM is when it is done. How long places are held
(an average over the last ones) predicts a new request's wait for one at arrival (`wait_s`), so a
request that cannot start within its deadline is answered at once (journey/admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from epd_proxy.fleet.fairness import Ledger, in_class

# Weight of the newest hold in the average hold time.
HOLD_EWMA = 0.2


@dataclass(eq=False, slots=True)
class _Waiter:
    priority: int
    tenant: str | None
    order: int
    future: asyncio.Future[None]


@dataclass(eq=False)
class Window:
    """One consumer's requests in prefill (`open`) and those waiting to be sent to it."""

    size: int
    ledger: Ledger
    open: int = 0
    waiting: list[_Waiter] = field(default_factory=list)
    # Seconds a place is held, on average (0 until one was given back).
    hold_s: float = 0.0

    def wait_s(self, tenant: str | None, priority: int) -> float:
        """The wait a request of `tenant` arriving now is predicted for a place here: the places
        taken before it (those that go first, and one more for itself) beyond the free ones,
        given back `size` at a time every `hold_s`."""
        if not self.hold_s or not self.ledger.contended():
            return 0.0
        rank = self.ledger.token_rank
        standing = (priority, rank(tenant))
        ahead = sum(1 for w in self.waiting if (w.priority, rank(w.tenant)) <= standing)
        short = ahead + 1 - (self.size - self.open)
        return short * self.hold_s / self.size if short > 0 else 0.0

    def _next(self) -> _Waiter:
        rank = self.ledger.token_rank
        return min(self.waiting, key=lambda w: (w.priority, rank(w.tenant), w.order))

    def _room(self) -> bool:
        """Whether a place is free, or there is no limit now (a tenant alone)."""
        return self.open < self.size or not self.ledger.contended()

    def _admit(self) -> None:
        while self.waiting and self._room():
            waiter = self._next()
            self.waiting.remove(waiter)
            self.open += 1
            waiter.future.set_result(None)

    async def enter(self, tenant: str | None, priority: int, order: int) -> None:
        if not self.waiting and self._room():
            self.open += 1
            return
        waiter = _Waiter(priority, tenant, order, asyncio.get_running_loop().create_future())
        self.waiting.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter in self.waiting:
                self.waiting.remove(waiter)
            else:  # admitted as it was cancelled: the place goes to the next
                self.leave()
            raise

    def leave(self, held_s: float | None = None) -> None:
        self.open -= 1
        if held_s is not None:
            self.hold_s = held_s if not self.hold_s else self.hold_s + HOLD_EWMA * (held_s - self.hold_s)
        self._admit()


class Windows:
    """Every consumer's window, by URL (`--consumer-window`; 0 turns them off)."""

    def __init__(self, size: int, ledger: Ledger) -> None:
        self.size = size
        self.ledger = ledger
        self._windows: dict[str, Window] = {}
        self._order = itertools.count()

    def of(self, url: str) -> Window:
        window = self._windows.get(url)
        if window is None:
            window = self._windows[url] = Window(self.size, self.ledger)
        return window

    @contextlib.asynccontextmanager
    async def turn(self, url: str, tenant: str | None, priority: int) -> AsyncIterator[None]:
        """Wait for a place in `url`'s window, and hold it for the block; a class goes at once."""
        if in_class(priority):
            yield
            return
        window = self.of(url)
        await window.enter(tenant, priority, next(self._order))
        since = time.monotonic()
        try:
            yield
        finally:
            window.leave(time.monotonic() - since)

    def waiting(self) -> int:
        return sum(len(window.waiting) for window in self._windows.values())

    def wait_s(self, urls: Sequence[str], tenant: str | None, priority: int) -> float:
        """The shortest predicted wait for a place among the consumers `urls` (`Window.wait_s`); a
        class waits for none."""
        if in_class(priority):
            return 0.0
        windows = [self._windows.get(url) for url in urls]
        return min((w.wait_s(tenant, priority) if w is not None else 0.0 for w in windows), default=0.0)
