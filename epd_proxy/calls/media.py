"""Media behind http(s) URLs, fetched by the proxy so that encoder and consumer get the same bytes.

A client's URL is an untrusted address the proxy would call from inside the fleet's network, so
every hop is checked where it lands, not where its name points: an address literal before the
hop, a name's every resolved address in the resolver the connections use (so a name that resolves
to a private address, or re-resolves to one later, is never connected to), and each redirect's
target like the URL itself. Only public addresses are fetched unless the operator allows
networks (`--media-fetch-allow-networks`). Each fetch has one deadline and a size limit, sends no
cookies or credentials, and any failure is the client's 400: a URL that cannot be fetched is bad
input, and no backend saw it.

The origin's answer may be kept by URL while the origin says it stays fresh (HTTP caching's
`max-age`, capped by `--media-fetch-cache-ttl`); without freshness it is asked again each time,
with its validators (a 304 costs no body). A changed image is thus never served from here once
its origin stops calling the old one fresh. A URL being fetched is fetched once for everyone
asking at that moment.

These are calls to the open internet, not to the fleet: aiohttp's client (redirects, TLS,
content codings) rather than the backend layer's lean one; the common case, media sent inline as
`data:` URLs, never comes here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from epd_proxy import __version__
from epd_proxy.addresses import IPNetworks, ip_of
from epd_proxy.errors import BadRequest

REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class FetchRules:
    """The serve flags of the same names (config.py)."""

    timeout_s: float = 30.0
    max_bytes: int = 32 * 1024 * 1024
    # All of one request's media URLs together (--max-body-bytes).
    request_bytes: int = 64 * 1024 * 1024
    max_redirects: int = 5
    allow_networks: IPNetworks = IPNetworks()
    # Empty: any host name.
    allowed_domains: frozenset[str] = frozenset()
    cache_bytes: int = 64 * 1024 * 1024
    cache_ttl_s: float = 60.0

    @classmethod
    def of(cls, config: Any) -> FetchRules:
        return cls(
            timeout_s=config.media_fetch_timeout_s,
            max_bytes=config.media_fetch_max_bytes,
            request_bytes=config.max_body_bytes,
            max_redirects=config.media_fetch_max_redirects,
            allow_networks=config.media_fetch_allow_networks,
            allowed_domains=frozenset(config.allowed_media_domains),
            cache_bytes=config.media_fetch_cache_bytes,
            cache_ttl_s=config.media_fetch_cache_ttl_s,
        )

    def allows(self, address: str) -> bool:
        """Whether the proxy may connect to `address`: a public one, or one the operator allowed."""
        if self.allow_networks.contain(address):
            return True
        ip = ip_of(address)
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.is_site_local or ip in _LOCAL_NAT64:
                return False
            inner = _carried_ipv4(ip)
            if inner is not None:
                return inner.is_global and not inner.is_multicast
        return ip.is_global and not ip.is_multicast


# IPv6 prefixes that lead to an IPv4 host, which is what the connection reaches: the well-known
# NAT64 prefix and IPv4-compatible addresses carry it in their last 32 bits, 6to4 after its
# prefix; Teredo is not global, so it is refused as it stands. A local-use NAT64 prefix
# translates somewhere only its network knows.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def _carried_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip in _NAT64 or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    # The answer's Content-Type without parameters, lower-case; "" when it sent none.
    media_type: str


class _AddressRefused(OSError):
    pass


class _GuardedResolver(AbstractResolver):
    """The system resolver, keeping only the addresses the rules allow: aiohttp connects to what
    this returns, so a name is checked by where it leads on every connection."""

    def __init__(self, rules: FetchRules) -> None:
        self.rules = rules
        self.inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        allowed = [entry for entry in found if self.rules.allows(entry["host"])]
        if not allowed:
            raise _AddressRefused(f"{host} resolves to {found[0]['host'] if found else 'nothing'}")
        return allowed

    async def close(self) -> None:
        await self.inner.close()


@dataclass(slots=True)
class _Kept:
    fetched: Fetched
    # time.monotonic() until which the origin calls it fresh; after it, ask with the validators.
    fresh_until: float
    etag: str | None
    last_modified: str | None


def _lifetime(headers: Any, ttl_s: float) -> float | None:
    """Seconds the answer may be reused without asking (0: only after revalidating), or None when
    it must not be kept: `no-store`, `private` (the proxy serves every tenant), `Vary: *`."""
    directives: dict[str, str] = {}
    for value in headers.getall("Cache-Control", ()):
        for directive in value.split(","):
            name, _, argument = directive.partition("=")
            directives[name.strip().lower()] = argument.strip().strip('"')
    if "no-store" in directives or "private" in directives or headers.get("Vary", "").strip() == "*":
        return None
    if "no-cache" in directives:
        return 0.0
    try:
        max_age = float(directives.get("s-maxage") or directives.get("max-age") or 0)
        age = float(headers.get("Age") or 0)
    except ValueError:
        return 0.0
    return max(0.0, min(max_age - age, ttl_s))


PER_HOST = 16


class MediaFetcher:
    """Fetches for the whole server: one client session, one cache, the fetches under way."""

    def __init__(self, rules: FetchRules) -> None:
        self.rules = rules
        self._session: aiohttp.ClientSession | None = None
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._kept_bytes = 0
        self._under_way: dict[str, asyncio.Task[Fetched]] = {}

    async def fetch(self, url: str) -> Fetched:
        """The bytes behind `url`, or a BadRequest saying why there are none."""
        task = self._under_way.get(url)
        if task is None:
            task = asyncio.ensure_future(self._fetch(url))
            self._under_way[url] = task
            task.add_done_callback(lambda done: self._settled(url, done))
        # One asker's disconnect must not cancel the fetch the others wait for.
        return await asyncio.shield(task)

    def _settled(self, url: str, task: asyncio.Task[Fetched]) -> None:
        if self._under_way.get(url) is task:
            del self._under_way[url]
        if not task.cancelled():
            task.exception()  # retrieved here, so a fetch whose askers all left logs nothing

    async def close(self) -> None:
        for task in list(self._under_way.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # One slow origin holds at most a few of the process's connections.
                connector=aiohttp.TCPConnector(resolver=_GuardedResolver(self.rules), limit_per_host=PER_HOST),
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": f"epd-proxy/{__version__}"},
                trust_env=False,
            )
        return self._session

    async def _fetch(self, url: str) -> Fetched:
        kept = self._kept.get(url)
        now = time.monotonic()
        if kept is not None and kept.fresh_until > now:
            self._kept.move_to_end(url)
            return kept.fetched
        try:
            async with asyncio.timeout(self.rules.timeout_s):
                return await self._get(url, kept)
        except TimeoutError:
            raise BadRequest(f"media URL {_short(url)} was not fetched within {self.rules.timeout_s:g} s") from None
        except _AddressRefused as exc:
            raise _refused(url, str(exc)) from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, _AddressRefused):
                raise _refused(url, str(exc.os_error)) from None
            raise BadRequest(f"media URL {_short(url)} could not be fetched: {exc.os_error}") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise BadRequest(f"media URL {_short(url)} could not be fetched: {type(exc).__name__}: {exc}") from None

    async def _get(self, url: str, kept: _Kept | None) -> Fetched:
        target = URL(url)
        headers: dict[str, str] = {}
        if kept is not None and kept.etag:
            headers["If-None-Match"] = kept.etag
        if kept is not None and kept.last_modified:
            headers["If-Modified-Since"] = kept.last_modified
        for _ in range(self.rules.max_redirects + 1):
            self._check_target(target, url)
            async with self._client().get(target, headers=headers, allow_redirects=False) as answer:
                if answer.status in REDIRECTS and "Location" in answer.headers:
                    target = answer.url.join(URL(answer.headers["Location"]))
                    continue
                if answer.status == 304 and kept is not None:
                    return self._keep(url, kept.fetched, answer.headers)
                if answer.status != 200:
                    raise BadRequest(f"media URL {_short(url)} answered HTTP {answer.status}")
                return self._keep(url, await self._body(url, answer), answer.headers)
        raise BadRequest(f"media URL {_short(url)} redirected more than {self.rules.max_redirects} times")

    def _check_target(self, target: URL, url: str) -> None:
        """Each hop's scheme, host name (`--allowed-media-domains`) and, for an address literal,
        the address; a name's addresses are the resolver's to check."""
        if target.scheme not in ("http", "https") or not target.host:
            raise BadRequest(f"media URL {_short(url)} leads to {_short(str(target))}, not an http(s) URL")
        host = target.host.lower()
        domains = self.rules.allowed_domains
        if domains and host not in domains:
            raise BadRequest(
                f"media URL host {host} is not one of --allowed-media-domains: {', '.join(sorted(domains))}"
            )
        try:
            ipaddress.ip_address(host.partition("%")[0])
        except ValueError:
            return
        if not self.rules.allows(host):
            raise _refused(url, host)

    async def _body(self, url: str, answer: aiohttp.ClientResponse) -> Fetched:
        limit = self.rules.max_bytes
        too_large = BadRequest(f"media URL {_short(url)} holds more than {limit} bytes (--media-fetch-max-bytes)")
        if answer.content_length is not None and answer.content_length > limit:
            raise too_large
        data = bytearray()
        async for chunk in answer.content.iter_chunked(_CHUNK):
            data += chunk
            if len(data) > limit:
                raise too_large
        return Fetched(bytes(data), answer.content_type.lower() if "Content-Type" in answer.headers else "")

    def _keep(self, url: str, fetched: Fetched, headers: Any) -> Fetched:
        """`fetched`, kept while its origin allows (and the cache has room)."""
        old = self._kept.pop(url, None)
        if old is not None:
            self._kept_bytes -= len(old.fetched.data)
        lifetime = _lifetime(headers, self.rules.cache_ttl_s)
        etag, modified = headers.get("ETag"), headers.get("Last-Modified")
        size = len(fetched.data)
        if lifetime is None or not (lifetime or etag or modified) or size > self.rules.cache_bytes // 4:
            return fetched
        self._kept[url] = _Kept(fetched, time.monotonic() + lifetime, etag, modified)
        self._kept_bytes += size
        while self._kept_bytes > self.rules.cache_bytes:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= len(dropped.fetched.data)
        return fetched


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


def _refused(url: str, where: str) -> BadRequest:
    return BadRequest(
        f"media URL {_short(url)} is not allowed: {where} is not a public address "
        "(the operator may allow networks with --media-fetch-allow-networks)"
    )
