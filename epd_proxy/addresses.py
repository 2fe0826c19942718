"""How `serve` is told where its instances are: comma lists of URLs or DNS names, and the DNS
server to ask. Option kinds (options.py) and the checks behind them, so that a typo is a usage
error at startup, not a failure on the first request."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from epd_proxy.options import Kind

# A role's instances found through DNS (discovery.py): `dns://host:port` (A and AAAA records, one
# port for all) or `dns+srv://name` (SRV records, which carry the ports).
DNS_SCHEMES = ("dns", "dns+srv")

_DISABLED_PREFILL = {"", "none", "disable", "disabled"}


def is_dns(entry: str) -> bool:
    return entry.split("://", 1)[0] in DNS_SCHEMES


def dns_problem(entry: str) -> str | None:
    parts = urlsplit(entry)
    try:
        port = parts.port
    except ValueError:
        return f"{entry!r} has an invalid port"
    if not parts.hostname or parts.path or parts.query or parts.fragment or parts.username:
        return f"{entry!r} is not a DNS name: dns://host:port or dns+srv://name"
    if parts.scheme == "dns" and port is None:
        return f"{entry!r} needs a port (dns://host:port), or SRV records that carry one (dns+srv://name)"
    if parts.scheme == "dns+srv" and port is not None:
        return f"{entry!r}: SRV records carry the ports; drop :{port}"
    return None


def split_server(text: str) -> tuple[str, int]:
    """`--dns-server`: an IP address with an optional port (53), IPv6 in brackets."""
    parts = urlsplit(f"//{text}")
    host, port = parts.hostname, parts.port or 53  # ValueError on a bad port
    try:
        ipaddress.ip_address(host or "")
    except ValueError:
        raise ValueError(f"must be an IP address with an optional :port, got {text!r}") from None
    return host, port


def split_urls(value: str | None) -> tuple[str, ...]:
    if value is None or value.strip().lower() in _DISABLED_PREFILL:
        return ()
    return tuple(url.strip().rstrip("/") for url in value.split(",") if url.strip())


@dataclass(frozen=True)
class Server(Kind):
    metavar: ClassVar[str] = "IP[:PORT]"

    def problem(self, value: str) -> str | None:
        try:
            _ = value and split_server(value)
        except ValueError as exc:
            return str(exc)
        return None


@dataclass(frozen=True)
class CommaList(Kind):
    """A comma list; `none`, `disable` or empty is the empty list."""

    http_urls: bool = True
    metavar: ClassVar[str] = "URLS"

    def parse(self, text: str) -> tuple[str, ...]:
        return split_urls(text)

    def problem(self, value: tuple[str, ...]) -> str | None:
        # Here so that a typo is a usage error at startup, not a failure on the first request.
        for url in value if self.http_urls else ():
            if is_dns(url):
                if problem := dns_problem(url):
                    return problem
                continue
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                return f"{url!r} is not an http:// or https:// URL with a host"
            try:
                _ = parts.port
            except ValueError:
                return f"{url!r} has an invalid port"
        return None
