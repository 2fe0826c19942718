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
