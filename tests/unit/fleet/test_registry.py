from __future__ import annotations

import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.fleet.registry import Registry, RegistryError


def dynamic(**kwargs):
    return Registry(dynamic=True, **kwargs)


def reg(registry, role, url, **extra):
    return registry.register({"role": role, "url": url, **extra})


def test_static_e_pd_makes_prefill_decode_consumers_with_their_dp_addresses():
    config = Config(
        encode_urls=("http://e",),
        decode_urls=("http://a", "http://b"),
        ec_consumer_zmq_addrs=("z0", "z1", "z2", "z3"),
        ec_consumer_dp_size=2,
    )
    fleet = Registry.from_config(config)
    a, b = fleet.members("prefill_decode")
    assert (a.zmq_addrs, b.zmq_addrs, a.dp_size) == (("z0", "z1"), ("z2", "z3"), 2)
    assert [e.url for e in fleet.members("encode")] == ["http://e"]


def test_static_e_p_d_roles():
    fleet = Registry.from_config(
        Config(encode_urls=("http://e",), prefill_urls=("http://p",), decode_urls=("http://d",))
    )
    assert [i.role for i in fleet.all()] == ["encode", "prefill", "decode"]


def test_static_url_listed_twice_is_a_config_error():
    with pytest.raises(ConfigError, match="listed twice"):
        Config(encode_urls=("http://x",), decode_urls=("http://x",))


@pytest.mark.parametrize(
    "payload, status",
    [
        ({"role": "wizard", "url": "http://a"}, 422),
        ({"role": "encode", "url": "ftp://a"}, 422),
        ({"role": "encode", "url": "http://"}, 422),
        ({"role": "encode", "url": 5}, 422),
        ({"role": "prefill", "url": "http://a", "dp_size": 0}, 422),
        ({"role": "prefill", "url": "http://a", "dp_size": True}, 422),
        ({"role": "prefill", "url": "http://a", "dp_size": 2, "ec_zmq_addrs": ["z"]}, 422),
        ({"role": "encode", "url": "http://a", "ec_zmq_addrs": ["z"]}, 400),
        ({"role": "decode", "url": "http://a", "ec_zmq_addrs": ["z"]}, 400),
        ([], 422),
    ],
)
def test_registration_validation(payload, status):
    with pytest.raises(RegistryError) as err:
        dynamic().register(payload)
    assert err.value.status == status


def test_registration_lifecycle():
    fleet = dynamic()
    assert reg(fleet, "encode", "http://e/") is True
    assert reg(fleet, "encode", "http://e") is False  # trailing slash stripped, same record
    with pytest.raises(RegistryError) as err:
        reg(fleet, "prefill", "http://e")
    assert err.value.status == 409
    assert reg(fleet, "prefill_decode", "http://pd", ec_zmq_addrs=["z0"]) is True
    with pytest.raises(RegistryError) as err:
        reg(fleet, "decode", "http://d")
    assert err.value.status == 409
    assert fleet.snapshot(lambda inst: True)["prefill_decode"] == {"live": ["http://pd"], "evicted": []}
    assert fleet.unregister("http://pd") is True and fleet.unregister("http://pd") is False
    assert reg(fleet, "decode", "http://d") is True


class Events:
    def __init__(self):
        self.seen = []

    def joined(self, inst):
        self.seen.append(("joined", inst.url))

    def rejoined(self, inst):
        self.seen.append(("rejoined", inst.url))

    def left(self, inst):
        self.seen.append(("left", inst.url))


def test_watchers_hear_joins_rejoins_and_departures():
    fleet = dynamic()
    reg(fleet, "encode", "http://a")
    events = Events()
    fleet.watch(events)
    reg(fleet, "encode", "http://b")
    reg(fleet, "encode", "http://a")
    fleet.unregister("http://a")
    fleet.forget("http://b", "ttl")
    fleet.forget("http://b", "ttl")
    assert events.seen == [
        ("joined", "http://a"),
        ("joined", "http://b"),
        ("rejoined", "http://a"),
        ("left", "http://a"),
        ("left", "http://b"),
    ]
    assert list(fleet.all()) == []


def test_re_registering_with_new_details_updates_in_place():
    fleet = dynamic()
    reg(fleet, "prefill", "http://p", dp_size=2)
    [before] = fleet.members("prefill")
    reg(fleet, "prefill", "http://p", dp_size=3)
    assert fleet.members("prefill") == [before] and before.dp_size == 3
