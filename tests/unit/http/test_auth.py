"""The clients' bearer key and the operators' admin key (auth.py)."""

from __future__ import annotations

import pytest

from epd_proxy.errors import ProxyError
from epd_proxy.http.auth import bearer_token_matches, check_client_key


@pytest.mark.parametrize("header", ["Bearer k3y", "bearer k3y", "BEARER k3y"])
def test_the_bearer_scheme_is_matched_in_any_case(header):
    assert bearer_token_matches("k3y", header)


@pytest.mark.parametrize("header", [None, "", "k3y", "Basic k3y", "Bearer", "Bearer k3", "Bearer k3y ", "Bearerk3y"])
def test_anything_but_bearer_and_the_exact_key_is_refused(header):
    assert not bearer_token_matches("k3y", header)


def test_a_header_that_is_not_utf8_is_a_wrong_key_not_a_crash():
    # aiohttp hands undecodable header bytes over as surrogate escapes.
    assert not bearer_token_matches("k3y", "Bearer \udcff\udcfe")


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/models", "/v1x", "/v2/anything", "/inference/x", "/cohere"]
)
def test_guarded_paths_need_the_client_key(path):
    with pytest.raises(ProxyError) as caught:
        check_client_key("k3y", "POST", path, None)
    assert caught.value.status == 401 and caught.value.error_type == "authentication_error"
    check_client_key("k3y", "POST", path, "Bearer k3y")


@pytest.mark.parametrize("path", ["/health", "/metrics", "/status", "/instances", "/start_profile"])
def test_operations_paths_are_not_guarded_by_the_client_key(path):
    check_client_key("k3y", "GET", path, None)


def test_preflight_and_a_proxy_without_a_key_pass():
    check_client_key("k3y", "OPTIONS", "/v1/chat/completions", None)
    check_client_key("", "POST", "/v1/chat/completions", None)


# -- tenants (--tenants): who a request is for ------------------------------------------------------

import hashlib  # noqa: E402

from epd_proxy.http.auth import identify  # noqa: E402
from epd_proxy.tenants import parse_tenants  # noqa: E402

TENANTS = parse_tenants(
    f"[tenants.acme]\nkey_sha256 = ['{hashlib.sha256(b'acme-key').hexdigest()}']\n[tenants.gw-only]\n"
)


def who(api_key="", authorization=None, x_api_key=None, named=None, path="/v1/chat/completions"):
    return identify(TENANTS, api_key, path, authorization, x_api_key, named).name


def refused(**presented) -> ProxyError:
    with pytest.raises(ProxyError) as refusal:
        who(**presented)
    assert refusal.value.status == 401 and refusal.value.error_type == "authentication_error"
    return refusal.value


def test_a_tenants_key_names_the_tenant_as_a_bearer_or_on_the_messages_door_as_x_api_key():
    assert who(authorization="Bearer acme-key") == "acme"
    assert who(authorization="bearer acme-key") == "acme"
    assert who(x_api_key="acme-key", path="/v1/messages") == "acme"
    refused(x_api_key="acme-key", path="/v1/chat/completions")


def test_an_unknown_key_is_a_401_and_no_key_is_the_default_tenant():
    assert "a valid" in refused(authorization="Bearer somebody-else").message
    refused(authorization="Basic acme-key")
    refused(authorization="Bearer \udcff")
    assert who() == "default"


def test_with_api_key_too_its_key_is_the_default_tenant_and_no_key_is_refused():
    assert who(api_key="shared", authorization="Bearer shared") == "default"
    assert who(api_key="shared", authorization="Bearer acme-key") == "acme"
    refused(api_key="shared")


def test_a_trusted_gateway_names_the_tenant_and_an_unknown_name_is_refused():
    assert who(named="gw-only") == "gw-only"
    assert who(named="default") == "default"
    # The gateway authenticated the client: whatever key it passes on is not read.
    assert who(named="acme", authorization="Bearer not-a-key") == "acme"
    assert "unknown tenant" in refused(named="nobody").message
