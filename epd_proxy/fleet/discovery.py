"""Instances found through DNS: a role's URL flag may name `dns://host:port` (A and AAAA records,
every address on that port) or `dns+srv://name` (SRV records, which carry each target's port), as
a Kubernetes headless Service, Consul or Nomad publish them.

Each name is resolved every `--dns-refresh` seconds, and sooner when one of its instances fails
(a transport failure or a failed check: the address may be gone) or its last resolution failed.
The addresses found become registry members exactly as registrations do (health, ejection,
metrics, `/status`, the registry's rules for roles), owned by the name: an address that no
longer resolves leaves the fleet, so routing picks it no more while the calls already under way
finish. An answer saying the name has no addresses (NXDOMAIN, or no records: a Service scaled to
zero) empties the set; only a resolution that got no answer (timeout, SERVFAIL, refused) keeps the
last good set, and `/health` and `/metrics` say so.

SRV priorities and weights are not used: every target is a member and the role's routing policy
balances them. Each process (worker, replica) resolves on its own, as each judges health on its own.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from epd_proxy.addresses import is_dns, split_server
from epd_proxy.config import Config, ConfigError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.registry import Registry

log = logging.getLogger("epd_proxy.discovery")

# Longest a resolution may take (every search domain and server tried); then it failed.
LIFETIME_S = 3.0
# After a failed resolution the next comes this soon, doubling up to --dns-refresh.
FIRST_RETRY_S = 0.5
# Instance failures re-resolve at most this often per name (a dead instance fails many requests).
MIN_GAP_S = 1.0


class ResolutionFailed(Exception):
    """No answer from DNS: the last good set stays."""


@dataclass(frozen=True, slots=True)
class DnsName:
    entry: str  # as given: dns://host:port or dns+srv://name
    role: str
    host: str
    port: int | None  # None: SRV records give the ports


def dns_names(config: Config) -> list[DnsName]:
    """The DNS names among the URL flags, with the role the flag gives (as Registry.from_config)."""
    decode_role = DECODE if config.prefill_urls else PREFILL_DECODE
    out = []
    for role, entries in (
        (ENCODE, config.encode_urls),
        (PREFILL, config.prefill_urls),
        (decode_role, config.decode_urls),
    ):
        for entry in entries:
            if is_dns(entry):
                parts = urlsplit(entry)
                out.append(DnsName(entry, role, parts.hostname or "", parts.port))
    return out


def backend_url(address: str, port: int) -> str:
    ip = ipaddress.ip_address(address)
    host = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
    return f"http://{host}:{port}"


class Client(Protocol):
    """What discovery asks DNS; both raise ResolutionFailed when there is no answer."""

    async def addresses(self, host: str) -> list[str]:
        """A and AAAA records of `host`; [] when it has none."""
        ...

    async def services(self, name: str) -> list[tuple[str, int, list[str] | None]]:
        """SRV records of `name`: (target, port, its addresses when the answer carried them)."""
        ...


class DnsClient:
    """dnspython's asyncio resolver, without a cache: every resolution asks the server."""

    def __init__(self, server: str = "") -> None:
        import dns.asyncresolver
        import dns.resolver

        self._dns = dns
        try:
            # The system's configuration, for its search domains and ndots (short Kubernetes names).
            resolver = dns.asyncresolver.Resolver(configure=True)
        except dns.resolver.NoResolverConfiguration:
            if not server:
                raise ConfigError(
                    "a dns:// name needs a DNS server: /etc/resolv.conf has none; give --dns-server"
                ) from None
            resolver = dns.asyncresolver.Resolver(configure=False)
        if server:
            address, port = split_server(server)
            resolver.nameservers = [address]
            resolver.port = port
        resolver.use_search_by_default = True
        resolver.lifetime = LIFETIME_S
        resolver.cache = None
        self._resolver = resolver

    async def _query(self, name: str, rdtype: str) -> Any | None:
        """The answer, or None when DNS says there is no such record (NXDOMAIN, NODATA)."""
        dns = self._dns
        try:
            return await self._resolver.resolve(name, rdtype)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None
        except dns.exception.Timeout:
            raise ResolutionFailed(f"{rdtype} {name}: no answer within {LIFETIME_S:g}s") from None
        except dns.exception.DNSException as exc:
            raise ResolutionFailed(f"{rdtype} {name}: {type(exc).__name__}: {exc}") from None

    async def addresses(self, host: str) -> list[str]:
        answers = await asyncio.gather(self._query(host, "A"), self._query(host, "AAAA"))
        return [record.address for answer in answers if answer is not None for record in answer]

    async def services(self, name: str) -> list[tuple[str, int, list[str] | None]]:
        answer = await self._query(name, "SRV")
        if answer is None:
            return []
        # Addresses in the additional section (CoreDNS and Consul send them) save a query per target.
        extra: dict[str, list[str]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in (self._dns.rdatatype.A, self._dns.rdatatype.AAAA):
                extra.setdefault(rrset.name.to_text(), []).extend(record.address for record in rrset)
        out = []
        for record in answer:
            target = record.target.to_text()
            if target == ".":
                continue  # "the service is decidedly not available at this domain" (RFC 2782)
            out.append((target, record.port, extra.get(target)))
        return out


async def resolve(client: Client, name: DnsName) -> list[str]:
    """The backend URLs the name stands for now, sorted (every process orders them alike)."""
    if name.port is not None:
        urls = {backend_url(address, name.port) for address in await client.addresses(name.host)}
    else:
        services = await client.services(name.host)
        found = await asyncio.gather(
            *(client.addresses(target) if known is None else _given(known) for target, _, known in services)
        )
        urls = {backend_url(address, port) for (_, port, _), addresses in zip(services, found) for address in addresses}
    return sorted(urls)


async def _given(addresses: list[str]) -> list[str]:
    return addresses


@dataclass(slots=True)
class _State:
    name: DnsName
    urls: list[str] = field(default_factory=list)
    ok: bool | None = None  # None: not resolved yet
    error: str | None = None
    last_success: float | None = None
    last_attempt: float | None = None
    failures_in_a_row: int = 0
    left_out: dict[str, str] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    first: asyncio.Event = field(default_factory=asyncio.Event)


class Discovery:
    def __init__(
        self,
        names: Sequence[DnsName],
        fleet: Registry,
        client: Client,
        *,
        refresh_s: float,
        dp_size: int = 1,
        on_failure: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._states = {name.entry: _State(name) for name in names}
        self._fleet = fleet
        self._client = client
        self.refresh_s = refresh_s
        self._dp_size = dp_size
        self._on_failure = on_failure
        self._clock = clock
        self._tasks: list[asyncio.Task] = []

    @classmethod
    def from_config(cls, config: Config, fleet: Registry, on_failure: Callable[[str], None]) -> Discovery | None:
        names = dns_names(config)
        if not names:
            return None
        return cls(
            names,
            fleet,
            DnsClient(config.dns_server),
            refresh_s=config.dns_refresh_s,
            dp_size=config.ec_consumer_dp_size,
            on_failure=on_failure,
        )

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self, first_timeout_s: float = LIFETIME_S + 1.0) -> None:
        """Resolve every name in the background; wait for the first answers (a proxy starts with
        its fleet), but start anyway when DNS does not answer: /health says so."""
        self._tasks = [
            asyncio.create_task(self._follow(state), name=f"dns {entry}") for entry, state in self._states.items()
        ]
        waits = [asyncio.create_task(state.first.wait()) for state in self._states.values()]
        _, pending = await asyncio.wait(waits, timeout=first_timeout_s)
        for task in pending:
            task.cancel()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def unreachable(self, inst: Instance) -> None:
        """Health's news of a failed call or check: ask DNS again whether the address is still there."""
        state = self._states.get(self._fleet.source(inst.url) or "")
        if state is not None:
            state.wake.set()

    # -- resolving -----------------------------------------------------------------------------------
    async def _follow(self, state: _State) -> None:
        retry = FIRST_RETRY_S
        min_gap = min(MIN_GAP_S, self.refresh_s)
        while True:
            state.wake.clear()
            await self.resolve_now(state.name.entry)
            if state.ok:
                delay, retry = self.refresh_s, FIRST_RETRY_S
            else:
                delay, retry = min(retry, self.refresh_s), min(retry * 2, self.refresh_s)
            try:
                async with asyncio.timeout(delay):
                    await state.wake.wait()
            except TimeoutError:
                continue
            gap = min_gap - (self._clock() - (state.last_attempt or 0.0))
            if gap > 0:
                await asyncio.sleep(gap)

    async def resolve_now(self, entry: str) -> None:
        """One resolution of the name, and membership made to match it."""
        state = self._states[entry]
        name = state.name
        state.last_attempt = self._clock()
        try:
            urls = await resolve(self._client, name)
        except ResolutionFailed as exc:
            state.ok, state.error = False, str(exc)
            state.failures_in_a_row += 1
            if state.failures_in_a_row == 1:
                log.warning("%s: resolution failed (%s); keeping the last %d addresses", entry, exc, len(state.urls))
            if self._on_failure is not None:
                self._on_failure(entry)
            return
        finally:
            state.first.set()
        if state.failures_in_a_row:
            log.warning("%s resolves again after %d failures: %d addresses", entry, state.failures_in_a_row, len(urls))
        state.ok, state.error, state.failures_in_a_row = True, None, 0
        state.last_success = self._clock()
        left_out = self._fleet.discovered(
            entry, name.role, urls, self._dp_size if name.role in (DECODE, PREFILL_DECODE) else 1
        )
        for url, why in left_out.items():
            if state.left_out.get(url) != why:
                log.warning("%s resolves to %s, left out of the fleet: %s", entry, url, why)
        state.urls, state.left_out = urls, left_out

    # -- reporting -----------------------------------------------------------------------------------
    def names(self) -> Iterable[str]:
        return self._states.keys()

    def status(self) -> dict[str, dict[str, Any]]:
        """Per name, for /health: `ok`, `failing` (serving the last good set) or `pending`."""
        now = self._clock()
        out = {}
        for entry, state in self._states.items():
            since = None if state.last_success is None else round(now - state.last_success, 3)
            view: dict[str, Any] = {
                "role": state.name.role,
                "status": "pending" if state.ok is None else "ok" if state.ok else "failing",
                "addresses": state.urls,
                "seconds_since_success": since,
            }
            if state.error is not None:
                view["error"] = state.error
            if state.left_out:
                view["left_out"] = state.left_out
            out[entry] = view
        return out

    def figures(self) -> Iterable[tuple[str, bool, int, float | None]]:
        """(name, last resolution succeeded, addresses, seconds since the last success) for /metrics."""
        now = self._clock()
        for entry, state in self._states.items():
            since = None if state.last_success is None else now - state.last_success
            yield entry, bool(state.ok), len(state.urls), since
