"""Who may call what: the clients' bearer key on the OpenAI routes, or with `--tenants` whose
tenant a request is for, and the operators' admin key (one guard with one rule for every admin
route; docs/security.md, docs/keys.md).

Both compare in constant time; a header with bytes that are not UTF-8 is a wrong key, not a crash.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from epd_proxy.addresses import IPNetworks
from epd_proxy.config import Config
from epd_proxy.errors import ProxyError
from epd_proxy.tenants import Tenant, Tenants

# What `vllm serve --api-key` guards (its AuthenticationMiddleware): plain string prefixes, so /v1x too.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def bearer_token_matches(expected: str, authorization: str | None) -> bool:
    """Like `vllm serve --api-key`: only `Authorization: Bearer <key>` counts (the scheme in any
    case, as HTTP has it)."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return False
    return hmac.compare_digest(expected.encode(), authorization[7:].encode("utf-8", "surrogateescape"))


# Anthropic's clients send their key as `x-api-key`, never as a bearer token.
X_API_KEY_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def guarded(method: str, path: str) -> bool:
    return method != "OPTIONS" and path.startswith(GUARDED_PREFIXES)


def _unauthenticated(message: str = "a valid 'Authorization: Bearer <key>' header is required") -> ProxyError:
    return ProxyError(401, message, stage="request", error_type="authentication_error")


def check_client_key(
    api_key: str, method: str, path: str, authorization: str | None, x_api_key: str | None = None
) -> None:
    """401 for a guarded path without the key; checked before routing, so an unknown /v1 path
    tells a caller without the key nothing. The Messages door also takes `x-api-key` (vLLM
    itself does not, so its Anthropic clients have to be given the key as a bearer token)."""
    if (
        api_key
        and guarded(method, path)
        and not bearer_token_matches(api_key, authorization)
        and not (
            x_api_key is not None
            and path in X_API_KEY_PATHS
            and hmac.compare_digest(api_key.encode(), x_api_key.encode("utf-8", "surrogateescape"))
        )
    ):
        raise _unauthenticated()


@dataclass(frozen=True, slots=True)
class Gateway:
    """`--tenant-header` and `--trusted-proxies`: the header a gateway names the tenant in, and
    the peers whose connections may."""

    header: str
    trusted: IPNetworks

    def named(self, value: str | None, peer: str | None) -> str | None:
        """The tenant the header names, when a trusted peer sent it; from anyone else it is not read."""
        return value if value is not None and self.trusted.contain(peer) else None


def identify(
    tenants: Tenants, api_key: str, path: str, authorization: str | None, x_api_key: str | None, named: str | None
) -> Tenant:
    """The tenant of a request on a guarded path, or a 401. `named` is the tenant header's value,
    given only when it came from a trusted proxy: that gateway authenticated the client. Else the
    key decides: a tenant's, `--api-key`'s (the default tenant), or none (the default tenant,
    unless `--api-key` requires one); any other key, or a credential that is not a bearer key, is a 401."""
    if named is not None:
        tenant = tenants.by_name(named)
        if tenant is None:
            raise _unauthenticated("the gateway named an unknown tenant")
        return tenant
    key: str | None = None
    if authorization:
        if authorization[:7].lower() != "bearer ":
            raise _unauthenticated()
        key = authorization[7:]
    elif x_api_key is not None:
        if path not in X_API_KEY_PATHS:
            raise _unauthenticated()  # a key where none is read: never taken for no key at all
        key = x_api_key
    if key is None:
        if api_key:
            raise _unauthenticated()
        return tenants.default
    presented = key.encode("utf-8", "surrogateescape")
    if api_key and hmac.compare_digest(api_key.encode(), presented):
        return tenants.default
    tenant = tenants.by_key(presented)
    if tenant is None:
        raise _unauthenticated()
    return tenant


# How far the proxy's keys close it: none at all, ADMIN_API_KEY (an operator owns what acts on the
# fleet), --api-key (clients authenticate, so nothing about the fleet is public).
OPEN, OPERATED, AUTHENTICATED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class AdminAction:
    """What an admin route does, in the 403's words, and from which closure on it needs the key."""

    words: str
    stage: str
    closed_from: int


# The reference guards only changes to the fleet; profiling slows every engine; reading the fleet
# (the roster, /status.json, /health's instances) names every backend and the requests in flight,
# which a proxy that answers anyone shows anyway.
CHANGE_FLEET = AdminAction("change the fleet", "registry", OPEN)
PROFILE = AdminAction("profile", "profile", OPERATED)
READ_FLEET = AdminAction("read the fleet", "registry", AUTHENTICATED)


def closure(config: Config) -> int:
    if config.api_key:
        return AUTHENTICATED
    return OPERATED if config.admin_api_key else OPEN


def may(config: Config, action: AdminAction, presented: str | None) -> bool:
    """The one rule of every admin route: it needs `X-API-Key: $ADMIN_API_KEY` once the proxy's
    keys close it as far as the action, and a proxy without an ADMIN_API_KEY can name no admin."""
    if closure(config) < action.closed_from:
        return True
    expected = config.admin_api_key
    return bool(
        expected
        and presented is not None
        and hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))
    )


def guard_admin(config: Config, action: AdminAction, presented: str | None) -> None:
    """`may`, as a 403 that names the action."""
    if not may(config, action, presented):
        hint = "" if config.admin_api_key else " (the proxy has no ADMIN_API_KEY set)"
        raise ProxyError(
            403, f"a valid X-API-Key is required to {action.words}{hint}", stage=action.stage, error_type="forbidden"
        )
