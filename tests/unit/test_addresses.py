"""Where `serve`'s instances are (addresses.py): URL lists, DNS names and the DNS server."""

from __future__ import annotations

import pytest

from epd_proxy.addresses import Hosts, Networks, dns_problem, is_dns, split_server, split_urls


def test_dns_names_are_told_from_urls_by_their_scheme():
    assert is_dns("dns://e.svc:8001") and is_dns("dns+srv://_http._tcp.e.svc")
    assert not is_dns("http://dns:8001") and not is_dns("dnsx://e:1")


@pytest.mark.parametrize("entry", ["dns://e.svc:8001", "dns+srv://_http._tcp.e.svc"])
def test_well_formed_dns_names_have_no_problem(entry):
    assert dns_problem(entry) is None


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("dns://e.svc", "needs a port"),
        ("dns+srv://e.svc:8001", "drop :8001"),
        ("dns://e.svc:99999", "invalid port"),
        ("dns://e.svc:8001/path", "is not a DNS name"),
        ("dns://", "is not a DNS name"),
        ("dns://user@e.svc:1", "is not a DNS name"),
    ],
)
def test_a_malformed_dns_name_is_named_with_what_to_change(entry, said):
    assert said in dns_problem(entry)


def test_the_dns_server_is_an_ip_with_port_53_unless_told():
    assert split_server("10.0.0.2") == ("10.0.0.2", 53)
    assert split_server("127.0.0.1:8600") == ("127.0.0.1", 8600)
    assert split_server("[::1]:5353") == ("::1", 5353)
    for bad in ("consul.local", "127.0.0.1:x", ""):
        with pytest.raises(ValueError):
            split_server(bad)


def test_url_lists_drop_blanks_and_trailing_slashes_and_none_means_none():
    assert split_urls(" http://e0:1/ ,, http://e1:2 ") == ("http://e0:1", "http://e1:2")
    for disabled in (None, "", "none", "NONE", " disable ", "disabled"):
        assert split_urls(disabled) == ()


def test_media_fetch_networks_and_domains_are_checked_at_startup():
    assert str(Networks().parse(" 127.0.0.0/8, fd00::/8 ,")) == "127.0.0.0/8,fd00::/8"
    assert str(Networks().parse("127.0.0.1")) == "127.0.0.1/32"
    with pytest.raises(ValueError, match="not an IP network"):
        Networks().parse("localhost")
    assert Hosts().parse("Media.Example, cdn.example") == ("media.example", "cdn.example")
    for bad in ("https://media.example", "media.example:443", "media.example/x"):
        assert "not a host name" in (Hosts().problem((bad,)) or "")
