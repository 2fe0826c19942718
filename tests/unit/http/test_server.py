"""The client-side limits: flags and config checks (the gate is test_limits.py's)."""

from __future__ import annotations

import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.http.server import ClientLimits
from tests.unit.test_config import parse


def test_flags_reach_the_config_and_defaults_are_sane():
    defaults = parse()
    assert (defaults.client_header_timeout_s, defaults.client_body_timeout_s) == (60.0, 60.0)
    assert defaults.client_keepalive_timeout_s == 75.0 and defaults.max_client_connections == 1024
    config = parse(
        "--client-header-timeout",
        "5",
        "--client-body-timeout",
        "0",
        "--client-keepalive-timeout",
        "2.5",
        "--max-client-connections",
        "10",
    )
    limits = ClientLimits.from_config(config)
    assert limits == ClientLimits(
        header_timeout_s=5.0, body_timeout_s=None, keepalive_timeout_s=2.5, max_connections=10
    )


@pytest.mark.parametrize(
    "field, flag",
    [
        ("client_header_timeout_s", "--client-header-timeout"),
        ("client_body_timeout_s", "--client-body-timeout"),
        ("client_keepalive_timeout_s", "--client-keepalive-timeout"),
        ("max_client_connections", "--max-client-connections"),
    ],
)
def test_negative_limits_fail_at_startup(field, flag):
    with pytest.raises(ConfigError, match=flag):
        Config(encode_urls=("http://e",), decode_urls=("http://d",), **{field: -1})
