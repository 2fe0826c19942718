"""The fleet's answer at /health: from the latest active checks and outlier detection, never by
probing on the caller's behalf (anyone may ask as often as they like).

Static mode: 200 while every configured stage has an instance in rotation, 503 naming the stage
that has none. Dynamic mode: always 200 with the roster, since an empty fleet is a normal state
there (as in the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_proxy.config import Config
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE
from epd_proxy.fleet.discovery import Discovery
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry
from epd_proxy.fleet.roster import Roster

CLUSTER_KEYS = {ENCODE: "encode_cluster", PREFILL: "prefill_cluster", DECODE: "decode_cluster"}
# The roles that serve each stage: a combined instance serves decode.
_SERVING_ROLES = {ENCODE: (ENCODE,), PREFILL: (PREFILL,), DECODE: (DECODE, PREFILL_DECODE)}


def stage_status(in_rotation: list[bool]) -> str:
    if not in_rotation:
        return "empty"
    if all(in_rotation):
        return "healthy"
    return "degraded" if any(in_rotation) else "unhealthy"


@dataclass(frozen=True, slots=True, eq=False)
class HealthReport:
    config: Config
    fleet: Registry
    health: Health
    roster: Roster | None
    discovery: Discovery | None

    def answer(self) -> tuple[int, dict[str, Any]]:
        """The status and the body of /health."""
        views = self.health.snapshot(self.fleet.all())
        instances = {view["url"]: {k: v for k, v in view.items() if k != "url"} for view in views}
        body: dict[str, Any] = {"proxy": "healthy"}
        status = 200
        if self.config.dynamic_registration:
            body["instances"] = self.fleet.snapshot(self.health.in_rotation)
            body["health"] = instances
            if self.roster is not None:
                # Reported, not fatal: routing goes on from the last roster read while the store is away.
                body["roster"] = self.roster.status()
        else:
            for stage, key in CLUSTER_KEYS.items():
                body[key] = stage_status(
                    [view["in_rotation"] for view in views if view["role"] in _SERVING_ROLES[stage]]
                )
            body["instances"] = instances
            if self._down(body):
                status = 503
        if self.discovery is not None:
            body["dns"] = self.discovery.status()  # reported, not fatal
        return status, body

    def _down(self, body: dict[str, Any]) -> bool:
        config = self.config
        # Only a DNS name can leave a stage it names empty: that stage cannot serve either.
        configured = {ENCODE: config.encode_urls, PREFILL: config.prefill_urls, DECODE: config.decode_urls}
        return any(
            body[key] == "unhealthy" or (body[key] == "empty" and configured[stage])
            for stage, key in CLUSTER_KEYS.items()
        )
