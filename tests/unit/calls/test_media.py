"""The media fetch's pure rules: which addresses it may connect to, and how long an answer is kept."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from epd_proxy.addresses import Networks
from epd_proxy.calls.media import FetchRules, _lifetime

NOT_PUBLIC = [
    "127.0.0.1",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # the cloud metadata service
    "100.64.0.1",  # carrier-grade NAT
    "0.0.0.0",
    "224.0.0.1",
    "::1",
    "fe80::1%eth0",
    "fd00::1",
    "::ffff:127.0.0.1",  # IPv4 loopback written as IPv6
    "::ffff:169.254.169.254",
    # IPv6 forms that lead to an IPv4 address: NAT64, 6to4, IPv4-compatible, and site-local.
    "64:ff9b::a9fe:a9fe",
    "64:ff9b::a00:1",
    "64:ff9b:1::a00:1",
    "2002:a9fe:a9fe::1",
    "::a9fe:a9fe",
    "fec0::1",
]


@pytest.mark.parametrize("address", NOT_PUBLIC)
def test_only_public_addresses_are_fetched_by_default(address):
    assert not FetchRules().allows(address)


def test_public_addresses_and_allowed_networks_are_fetched():
    assert FetchRules().allows("93.184.215.14") and FetchRules().allows("2606:2800:21f:cb07:6820:80da:af6b:8b2c")
    # A public IPv4 address reached through NAT64 or 6to4 is public.
    assert FetchRules().allows("64:ff9b::5db8:d70e") and FetchRules().allows("2002:5db8:d70e::1")
    rules = FetchRules(allow_networks=Networks().parse("127.0.0.0/8,fd00::/8"))
    assert rules.allows("127.0.0.2") and rules.allows("::ffff:127.0.0.1") and rules.allows("fd00::1")
    assert not rules.allows("169.254.169.254") and not rules.allows("::1")


@pytest.mark.parametrize(
    "headers, lifetime",
    [
        ({}, 0.0),
        ({"Cache-Control": "max-age=30"}, 30.0),
        ({"Cache-Control": "public, max-age=3600"}, 60.0),  # capped by the ttl
        ({"Cache-Control": "max-age=30", "Age": "25"}, 5.0),
        ({"Cache-Control": "max-age=30, s-maxage=10"}, 10.0),
        ({"Cache-Control": "no-cache, max-age=30"}, 0.0),
        ({"Cache-Control": "max-age=soon"}, 0.0),
        ({"Cache-Control": "no-store"}, None),
        ({"Cache-Control": "private, max-age=30"}, None),
        ({"Cache-Control": "max-age=30", "Vary": "*"}, None),
    ],
)
def test_an_answer_is_kept_only_as_long_as_its_origin_says_it_is_fresh(headers, lifetime):
    assert _lifetime(CIMultiDict(headers), ttl_s=60.0) == lifetime
