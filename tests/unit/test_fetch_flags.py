"""The flags of media behind http(s) URLs: their own section of `serve --help`, right after the
reference proxy's flags, and what the fetch's rules are built from."""

from __future__ import annotations

from dataclasses import fields

import pytest

from epd_proxy.calls.media import FetchRules
from epd_proxy.config import Config, ConfigError, options
from epd_proxy.fetch_flags import MEDIA, MediaFetchFlags
from epd_proxy.reference_flags import ReferenceFlags
from tests.unit.test_config import parse


def test_they_follow_the_reference_flags_in_their_own_help_section():
    names = [item.name for item in fields(Config)]
    reference = len(fields(ReferenceFlags))
    mine = [item.name for item in fields(MediaFetchFlags)][reference:]
    assert names[reference : reference + len(mine)] == mine
    groups = {name: declared.group for name, _, declared in options()}
    assert {groups[name] for name in mine} == {MEDIA}


def test_the_fetch_rules_are_the_flags():
    config = parse(
        "--media-fetch-allow-networks",
        "10.0.0.0/8, fd00::/8",
        "--media-fetch-max-redirects",
        "0",
        "--allowed-media-domains",
        "Media.Example",
    )
    rules = FetchRules.of(config)
    assert rules.max_redirects == 0 and rules.allowed_domains == frozenset({"media.example"})
    assert rules.allows("10.1.2.3") and rules.allows("::ffff:10.1.2.3") and not rules.allows("192.168.1.1")
    assert not FetchRules.of(parse()).allows("10.1.2.3")


def test_a_network_that_is_not_one_is_a_usage_error():
    with pytest.raises((ConfigError, SystemExit)):
        parse("--media-fetch-allow-networks", "intranet")
