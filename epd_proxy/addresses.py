"""How `serve` is told where its instances are: comma lists of URLs or DNS names, and the DNS
server to ask. Option kinds (options.py) and the checks behind them, so that a typo is a usage
error at startup, not a failure on the first request."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import ClassVar, Protocol
from urllib.parse import urlsplit

from epd_proxy.options import ConfigError, Kind

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
    host, port = parts.hostname or "", parts.port or 53  # ValueError on a bad port
    try:
        ipaddress.ip_address(host)
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
    # DNS names (`dns://`, `dns+srv://`) are taken where the registry resolves them.
    dns: bool = True
    metavar: ClassVar[str] = "URLS"

    def parse(self, text: str) -> tuple[str, ...]:
        return split_urls(text)

    def problem(self, value: tuple[str, ...]) -> str | None:
        # Here so that a typo is a usage error at startup, not a failure on the first request.
        for url in value if self.http_urls else ():
            if is_dns(url):
                if not self.dns:
                    return f"{url!r}: give http:// or https:// URLs here, not DNS names"
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


def _comma_words(text: str) -> tuple[str, ...]:
    return tuple(word for word in (w.strip() for w in text.split(",")) if word)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def ip_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address a peer or a resolver names, as it is compared with networks: without an IPv6
    zone, and an IPv4-mapped IPv6 address as its IPv4 one (a dual-stack socket reports IPv4 peers
    so). ValueError if it is not an address."""
    ip = ipaddress.ip_address(address.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True, slots=True)
class IPNetworks:
    """The networks an option names (`Networks`): which peers a gateway header is trusted from,
    which non-public addresses media may be fetched from."""

    networks: tuple[IPNetwork, ...] = ()

    def contain(self, address: str | None) -> bool:
        if not address or not self.networks:
            return False
        try:
            ip = ip_of(address)
        except ValueError:
            return False
        return any(ip.version == network.version and ip in network for network in self.networks)

    def __str__(self) -> str:
        return ",".join(str(network) for network in self.networks)


@dataclass(frozen=True)
class Networks(Kind):
    """A comma list of IP networks in CIDR notation (a bare address is its own /32 or /128)."""

    metavar: ClassVar[str] = "CIDRS"

    def parse(self, text: str) -> IPNetworks:
        networks = []
        for word in _comma_words(text):
            try:
                networks.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                raise ValueError(f"{word!r} is not an IP network (CIDR, such as 127.0.0.0/8 or fd00::/8)") from None
        return IPNetworks(tuple(networks))


@dataclass(frozen=True)
class Hosts(Kind):
    """A comma list of host names, compared without case."""

    metavar: ClassVar[str] = "HOSTS"

    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(word.lower() for word in _comma_words(text))

    def problem(self, value: tuple[str, ...]) -> str | None:
        for host in value:
            if any(c in host for c in "/@: \t"):
                return f"{host!r} is not a host name (no scheme, port or path)"
        return None


class Topology(Protocol):
    """What of `serve`'s options (config.py) says where the instances come from."""

    # Read-only, as a frozen dataclass's fields are.
    @property
    def encode_urls(self) -> tuple[str, ...]: ...
    @property
    def prefill_urls(self) -> tuple[str, ...]: ...
    @property
    def decode_urls(self) -> tuple[str, ...]: ...
    @property
    def ec_consumer_zmq_addrs(self) -> tuple[str, ...]: ...
    @property
    def ec_consumer_dp_size(self) -> int: ...
    @property
    def dynamic_registration(self) -> bool: ...
    @property
    def admin_api_key(self) -> str: ...
    @property
    def roster_url(self) -> str: ...
    @property
    def workers(self) -> int: ...
    @property
    def kv_events_endpoints(self) -> tuple[str, ...]: ...


def check_topology(config: Topology) -> None:
    """The rules across the instance options: listed, found through DNS or registered, never two
    ways at once, and Mooncake consumer addresses that line up with the decode servers."""
    entries = (*config.encode_urls, *config.prefill_urls, *config.decode_urls)
    seen: set[str] = set()
    for entry in entries:
        if entry in seen:
            raise ConfigError(f"{entry} is listed twice; each instance has one role")
        seen.add(entry)
    names = [entry for entry in entries if is_dns(entry)]
    if config.dynamic_registration:
        if len(names) != len(entries) or config.ec_consumer_zmq_addrs:
            # A listed instance could never leave through DELETE /instances: register it instead.
            raise ConfigError(
                "--dynamic-registration takes instances from POST /instances and DNS names, not from listed URLs"
            )
        if not config.admin_api_key:
            raise ConfigError("--dynamic-registration needs ADMIN_API_KEY in the environment")
        if config.workers > 1 and not config.roster_url:
            raise ConfigError("--workers > 1 in dynamic mode needs --roster: each worker would hold its own registry")
    else:
        if not config.decode_urls:
            raise ConfigError("--decode-servers-urls needs at least one URL")
        if not config.encode_urls:
            raise ConfigError("--encode-servers-urls needs at least one URL")
    check_kv_endpoints(config)
    if config.roster_url and not config.dynamic_registration:
        raise ConfigError("--roster holds the dynamic roster: add --dynamic-registration")
    if config.ec_consumer_zmq_addrs:
        if any(is_dns(url) for url in config.decode_urls):
            raise ConfigError(
                "--ec-consumer-zmq-addrs are matched to --decode-servers-urls by position, and a DNS name has no "
                "fixed order or count: list the decode servers, or register them with their ec_zmq_addrs"
            )
        if config.prefill_urls:
            raise ConfigError(
                "Mooncake EC consumer routing (--ec-consumer-zmq-addrs) supports E+PD only: "
                "with a separate prefill stage the consumer is the prefill instance"
            )
        expected = len(config.decode_urls) * config.ec_consumer_dp_size
        if len(config.ec_consumer_zmq_addrs) != expected:
            raise ConfigError(
                f"--ec-consumer-zmq-addrs has {len(config.ec_consumer_zmq_addrs)} addresses; expected "
                f"{expected} (decode servers {len(config.decode_urls)} x dp size {config.ec_consumer_dp_size}, "
                "each server's replicas listed consecutively)"
            )


# -- KV event endpoints (--kv-events-endpoints) ---------------------------------------------------------
def check_kv_endpoints(config: Topology) -> None:
    """One `{host}` template for every consumer, or one entry per listed consumer, prefill
    servers first: a DNS name or a registration has no fixed place in such a list."""
    entries = config.kv_events_endpoints
    if not entries or (len(entries) == 1 and "{host}" in entries[0]):
        return
    consumers = (*config.prefill_urls, *config.decode_urls)
    if config.dynamic_registration or any(is_dns(url) for url in consumers):
        raise ConfigError(
            "--kv-events-endpoints lines up with listed prefill and decode URLs; with DNS names or registration "
            "give one template holding {host}"
        )
    if len(entries) != len(consumers):
        raise ConfigError(
            f"--kv-events-endpoints has {len(entries)} entries; expected {len(consumers)} (the prefill servers, "
            "then the decode servers), or one template holding {host}"
        )


ZMQ_SCHEMES = ("tcp", "ipc")


def split_kv_endpoint(entry: str) -> tuple[str, str | None]:
    """`PUB` or `PUB+REPLAY`: an engine's event endpoint and, after a `+`, its replay endpoint."""
    endpoint, _, replay = entry.partition("+")
    return endpoint, replay or None


def zmq_problem(endpoint: str) -> str | None:
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ZMQ_SCHEMES or not rest:
        return f"{endpoint!r} is not a ZMQ endpoint: tcp://host:port or ipc://path"
    if scheme == "tcp":
        port = rest.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536 or not rest.rpartition(":")[0]:
            return f"{endpoint!r} needs a host and a port: tcp://host:port"
    return None


@dataclass(frozen=True)
class KvEndpoints(Kind):
    """A comma list of `PUB[+REPLAY]` ZMQ endpoints; `{host}` stands for an instance's host."""

    metavar: ClassVar[str] = "ENDPOINTS"

    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(entry.strip() for entry in text.split(",") if entry.strip())

    def problem(self, value: tuple[str, ...]) -> str | None:
        for entry in value:
            for endpoint in split_kv_endpoint(entry):
                if endpoint is not None and (problem := zmq_problem(endpoint.replace("{host}", "h"))):
                    return problem
        return None
