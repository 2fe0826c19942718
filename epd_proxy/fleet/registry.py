"""Who is in the fleet: static lists or dynamic registration, and nothing about their health.

Static flags, `POST /instances` and DNS names (discovery.py) fill the same registry, so everything
downstream works the same whichever way an instance joined. Each member has one source, which alone
may remove it: a listed URL stays, a registration leaves through `DELETE /instances` (or the shared
roster), a DNS-found address when its name stops resolving to it. Health (health.py) and metrics
hear about joins and departures as watchers; which members may take traffic right now is health's
call, never the registry's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from epd_proxy.addresses import is_dns
from epd_proxy.config import Config
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, ROLES, Instance

log = logging.getLogger("epd_proxy.registry")

# Where a member came from; a DNS name's members have the name itself (`dns://...`) as source.
LISTED, REGISTERED = "listed", "registered"


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


@dataclass(frozen=True, slots=True)
class Record:
    """What a registration says about an instance: membership only, no health."""

    url: str
    role: str
    zmq_addrs: tuple[str, ...] = ()
    dp_size: int = 1
    # Registration order in a shared roster, so every process rotates over instances alike.
    seq: int = 0
    # Changes with every registration of the URL, so every process sees a re-registration.
    gen: int = 0

    def instance(self) -> Instance:
        return Instance(self.url, self.role, zmq_addrs=self.zmq_addrs, dp_size=self.dp_size)


def parse_registration(payload: Any) -> Record:
    """A `POST /instances` body, validated like the reference proxy."""
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
        raise RegistryError(400, f"'ec_zmq_addrs' belongs to an EC consumer (prefill or prefill_decode), not {role}")
    return Record(url, role, tuple(zmq), dp_size)


def check_fits(record: Record, members: Mapping[str, Record | Instance]) -> None:
    """409 when the record clashes with the fleet: another role for a known URL, or prefill_decode
    mixed with standalone prefill/decode (members out of rotation count too, as in the reference)."""
    existing = members.get(record.url)
    if existing is not None and existing.role != record.role:
        raise RegistryError(409, f"{record.url} is registered as {existing.role}; unregister it first")
    roles_present = {m.role for url, m in members.items() if url != record.url}
    if record.role == PREFILL_DECODE and roles_present & {PREFILL, DECODE}:
        raise RegistryError(409, "cannot mix prefill_decode with standalone prefill/decode instances")
    if record.role in (PREFILL, DECODE) and PREFILL_DECODE in roles_present:
        raise RegistryError(409, f"cannot mix standalone {record.role} with prefill_decode instances")


class Watcher(Protocol):
    """Told about membership changes (health, metrics): the registry itself knows nothing of health."""

    def joined(self, inst: Instance) -> None: ...

    def rejoined(self, inst: Instance) -> None: ...

    def left(self, inst: Instance) -> None: ...


class Registry:
    def __init__(self, *, dynamic: bool) -> None:
        self.dynamic = dynamic
        self._instances: dict[str, Instance] = {}
        self._members: dict[str, list[Instance]] = {role: [] for role in ROLES}
        self._watchers: list[Watcher] = []
        # Shared roster only: each member's registration generation last read (see sync).
        self._generations: dict[str, int] = {}
        self._sources: dict[str, str] = {}

    @classmethod
    def from_config(cls, config: Config) -> Registry:
        registry = cls(dynamic=config.dynamic_registration)
        if config.dynamic_registration:
            return registry  # DNS names only (the Config refuses listed URLs), found by discovery.py
        dp, addrs = config.ec_consumer_dp_size, config.ec_consumer_zmq_addrs
        static = [Instance(url, ENCODE) for url in config.encode_urls if not is_dns(url)]
        decode_urls = [url for url in config.decode_urls if not is_dns(url)]
        if config.prefill_urls:
            # The static replica flags describe the servers listed in --decode-servers-urls, so
            # the reference pins (and names in X-data-parallel-rank) a decode replica even in
            # E+P+D; Mooncake push, which would need the prefill's, is E+PD only (see Config).
            static += [Instance(url, PREFILL) for url in config.prefill_urls if not is_dns(url)]
            static += [Instance(url, DECODE, dp_size=dp) for url in decode_urls]
        else:
            static += [
                Instance(url, PREFILL_DECODE, zmq_addrs=tuple(addrs[i * dp : (i + 1) * dp]), dp_size=dp)
                for i, url in enumerate(decode_urls)
            ]
        for inst in static:  # Config's check_topology refused a URL listed twice
            registry._add(inst, LISTED)
        return registry

    def watch(self, watcher: Watcher) -> None:
        """Subscribe to membership changes; the current members are reported as joining."""
        self._watchers.append(watcher)
        for inst in self._instances.values():
            watcher.joined(inst)

    # -- reading -----------------------------------------------------------------------------------
    def members(self, role: str) -> list[Instance]:
        return self._members[role]

    def all(self) -> Iterable[Instance]:
        return self._instances.values()

    def source(self, url: str) -> str | None:
        """Who added the member and alone may remove it: LISTED, REGISTERED or a DNS name."""
        return self._sources.get(url)

    def registered(self) -> list[Instance]:
        return [inst for url, inst in self._instances.items() if self._sources[url] == REGISTERED]

    def snapshot(self, in_rotation: Callable[[Instance], bool]) -> dict[str, dict[str, list[str]]]:
        """The reference's roster shape; `in_rotation` is health's verdict, not the registry's."""
        out: dict[str, dict[str, list[str]]] = {role: {"live": [], "evicted": []} for role in ROLES}
        for inst in self._instances.values():
            out[inst.role]["live" if in_rotation(inst) else "evicted"].append(inst.url)
        return out

    def _rebuild(self) -> None:
        members: dict[str, list[Instance]] = {role: [] for role in ROLES}
        for inst in self._instances.values():
            members[inst.role].append(inst)
        self._members = members

    def _add(self, inst: Instance, source: str) -> None:
        self._instances[inst.url] = inst
        self._sources[inst.url] = source
        self._rebuild()
        for watcher in self._watchers:
            watcher.joined(inst)

    # -- dynamic registration --------------------------------------------------------------------
    def register(self, payload: Any) -> bool:
        """Validate like the reference proxy; True if the URL is new."""
        record = parse_registration(payload)
        self.check_registrable(record.url, "registered")
        check_fits(record, self._instances)
        existing = self._instances.get(record.url)
        if existing is not None:
            if (existing.zmq_addrs, existing.dp_size) != (record.zmq_addrs, record.dp_size):
                # Same role, new details: update in place so in-flight counts survive.
                existing.zmq_addrs, existing.dp_size = record.zmq_addrs, record.dp_size
            for watcher in self._watchers:
                watcher.rejoined(existing)
            return False
        self._add(record.instance(), REGISTERED)
        log.info("registered %s as %s", record.url, record.role)
        return True

    def check_registrable(self, url: str, action: str) -> None:
        """409 for a member another source owns: it would be back (DNS) or never gone (listed)."""
        source = self._sources.get(url, REGISTERED)
        if source != REGISTERED:
            origin = "listed on the command line" if source == LISTED else f"found through {source}"
            raise RegistryError(409, f"{url} is {origin}; it cannot be {action} through /instances")

    def discovered(self, source: str, role: str, urls: Iterable[str], dp_size: int = 1) -> dict[str, str]:
        """Make the members found through the DNS name `source` the given URLs: new ones join,
        missing ones leave (their calls under way finish, routing no longer picks them). Returns
        the URLs left out and why: a member from another source, or a role conflict (409's rules)."""
        wanted = dict.fromkeys(urls)
        for url, inst in list(self._instances.items()):
            if self._sources[url] == source and url not in wanted:
                self._remove(url)
                log.info("%s: %s %s left", source, inst.role, url)
        refused = {}
        for url in wanted:
            if self._sources.get(url) == source:
                continue
            if url in self._sources:
                refused[url] = f"already a member ({self._instances[url].role}, {self._sources[url]})"
                continue
            try:
                check_fits(Record(url, role), self._instances)
            except RegistryError as exc:
                refused[url] = exc.message
                continue
            self._add(Instance(url, role, dp_size=dp_size), source)
            log.info("%s: %s %s joined", source, role, url)
        return refused

    def sync(self, records: Mapping[str, Record]) -> None:
        """Make membership equal to a shared roster's records (see roster.py). Members that stay
        keep their in-flight counts and, through the watchers, their local health state."""
        for url, listed in list(self._instances.items()):
            record = records.get(url)
            if self._sources[url] != REGISTERED:
                continue
            if record is None or record.role != listed.role:
                self._remove(url)
                self._generations.pop(url, None)
                log.info("roster: %s %s left", listed.role, url)
        for record in sorted(records.values(), key=lambda r: r.seq):
            inst = self._instances.get(record.url)
            seen = self._generations.get(record.url)
            self._generations[record.url] = record.gen
            if inst is not None and self._sources[record.url] != REGISTERED:
                continue  # a DNS name found it too: this process keeps it as the name's
            if inst is None:
                self._add(record.instance(), REGISTERED)
                log.info("roster: %s %s joined", record.role, record.url)
                continue
            if (inst.zmq_addrs, inst.dp_size) != (record.zmq_addrs, record.dp_size):
                inst.zmq_addrs, inst.dp_size = record.zmq_addrs, record.dp_size
            if seen is not None and seen != record.gen:
                # Registered again through some process: the same news a local re-registration is.
                for watcher in self._watchers:
                    watcher.rejoined(inst)

    def unregister(self, url: Any) -> bool:
        url = normalize_url(url)
        self.check_registrable(url, "unregistered")
        if self._remove(url) is None:
            return False
        log.info("unregistered %s", url)
        return True

    def forget(self, url: str, why: str) -> None:
        if self._sources.get(url) != REGISTERED:
            return  # listed or found through DNS: health keeps it out of rotation, the source decides
        inst = self._remove(url)
        if inst is not None:
            log.info("forgot %s %s: %s", inst.role, url, why)

    def _remove(self, url: str) -> Instance | None:
        inst = self._instances.pop(url, None)
        if inst is None:
            return None
        del self._sources[url]
        self._rebuild()
        for watcher in self._watchers:
            watcher.left(inst)
        return inst
