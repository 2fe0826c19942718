"""Who a request is for: the tenants file (`--tenants`), each tenant's settings, its keys as
SHA-256 digests, and the priority range a request is clamped into (pure; docs/keys.md).

The file is TOML (the standard library reads it): a `[default]` table for requests that present
no key, and one `[tenants.<name>]` table per tenant. A file is checked whole before it is used,
so a bad one never replaces a good one (`TenantsFile.reload`, on SIGHUP).
"""

from __future__ import annotations

import hashlib
import logging
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from epd_proxy.addresses import IPNetworks, Networks
from epd_proxy.errors import BadRequest
from epd_proxy.fetch_flags import MediaFetchFlags
from epd_proxy.options import ConfigError, Count, Kind, Text
from epd_proxy.reference_flags import ours_option

log = logging.getLogger("epd_proxy.tenants")

# The tenant of requests that present no key (and of --api-key's key).
DEFAULT = "default"
# A tenant's name is a metrics label value and a log field: short and plain.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
DIGEST = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")
# The longest wait any deadline may ask for (a tenant's, or a client's header).
MAX_DEADLINE_MS = 3_600_000
SETTINGS = ("weight", "priority", "deadline_ms", "isolated", "salt", "key_sha256")
# An isolated tenant's secret: long enough that no other tenant can guess it (`openssl rand -hex 32`).
MIN_SALT_CHARS = 32


@dataclass(frozen=True, slots=True)
class PriorityRange:
    """vLLM's `priority` values a request may carry (lower runs earlier), both ends included."""

    low: int
    high: int

    def clamp(self, value: int) -> int:
        return self.low if value < self.low else self.high if value > self.high else value

    def within(self, outer: PriorityRange | None) -> PriorityRange:
        """This range clamped into `outer` (--priority-range): clamping into the result is the same
        as clamping into this range, then into `outer`."""
        if outer is None:
            return self
        return PriorityRange(outer.clamp(self.low), outer.clamp(self.high))


# Without a range of its own a tenant keeps vLLM's default priority: moving ahead is granted, not taken.
NO_PRIORITY = PriorityRange(0, 0)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    # Its share of the fleet relative to the others' (read by fair queueing).
    weight: float = 1.0
    priority: PriorityRange = NO_PRIORITY
    # How long its requests may wait to start before they are turned away; None: as long as it takes.
    deadline_s: float | None = None
    # Its media never share an encoder sub-request with another request's, are named apart from
    # everyone else's, and its prompts are salted in every engine's prefix cache.
    isolated: bool = False
    # What an isolated tenant's prompts carry as vLLM's `cache_salt` and its media names are
    # salted with (`cache_salt_of`); None for every other tenant.
    cache_salt: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Tenants:
    """One reading of the tenants file."""

    default: Tenant
    named: Mapping[str, Tenant]
    # SHA-256 digest of a key -> its tenant. A lookup by digest tells a timing observer nothing
    # about the stored keys: the digest of what they send is not theirs to choose.
    _by_digest: Mapping[bytes, Tenant] = field(repr=False)

    def by_key(self, key: bytes) -> Tenant | None:
        return self._by_digest.get(hashlib.sha256(key).digest())

    def by_name(self, name: str) -> Tenant | None:
        return self.default if name == DEFAULT else self.named.get(name)

    def names(self) -> tuple[str, ...]:
        """The label values /metrics may carry: configured names only."""
        return (DEFAULT, *self.named)


def parse_tenants(text: str) -> Tenants:
    """A tenants file's text, checked whole; ConfigError names what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _bad(f"not TOML: {exc}") from None
    unknown = set(data) - {DEFAULT, "tenants"}
    if unknown:
        raise _bad(f"unknown table {sorted(unknown)[0]!r} (expected [default] and [tenants.<name>])")
    digests: dict[bytes, Tenant] = {}
    default_table = data.get(DEFAULT, {})
    if not isinstance(default_table, dict):
        raise _bad("[default] must be a table")
    if "key_sha256" in default_table:
        raise _bad("the default tenant has no keys: it is the tenant of requests that present none")
    default = _tenant(DEFAULT, default_table, digests)
    tables = data.get("tenants", {})
    if not isinstance(tables, dict):
        raise _bad("[tenants] must hold one table per tenant")
    named = {}
    for name, table in tables.items():
        if name == DEFAULT:
            raise _bad("'default' names the tenant of requests without a key: set it in [default]")
        if not NAME.fullmatch(name):
            raise _bad(f"tenant {name!r}: tenant names are letters, digits, '_', '.' and '-', at most 64")
        if not isinstance(table, dict):
            raise _bad(f"tenant {name!r} must be a table")
        named[name] = _tenant(name, table, digests)
    return Tenants(default, named, digests)


def _tenant(name: str, table: dict[str, Any], digests: dict[bytes, Tenant]) -> Tenant:
    where = f"tenant {name!r}"
    unknown = set(table) - set(SETTINGS)
    if unknown:
        raise _bad(f"{where}: unknown setting {sorted(unknown)[0]!r} (known: {', '.join(SETTINGS)})")
    weight = table.get("weight", 1)
    if not _is_number(weight) or not weight > 0:
        raise _bad(f"{where}: weight must be a number > 0, got {weight!r}")
    priority = table.get("priority", [0, 0])
    if (
        not (isinstance(priority, list) and len(priority) == 2 and all(_is_int(v) for v in priority))
        or priority[0] > priority[1]
    ):
        raise _bad(f"{where}: priority must be [low, high], two integers with low <= high, got {priority!r}")
    deadline_ms = table.get("deadline_ms")
    if deadline_ms is not None and not (_is_int(deadline_ms) and 1 <= deadline_ms <= MAX_DEADLINE_MS):
        raise _bad(f"{where}: deadline_ms must be an integer within 1..{MAX_DEADLINE_MS}, got {deadline_ms!r}")
    isolated = table.get("isolated", False)
    if not isinstance(isolated, bool):
        raise _bad(f"{where}: isolated must be true or false, got {isolated!r}")
    secret = table.get("salt")
    if secret is not None and not isolated:
        raise _bad(f"{where}: salt is read only for an isolated tenant (set isolated = true, or remove it)")
    if isolated and secret is None:
        raise _bad(f"{where}: an isolated tenant needs a salt, a secret of its own (make one: openssl rand -hex 32)")
    if secret is not None and not (isinstance(secret, str) and len(secret) >= MIN_SALT_CHARS):
        # The value is not repeated: it is a secret.
        raise _bad(f"{where}: salt must be a string of at least {MIN_SALT_CHARS} characters")
    tenant = Tenant(
        name,
        float(weight),
        PriorityRange(*priority),
        None if deadline_ms is None else deadline_ms / 1000,
        isolated,
        None if secret is None else cache_salt_of(name, secret),
    )
    keys = table.get("key_sha256", [])
    if not isinstance(keys, list):
        raise _bad(f"{where}: key_sha256 must be a list of SHA-256 digests (hex)")
    for n, text in enumerate(keys):
        found = DIGEST.fullmatch(text) if isinstance(text, str) else None
        if found is None:
            # The entry may be a key pasted by mistake: it is not repeated in the message.
            raise _bad(f"{where}: key_sha256[{n}] is not a SHA-256 digest (64 hex digits; store no keys here)")
        digest = bytes.fromhex(found.group(1))
        if digest in digests:
            raise _bad(f"{where}: key_sha256[{n}] is listed twice (also for tenant {digests[digest].name!r})")
        digests[digest] = tenant
    return tenant


def cache_salt_of(name: str, secret: str) -> str:
    """An isolated tenant's salt: a digest of its name and its secret from the file, so every
    worker and replica reading the same file salts alike (a per-process key would not), the secret
    itself never reaches an engine, and one secret pasted under two names still salts two ways.
    Hex digits: within what vLLM accepts as a `cache_salt` (128 characters, no '@', '/', '\\')."""
    return hashlib.sha256(b"epd-proxy cache salt\0%s\0%s" % (name.encode(), secret.encode())).hexdigest()


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _bad(problem: str) -> ConfigError:
    return ConfigError(f"tenants file: {problem}")


class TenantsFile:
    """The tenants file as the proxy serves it: read at start (a bad file is a ConfigError) and
    again on SIGHUP, when a bad file keeps the tenants in force."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.current = self._read()

    def _read(self) -> Tenants:
        try:
            with open(self.path, encoding="utf-8") as file:
                text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"tenants file: cannot read {self.path}: {exc}") from None
        return parse_tenants(text)

    def reload(self) -> str | None:
        """Read the file again: None when its tenants are now in force, else what is wrong with it."""
        try:
            self.current = self._read()
        except ConfigError as exc:
            log.error("%s: %s; the tenants read before stay in force", self.path, exc)
            return str(exc)
        log.info("%s: reloaded, %d tenants besides the default", self.path, len(self.current.named))
        return None


def clamp_priority(body: dict[str, Any], allowed: PriorityRange) -> None:
    """The body's `priority` moved into `allowed`, before the proxy's queues or any engine read it.

    vLLM reads the field leniently (an integral float, a numeric string), so anything but a JSON
    integer or integral number is refused here rather than passed on unclamped. A body without
    one runs at 0, so it gets the range's nearest value when 0 is outside."""
    if "priority" not in body:
        if not allowed.low <= 0 <= allowed.high:
            body["priority"] = allowed.clamp(0)
        return
    value = body["priority"]
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise BadRequest("priority must be an integer")
    body["priority"] = allowed.clamp(value)


def salt_prompt(body: dict[str, Any], tenant: Tenant) -> None:
    """An isolated tenant's `cache_salt` on the body every language-model engine gets, in place of
    any its client sent: the client cannot step out of its tenant's prefix cache. Other tenants'
    clients keep their own salt, which only narrows what their prompts share."""
    if tenant.cache_salt is not None:
        body["cache_salt"] = tenant.cache_salt


@dataclass(frozen=True)
class PriorityRangeKind(Kind):
    """`--priority-range LO,HI`."""

    metavar: ClassVar[str] = "LO,HI"

    def parse(self, text: str) -> PriorityRange:
        parts = text.split(",")
        try:
            low, high = (int(part) for part in parts)
        except ValueError:
            raise ValueError(f"expected two integers LO,HI, got {text!r}") from None
        if low > high:
            raise ValueError(f"LO must not exceed HI, got {text!r}")
        return PriorityRange(low, high)


@dataclass(frozen=True)
class TenantsPath(Kind):
    """`--tenants FILE`: a file that must read as a tenants file when the proxy starts."""

    metavar: ClassVar[str] = "FILE"
    verbatim: ClassVar[bool] = True

    def problem(self, value: str) -> str | None:
        if not value:
            return None
        try:
            TenantsFile(value)
        except ConfigError as exc:
            return str(exc)
        return None


@dataclass(frozen=True, slots=True)
class TenantFlags(MediaFetchFlags):
    """The tenants' flags, the next part of `serve`'s configuration (config.Config), declared as
    every option is (options.py)."""

    tenants_file: str = ours_option(
        "",
        TenantsPath(),
        "the tenants file (TOML): each tenant's hashed keys, weight, priority range, deadline; read again on "
        "SIGHUP; see [Keys and tenants](keys.md#tenants)",
        flag="--tenants",
    )
    tenant_header: str = ours_option(
        "",
        Text(),
        "the request header a gateway names the tenant in, trusted only from `--trusted-proxies`; needs `--tenants`",
        flag="--tenant-header",
        metavar="NAME",
    )
    trusted_proxies: IPNetworks = ours_option(
        IPNetworks(),
        Networks(),
        "comma list of addresses or CIDR blocks whose connections may name the tenant in `--tenant-header`",
        flag="--trusted-proxies",
        shown="none",
    )
    consumer_window: int = ours_option(
        0,
        Count(0),
        "with `--tenants`, while two or more tenants have requests in flight: requests each PD (or E+P+D prefill) "
        "is sent before their first token, the rest waiting in the proxy, least-served tenant first (a request whose "
        "`priority` is below 0, a tenant's grant, goes past); 0 = off; "
        "see [Keys and tenants](keys.md#fair-shares)",
        flag="--consumer-window",
    )
    priority_range: PriorityRange | None = ours_option(
        None,
        PriorityRangeKind(),
        "clamp every request's `priority` into LO..HI (a tenant's own range is clamped into it); unset = as sent; "
        "see [Security](security.md)",
        flag="--priority-range",
        shown="unset",
    )
