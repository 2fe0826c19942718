"""The tenants file (--tenants), the priority clamp and the tenants' keys, without a server."""

from __future__ import annotations

import hashlib
import re

import pytest

from epd_proxy.addresses import Networks
from epd_proxy.errors import ProxyError
from epd_proxy.options import ConfigError
from epd_proxy.tenants import (
    DEFAULT,
    PriorityRange,
    PriorityRangeKind,
    TenantsFile,
    clamp_priority,
    parse_tenants,
)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


SALT = "0123456789abcdef" * 4


EXAMPLE = f"""
[default]
weight = 1
priority = [0, 0]
deadline_ms = 20000

[tenants.acme]
weight = 4
priority = [-5, 5]
deadline_ms = 2000
isolated = true
salt = "{SALT}"
key_sha256 = ["{digest("acme-key")}", "sha256:{digest("acme-key-2").upper()}"]

[tenants.batch]
weight = 0.5
priority = [10, 20]
key_sha256 = ["{digest("batch-key")}"]
"""


def test_the_example_file_gives_each_tenant_its_settings_and_keys():
    tenants = parse_tenants(EXAMPLE)
    acme, batch = tenants.named["acme"], tenants.named["batch"]
    assert (acme.weight, acme.priority, acme.deadline_s, acme.isolated) == (4, PriorityRange(-5, 5), 2.0, True)
    assert (batch.weight, batch.priority, batch.deadline_s, batch.isolated) == (0.5, PriorityRange(10, 20), None, False)
    assert tenants.default.name == DEFAULT and tenants.default.deadline_s == 20.0
    assert tenants.by_key(b"acme-key") is acme and tenants.by_key(b"acme-key-2") is acme
    assert tenants.by_key(b"batch-key") is batch
    assert tenants.by_key(b"nobody") is None and tenants.by_key(digest("acme-key").encode()) is None
    assert tenants.names() == ("default", "acme", "batch")


def test_an_empty_file_is_one_default_tenant_that_may_not_move_its_priority():
    tenants = parse_tenants("")
    assert tenants.named == {} and tenants.default.priority == PriorityRange(0, 0)
    assert tenants.default.weight == 1 and tenants.default.deadline_s is None and not tenants.default.isolated


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("[tenant.acme]", "unknown table 'tenant'"),
        ("[tenants.acme]\nwieght = 2", "tenant 'acme': unknown setting 'wieght'"),
        ("[tenants.acme]\nweight = 0", "weight must be a number > 0"),
        ("[tenants.acme]\nweight = true", "weight must be a number > 0"),
        ("[tenants.acme]\npriority = [5, -5]", "priority must be [low, high]"),
        ("[tenants.acme]\npriority = [1.5, 2]", "priority must be [low, high]"),
        ("[tenants.acme]\npriority = 3", "priority must be [low, high]"),
        ("[tenants.acme]\ndeadline_ms = 0", "deadline_ms must be an integer within 1..3600000"),
        ("[tenants.acme]\ndeadline_ms = 99999999", "deadline_ms must be an integer within 1..3600000"),
        ("[tenants.acme]\nisolated = 1", "isolated must be true or false"),
        ("[tenants.acme]\nisolated = true", "an isolated tenant needs a salt"),
        ("[tenants.acme]\nisolated = true\nsalt = 'short'", "salt must be a string of at least 32"),
        (f"[tenants.acme]\nsalt = {SALT!r}", "salt is read only for an isolated tenant"),
        ("[tenants.acme]\nkey_sha256 = ['acme-key']", "is not a SHA-256 digest"),
        ("[tenants.acme]\nkey_sha256 = 'ab'", "key_sha256 must be a list"),
        (f"[tenants.a]\nkey_sha256 = ['{digest('k')}']\n[tenants.b]\nkey_sha256 = ['{digest('k')}']", "twice"),
        (f"[default]\nkey_sha256 = ['{digest('k')}']", "the default tenant has no keys"),
        ("[tenants.default]", "'default' names the tenant of requests without a key"),
        ("[tenants.'a b']", "tenant names are"),
        ("[tenants]\nacme = 3", "tenant 'acme' must be a table"),
        ("[default\n", "not TOML"),
    ],
)
def test_a_bad_file_is_refused_with_what_is_wrong(text, complaint):
    with pytest.raises(ConfigError, match="tenants file") as refusal:
        parse_tenants(text)
    assert complaint in str(refusal.value)


def test_a_key_is_never_stored_only_its_digest():
    tenants = parse_tenants(EXAMPLE)
    assert "acme-key" not in repr(tenants)


def test_an_isolated_tenants_cache_salt_comes_from_its_secret_and_name_the_same_in_every_process():
    tenants = parse_tenants(EXAMPLE)
    acme = tenants.named["acme"]
    salt = acme.cache_salt
    # What vLLM takes (validate_cache_salt): at most 128 characters, none of '@', '/', '\\', NUL.
    assert salt is not None and re.fullmatch(r"[0-9a-f]{64}", salt)
    assert SALT not in salt and SALT not in repr(tenants), "the secret itself never leaves the file"
    assert parse_tenants(EXAMPLE).named["acme"].cache_salt == salt, "every worker and replica derives the same"
    renamed = parse_tenants(EXAMPLE.replace("[tenants.acme]", "[tenants.acme2]")).named["acme2"]
    assert renamed.cache_salt not in (None, salt), "one secret under two names salts two ways"
    assert tenants.named["batch"].cache_salt is None and tenants.default.cache_salt is None


def test_a_reload_takes_a_good_file_and_keeps_the_old_tenants_on_a_bad_one(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(EXAMPLE)
    live = TenantsFile(str(path))
    assert live.current.by_key(b"acme-key") is not None
    path.write_text(f"[tenants.zeta]\nkey_sha256 = ['{digest('zeta-key')}']\n")
    assert live.reload() is None
    assert live.current.by_key(b"zeta-key") is not None and live.current.by_key(b"acme-key") is None
    path.write_text("[tenants.zeta]\nweight = -1\n")
    problem = live.reload()
    assert problem is not None and "weight" in problem
    assert live.current.by_key(b"zeta-key") is not None
    path.unlink()
    assert "cannot read" in (live.reload() or "") and live.current.by_key(b"zeta-key") is not None


def test_a_missing_file_at_start_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        TenantsFile(str(tmp_path / "nope.toml"))


# -- the priority clamp ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"priority": -1000000}, {"priority": -5}),
        ({"priority": 1000000}, {"priority": 5}),
        ({"priority": 3}, {"priority": 3}),
        ({"priority": -7.0}, {"priority": -5}),  # vLLM reads an integral float as an int
        ({}, {}),  # 0 is within: the body stays as sent
    ],
)
def test_priority_is_clamped_into_the_range(body, expected):
    clamp_priority(body, PriorityRange(-5, 5))
    assert body == expected


def test_a_request_without_priority_gets_the_range_when_zero_is_outside_it():
    body: dict = {}
    clamp_priority(body, PriorityRange(10, 20))
    assert body == {"priority": 10}


@pytest.mark.parametrize("value", ["-1000000", True, 1.5, None, [1], {"a": 1}])
def test_a_priority_that_is_not_an_integer_is_a_400(value):
    # vLLM's lax parsing would read "-1000000" as an int: the proxy must not let it pass unclamped.
    with pytest.raises(ProxyError) as refusal:
        clamp_priority({"priority": value}, PriorityRange(0, 0))
    assert refusal.value.status == 400 and "priority must be an integer" in refusal.value.message


def test_a_global_range_bounds_a_tenants_own():
    assert PriorityRange(-5, 5).within(PriorityRange(0, 100)) == PriorityRange(0, 5)
    assert PriorityRange(-5, 5).within(None) == PriorityRange(-5, 5)
    assert PriorityRange(200, 300).within(PriorityRange(0, 100)) == PriorityRange(100, 100)


def test_the_priority_range_flag_reads_low_comma_high():
    kind = PriorityRangeKind()
    assert kind.parse("-10,10") == PriorityRange(-10, 10)
    assert kind.parse(" 0 , 0 ") == PriorityRange(0, 0)
    for bad in ("5", "a,b", "1,2,3", "10,-10"):
        with pytest.raises(ValueError):
            kind.parse(bad)


def test_trusted_proxies_are_networks_and_an_address_is_in_them_or_not():
    kind = Networks()
    networks = kind.parse("10.0.0.0/8, 127.0.0.1, ::1")
    assert networks.contain("10.1.2.3") and networks.contain("127.0.0.1") and networks.contain("::1")
    # A dual-stack listener reports an IPv4 peer as an IPv4-mapped IPv6 address.
    assert networks.contain("::ffff:10.1.2.3") and not networks.contain("::ffff:192.168.0.1")
    assert not networks.contain("192.168.0.1") and not networks.contain(None) and not networks.contain("nonsense")
    with pytest.raises(ValueError):
        kind.parse("10.0.0.0/33")


def test_the_example_in_the_docs_is_a_tenants_file_that_reads():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "keys.md").read_text()
    example = doc[doc.index("```toml\n") + 8 :]
    tenants = parse_tenants(example[: example.index("```")])
    assert tenants.by_key(b"test") is tenants.named["acme"] and tenants.named["batch"].priority == PriorityRange(
        10, 100
    )
