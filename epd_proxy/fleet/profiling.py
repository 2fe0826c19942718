"""/start_profile and /stop_profile: every instance in rotation, concurrently (the reference picked
one at random per stage), answered per stage as the reference does."""

from __future__ import annotations

import asyncio
from typing import Any

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream, bearer
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry

PROFILE_TIMEOUTS = Timeouts(total=30)


class Profiling:
    def __init__(self, fleet: Registry, health: Health, upstream: Upstream, *, api_key: str, by_role: bool) -> None:
        self._fleet = fleet
        self._health = health
        self._upstream = upstream
        self._headers = {"Content-Type": "application/json", **bearer(api_key)}
        # Static mode answers in the reference's shape (encode/prefill/decode); dynamic mode by role.
        self._by_role = by_role

    async def fan_out(self, action: str, payload: bytes) -> dict[str, Any]:
        """Each instance's answer under its stage (None for a stage where none has profiling on);
        503 when no instance has it on."""
        everyone = [inst for inst in self._fleet.all() if self._health.in_rotation(inst)]
        results = await asyncio.gather(*(self._one(inst, action, payload) for inst in everyone))
        out: dict[str, Any] = {} if self._by_role else {ENCODE: None, PREFILL: None, DECODE: None}
        for inst, result in zip(everyone, results):
            key = inst.role if self._by_role or inst.role != PREFILL_DECODE else DECODE
            out.setdefault(key, None)
            if result is not None:
                out[key] = {**(out[key] or {}), inst.url: result}
        if all(v is None for v in out.values()):
            raise ProxyError(503, "Profiling endpoints are disabled on all clusters", stage="profile")
        return out

    async def _one(self, instance: Instance, action: str, payload: bytes) -> dict[str, Any] | None:
        try:
            answer = await self._upstream.call(
                instance,
                "POST",
                f"/{action}",
                body=payload,
                headers=self._headers,
                timeouts=PROFILE_TIMEOUTS,
                stage="profile",
                what=action,
                count_inflight=False,
            )
        except NoAnswer as exc:
            return {"status": None, "error": exc.message}
        if answer.status == 404:
            return None  # vLLM without --profiler-config has no such route: not enabled
        return {"status": answer.status, "body": answer.body.decode("utf-8", "replace")}
