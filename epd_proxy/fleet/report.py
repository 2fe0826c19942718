"""The fleet's answer at /health: from the latest active checks and outlier detection, never by
probing on the caller's behalf (anyone may ask as often as they like).

Static mode: 200 while every configured stage has an instance in rotation, 503 naming the stage
that has none. Dynamic mode: always 200 with the roster, since an empty fleet is a normal state
there (as in the reference).

Behind a client key the answer names no backend unless an admin asks (`names_backends`): the
status and each stage's verdict with counts per role, what a load balancer needs.
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


def role_counts(views: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Members and those in rotation, per role that has any."""
    counts: dict[str, dict[str, int]] = {}
    for view in views:
        count = counts.setdefault(view["role"], {"members": 0, "in_rotation": 0})
        count["members"] += 1
        count["in_rotation"] += view["in_rotation"]
    return counts


@dataclass(frozen=True, slots=True, eq=False)
class HealthReport:
    config: Config
    fleet: Registry
    health: Health
    roster: Roster | None
    discovery: Discovery | None

    def answer(self, names_backends: bool = True) -> tuple[int, dict[str, Any]]:
        """The status and the body of /health."""
        views = self.health.snapshot(self.fleet.all())
        body: dict[str, Any] = {"proxy": "healthy"}
        stages = {
            key: stage_status([view["in_rotation"] for view in views if view["role"] in _SERVING_ROLES[stage]])
            for stage, key in CLUSTER_KEYS.items()
        }
        dynamic = self.config.dynamic_registration
        status = 200 if dynamic or not self._down(stages) else 503
        if not names_backends:
            return status, {**body, **stages, "roles": role_counts(views)}
        instances = {view["url"]: {k: v for k, v in view.items() if k != "url"} for view in views}
        if dynamic:
            body["instances"] = self.fleet.snapshot(self.health.in_rotation)
            body["health"] = instances
            if self.roster is not None:
                # Reported, not fatal: routing goes on from the last roster read while the store is away.
                body["roster"] = self.roster.status()
        else:
            body.update(stages)
            body["instances"] = instances
        if self.discovery is not None:
            body["dns"] = self.discovery.status()  # reported, not fatal
        return status, body

    def _down(self, stages: dict[str, str]) -> bool:
        config = self.config
        # Only a DNS name can leave a stage it names empty: that stage cannot serve either.
        configured = {ENCODE: config.encode_urls, PREFILL: config.prefill_urls, DECODE: config.decode_urls}
        return any(
            stages[key] == "unhealthy" or (stages[key] == "empty" and configured[stage])
            for stage, key in CLUSTER_KEYS.items()
        )
