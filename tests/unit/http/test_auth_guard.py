"""Who may call what, without a socket: the clients' bearer key and the one admin guard."""

from __future__ import annotations

import pytest

from epd_proxy.config import Config
from epd_proxy.errors import ProxyError
from epd_proxy.http.auth import CHANGE_FLEET, PROFILE, READ_FLEET, check_client_key, guard_admin, may

STATIC = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}


def config(**keys) -> Config:
    return Config(**STATIC, **keys)


def allowed(cfg: Config, action, presented: str | None) -> bool:
    try:
        guard_admin(cfg, action, presented)
    except ProxyError as refusal:
        assert (refusal.status, refusal.error_type, refusal.stage) == (403, "forbidden", action.stage)
        return False
    return True


# Every combination of keys and what is presented, for every admin action: the table the guard's one
# rule gives (docs/security.md). A key that was required before the guard was one stays required.
@pytest.mark.parametrize(
    "keys, presented, change_fleet, profile, read_fleet",
    [
        ({}, None, False, True, True),
        ({}, "anything", False, True, True),
        ({"admin_api_key": "adm"}, None, False, False, True),
        ({"admin_api_key": "adm"}, "wrong", False, False, True),
        ({"admin_api_key": "adm"}, "adm", True, True, True),
        ({"api_key": "client"}, None, False, False, False),
        ({"api_key": "client"}, "client", False, False, False),
        ({"api_key": "client", "admin_api_key": "adm"}, "client", False, False, False),
        ({"api_key": "client", "admin_api_key": "adm"}, "adm", True, True, True),
    ],
)
def test_an_admin_action_needs_the_admin_key_once_the_keys_close_the_proxy_that_far(
    keys, presented, change_fleet, profile, read_fleet
):
    cfg = config(**keys)
    expected = [change_fleet, profile, read_fleet]
    assert [allowed(cfg, action, presented) for action in (CHANGE_FLEET, PROFILE, READ_FLEET)] == expected
    # What /health asks before it names the backends: the same rule as a yes or no.
    assert [may(cfg, action, presented) for action in (CHANGE_FLEET, PROFILE, READ_FLEET)] == expected


def test_the_refusal_says_what_was_refused_and_why_no_key_can_pass():
    with pytest.raises(ProxyError, match=r"required to profile \(the proxy has no ADMIN_API_KEY set\)"):
        guard_admin(config(api_key="client"), PROFILE, "client")
    with pytest.raises(ProxyError, match=r"required to change the fleet$"):
        guard_admin(config(admin_api_key="adm"), CHANGE_FLEET, None)


def test_a_key_that_is_not_utf8_is_a_wrong_key_not_a_crash():
    assert not allowed(config(admin_api_key="adm"), CHANGE_FLEET, "\udcff")
    with pytest.raises(ProxyError) as refusal:
        check_client_key("client", "POST", "/v1/chat/completions", "Bearer \udcff")
    assert refusal.value.status == 401


@pytest.mark.parametrize(
    "method, path, authorization, refused",
    [
        ("POST", "/v1/chat/completions", None, True),
        ("POST", "/v1/chat/completions", "Bearer client", False),
        ("POST", "/v1/chat/completions", "bearer client", False),
        ("POST", "/v1/chat/completions", "Basic client", True),
        ("GET", "/v1x", None, True),  # vLLM's prefixes are plain string prefixes
        ("OPTIONS", "/v1/models", None, False),
        ("GET", "/health", None, False),
        ("GET", "/metrics", None, False),
    ],
)
def test_the_client_key_guards_vllms_prefixes(method, path, authorization, refused):
    try:
        check_client_key("client", method, path, authorization)
    except ProxyError as refusal:
        assert refusal.status == 401 and refused
    else:
        assert not refused
