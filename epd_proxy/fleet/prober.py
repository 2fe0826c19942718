"""Active health checks: `GET /health` on every member, through a pool of their own, and with
them the consumers' media probes (capabilities.py).

Checks never share the request pool: behind `--max-connections-per-backend` they would queue
behind long streams, time out, and take a busy but healthy instance out of rotation. The check
pool keeps no connections (each check opens a fresh one), so a check also proves the instance
still accepts new connections, and it never counts towards an instance's in-flight requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.capabilities import MediaProbe
from epd_proxy.fleet.health import Health

log = logging.getLogger("epd_proxy.prober")


def check_pool(headers: dict[str, str]) -> Upstream:
    """Checks' own pool: no keep-alive, never capped, and not counted as in-flight work."""
    return Upstream(keep_alive_s=None, headers=headers, count_inflight=False)


async def check(pool: Upstream, inst: Instance, timeout_s: float) -> str | None:
    """None when `GET /health` answers 200 in time, else why not."""
    try:
        answer = await pool.call(
            inst,
            "GET",
            "/health",
            timeouts=Timeouts(connect=timeout_s, total=timeout_s),
            stage="health_check",
            what="Health check",
        )
    except NoAnswer as failure:
        return failure.reason
    return None if answer.status == 200 else f"HTTP {answer.status}"


@dataclass(eq=False)
class Prober:
    """Checks every member each `interval_s`; the first round runs at once so that the proxy's
    `/health` has results to report from the start."""

    pool: Upstream
    health: Health
    members: Callable[[], Iterable[Instance]]
    _: KW_ONLY
    interval_s: float
    timeout_s: float
    # What raw media each consumer takes, asked alongside the checks.
    media: MediaProbe | None = None
    rounds: int = field(default=0, init=False)

    async def round(self) -> None:
        instances = list(self.members())
        checks = [check(self.pool, inst, self.timeout_s) for inst in instances]
        if self.media is not None:
            *results, _ = await asyncio.gather(*checks, self.media.round())
        else:
            results = await asyncio.gather(*checks)
        for inst, problem in zip(instances, results):
            # Health ignores instances that left the fleet while their check was under way.
            self.health.checked(inst, problem)
        self.rounds += 1

    async def run_forever(self, after_round: Callable[[], None] = lambda: None) -> None:
        while True:
            try:
                await self.round()
                after_round()
            except Exception:  # a failed round must never stop the checks
                log.exception("health check round failed")
            await asyncio.sleep(self.interval_s)
