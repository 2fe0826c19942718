"""Who is in the fleet and who is live: static lists or dynamic registration, plus health probing.

Static flags and `POST /instances` fill the same registry, so routing, eviction and revival work
identically in both modes. An instance leaves the rotation after `fail_threshold` consecutive
failures (probes, or transport failures on live traffic) and rejoins on its first success.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from epd_proxy.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, ROLES, Instance
from epd_proxy.config import Config, ConfigError
from epd_proxy.errors import ProxyError
from epd_proxy.upstream import Timeouts, Upstream, UpstreamFailure

log = logging.getLogger("epd_proxy.registry")


class RegistryError(ProxyError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, stage="registry", error_type="registration_error")


def normalize_url(url: Any) -> str:
    if not isinstance(url, str):
        raise RegistryError(422, "'url' must be a string")
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RegistryError(422, f"'url' must be an http(s) URL with a host, got {url!r}")
    try:
        _ = parts.port  # urlsplit validates the port lazily
    except ValueError:
        raise RegistryError(422, f"'url' has an invalid port: {url!r}") from None
    return url


class Registry:
    def __init__(
        self,
        *,
        dynamic: bool,
        fail_threshold: int = 3,
        evicted_ttl_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dynamic = dynamic
        self.fail_threshold = fail_threshold
        self.evicted_ttl_s = evicted_ttl_s
        self._clock = clock
        self._records: dict[str, Instance] = {}
        self._live: dict[str, list[Instance]] = {role: [] for role in ROLES}

    @classmethod
    def from_config(cls, config: Config) -> Registry:
        registry = cls(
            dynamic=config.dynamic_registration,
            fail_threshold=config.fail_threshold,
            evicted_ttl_s=config.evicted_ttl_s,
        )
        if config.dynamic_registration:
            return registry
        dp, addrs = config.ec_consumer_dp_size, config.ec_consumer_zmq_addrs
        static = [Instance(url, ENCODE) for url in config.encode_urls]
        if config.prefill_urls:
            # The static replica flags describe the servers listed in --decode-servers-urls, so
            # the reference pins (and names in X-data-parallel-rank) a decode replica even in
            # E+P+D; Mooncake push, which would need the prefill's, is E+PD only (see Config).
            static += [Instance(url, PREFILL) for url in config.prefill_urls]
            static += [Instance(url, DECODE, dp_size=dp) for url in config.decode_urls]
        else:
            static += [
                Instance(url, PREFILL_DECODE, zmq_addrs=tuple(addrs[i * dp : (i + 1) * dp]), dp_size=dp)
                for i, url in enumerate(config.decode_urls)
            ]
        for inst in static:
            if inst.url in registry._records:
                raise ConfigError(f"{inst.url} is listed twice; each instance has one role")
            registry._add(inst)
        return registry

    # -- reading -----------------------------------------------------------------------------------
    def live(self, role: str) -> list[Instance]:
        return self._live[role]

    def candidates(self, role: str) -> list[Instance]:
        """Live instances of a role. In static mode, when all of them are evicted, all of them:
        the operator listed them, and trying one beats refusing every request until the next
        probe; dynamic mode answers 503 instead, as the reference does."""
        live = self._live[role]
        if live or self.dynamic:
            return live
        return [inst for inst in self._records.values() if inst.role == role]

    def decoders(self) -> list[Instance]:
        """Where a request's answer comes from: combined PD instances first, else split decoders."""
        return self.candidates(PREFILL_DECODE) or self.candidates(DECODE)

    def all(self) -> Iterable[Instance]:
        return self._records.values()

    def snapshot(self) -> dict[str, dict[str, list[str]]]:
        out: dict[str, dict[str, list[str]]] = {role: {"live": [], "evicted": []} for role in ROLES}
        for inst in self._records.values():
            out[inst.role]["live" if inst.live else "evicted"].append(inst.url)
        return out

    def _rebuild(self) -> None:
        live: dict[str, list[Instance]] = {role: [] for role in ROLES}
        for inst in self._records.values():
            if inst.live:
                live[inst.role].append(inst)
        self._live = live

    def _add(self, inst: Instance) -> None:
        self._records[inst.url] = inst
        self._rebuild()

    # -- dynamic registration --------------------------------------------------------------------
    def register(self, payload: Any) -> bool:
        """Validate like the reference proxy; True if the URL is new."""
        if not isinstance(payload, dict):
            raise RegistryError(422, "registration body must be a JSON object")
        role = payload.get("role")
        if role not in ROLES:
            raise RegistryError(422, f"'role' must be one of {list(ROLES)}, got {role!r}")
        url = normalize_url(payload.get("url"))
        dp_size = payload.get("dp_size", 1)
        if type(dp_size) is not int or dp_size < 1:
            raise RegistryError(422, f"'dp_size' must be an integer >= 1, got {dp_size!r}")
        zmq = payload.get("ec_zmq_addrs", [])
        if not isinstance(zmq, list) or not all(isinstance(a, str) and a for a in zmq):
            raise RegistryError(422, "'ec_zmq_addrs' must be a list of addresses")
        if zmq and len(zmq) != dp_size:
            raise RegistryError(422, f"'ec_zmq_addrs' needs one address per DP replica ({dp_size}), got {len(zmq)}")
        if zmq and role not in (PREFILL, PREFILL_DECODE):
            raise RegistryError(
                400, f"'ec_zmq_addrs' belongs to an EC consumer (prefill or prefill_decode), not {role}"
            )
        existing = self._records.get(url)
        if existing is not None and existing.role != role:
            raise RegistryError(409, f"{url} is registered as {existing.role}; unregister it first")
        roles_present = {inst.role for inst in self._records.values() if inst is not existing}
        if role == PREFILL_DECODE and roles_present & {PREFILL, DECODE}:
            raise RegistryError(409, "cannot mix prefill_decode with standalone prefill/decode instances")
        if role in (PREFILL, DECODE) and PREFILL_DECODE in roles_present:
            raise RegistryError(409, f"cannot mix standalone {role} with prefill_decode instances")
        record = (tuple(zmq), dp_size)
        if existing is not None:
            if (existing.zmq_addrs, existing.dp_size) != record:
                # Same role, new details: update in place so health state and in-flight counts survive.
                existing.zmq_addrs, existing.dp_size = record
            return False
        self._add(Instance(url, role, zmq_addrs=tuple(zmq), dp_size=dp_size))
        log.info("registered %s as %s", url, role)
        return True

    def unregister(self, url: Any) -> bool:
        url = normalize_url(url)
        inst = self._records.pop(url, None)
        if inst is None:
            return False
        inst.removed = True
        self._rebuild()
        log.info("unregistered %s", url)
        return True

    # -- health --------------------------------------------------------------------------------------
    def record_success(self, inst: Instance) -> None:
        inst.consecutive_failures = 0
        if not inst.live and not inst.removed:
            inst.live = True
            inst.evicted_at = None
            self._rebuild()
            log.warning("%s %s is back in rotation", inst.role, inst.url)

    def record_failure(self, inst: Instance, reason: str) -> None:
        inst.consecutive_failures += 1
        if inst.live and inst.consecutive_failures >= self.fail_threshold:
            inst.live = False
            inst.evicted_at = self._clock()
            self._rebuild()
            log.warning(
                "%s %s left the rotation after %d consecutive failures (last: %s)",
                inst.role,
                inst.url,
                inst.consecutive_failures,
                reason,
            )

    def forget_expired(self) -> None:
        if not self.dynamic or self.evicted_ttl_s <= 0:
            return
        now = self._clock()
        for url, inst in list(self._records.items()):
            if inst.evicted_at is not None and now - inst.evicted_at > self.evicted_ttl_s:
                del self._records[url]
                inst.removed = True
                log.info("forgot %s %s: evicted for more than %gs", inst.role, url, self.evicted_ttl_s)

    async def probe_once(self, upstream: Upstream, timeout_s: float) -> None:
        records = list(self._records.values())
        results = await asyncio.gather(*(probe(upstream, inst, timeout_s) for inst in records))
        for inst, problem in zip(records, results):
            if inst.removed or self._records.get(inst.url) is not inst:
                continue  # replaced or unregistered while the probe was in flight
            if problem is None:
                self.record_success(inst)
            else:
                self.record_failure(inst, problem)
        self.forget_expired()

    async def probe_forever(self, upstream: Upstream, interval_s: float, timeout_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.probe_once(upstream, timeout_s)
            except Exception:  # a probe round must never kill the prober
                log.exception("health probe round failed")


async def probe(upstream: Upstream, inst: Instance, timeout_s: float) -> str | None:
    """None when healthy, else why not."""
    try:
        answer = await upstream.call(
            inst,
            "GET",
            "/health",
            timeouts=Timeouts(connect=timeout_s, total=timeout_s),
            stage="probe",
            what="Health probe",
            count_inflight=False,
        )
    except UpstreamFailure as failure:
        return failure.reason
    return None if answer.status == 200 else f"HTTP {answer.status}"


def check_admin_key(
    expected: str, presented: str | None, action: str = "change the fleet", stage: str = "registry"
) -> None:
    if (
        not expected
        or presented is None
        or not hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))
    ):
        hint = "" if expected else " (the proxy has no ADMIN_API_KEY set)"
        raise ProxyError(403, f"a valid X-API-Key is required to {action}{hint}", stage=stage, error_type="forbidden")
