"""Who may call what: the clients' bearer key on the OpenAI routes and the operators' admin key.

Both compare in constant time; a header with bytes that are not UTF-8 is a wrong key, not a crash.
"""

from __future__ import annotations

import hmac

from epd_proxy.errors import ProxyError

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


def check_client_key(
    api_key: str, method: str, path: str, authorization: str | None, x_api_key: str | None = None
) -> None:
    """401 for a guarded path without the key; checked before routing, so an unknown /v1 path
    tells a caller without the key nothing. The Messages door also takes `x-api-key` (vLLM
    itself does not, so its Anthropic clients have to be given the key as a bearer token)."""
    if (
        api_key
        and method != "OPTIONS"
        and path.startswith(GUARDED_PREFIXES)
        and not bearer_token_matches(api_key, authorization)
        and not (x_api_key is not None and path in X_API_KEY_PATHS and _same_key(api_key, x_api_key))
    ):
        raise ProxyError(
            401,
            "a valid 'Authorization: Bearer <key>' header is required",
            stage="request",
            error_type="authentication_error",
        )


def _same_key(expected: str, presented: str) -> bool:
    return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))


def check_admin_key(
    expected: str, presented: str | None, action: str = "change the fleet", stage: str = "registry"
) -> None:
    if not expected or presented is None or not _same_key(expected, presented):
        hint = "" if expected else " (the proxy has no ADMIN_API_KEY set)"
        raise ProxyError(403, f"a valid X-API-Key is required to {action}{hint}", stage=stage, error_type="forbidden")
