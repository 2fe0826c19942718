from __future__ import annotations

import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.registry import Registry, RegistryError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


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
    a, b = fleet.live("prefill_decode")
    assert (a.zmq_addrs, b.zmq_addrs, a.dp_size) == (("z0", "z1"), ("z2", "z3"), 2)
    assert [e.url for e in fleet.live("encode")] == ["http://e"]


def test_static_e_p_d_roles():
    fleet = Registry.from_config(
        Config(encode_urls=("http://e",), prefill_urls=("http://p",), decode_urls=("http://d",))
    )
    assert [i.role for i in fleet.all()] == ["encode", "prefill", "decode"]


def test_static_url_listed_twice_is_a_config_error():
    with pytest.raises(ConfigError, match="listed twice"):
        Registry.from_config(Config(encode_urls=("http://x",), decode_urls=("http://x",)))


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
    assert fleet.snapshot()["prefill_decode"] == {"live": ["http://pd"], "evicted": []}
    assert fleet.unregister("http://pd") is True and fleet.unregister("http://pd") is False
    assert reg(fleet, "decode", "http://d") is True


def test_re_registering_the_same_record_keeps_its_health_state():
    fleet = dynamic(fail_threshold=1)
    reg(fleet, "encode", "http://e")
    [inst] = fleet.live("encode")
    fleet.record_failure(inst, "probe failed")
    assert fleet.live("encode") == []
    reg(fleet, "encode", "http://e")
    assert fleet.live("encode") == [] and fleet.snapshot()["encode"]["evicted"] == ["http://e"]
    reg(fleet, "prefill", "http://p", dp_size=2)
    reg(fleet, "prefill", "http://p", dp_size=3)
    assert [i.dp_size for i in fleet.all() if i.role == "prefill"] == [3]


def test_eviction_after_threshold_and_revival_on_first_success():
    fleet = dynamic(fail_threshold=3)
    reg(fleet, "encode", "http://e")
    [inst] = fleet.live("encode")
    for _ in range(2):
        fleet.record_failure(inst, "x")
    assert fleet.live("encode") == [inst]
    fleet.record_success(inst)
    for _ in range(2):
        fleet.record_failure(inst, "x")
    assert fleet.live("encode") == [inst], "a success clears the failure run"
    fleet.record_failure(inst, "x")
    assert fleet.live("encode") == []
    fleet.record_success(inst)
    assert fleet.live("encode") == [inst]


def test_evicted_instances_are_forgotten_after_the_ttl_and_removal_is_terminal():
    clock = Clock()
    fleet = dynamic(fail_threshold=1, evicted_ttl_s=10, clock=clock)
    reg(fleet, "encode", "http://e")
    [inst] = fleet.live("encode")
    fleet.record_failure(inst, "x")
    clock.now = 11
    fleet.forget_expired()
    assert list(fleet.all()) == []
    fleet.record_success(inst)  # a late probe result
    assert fleet.live("encode") == []


def test_static_mode_still_tries_an_all_evicted_role_dynamic_mode_does_not():
    static = Registry.from_config(Config(encode_urls=("http://e",), decode_urls=("http://d",), fail_threshold=1))
    [encoder] = static.live("encode")
    static.record_failure(encoder, "x")
    assert static.live("encode") == [] and static.candidates("encode") == [encoder]
    fleet = dynamic(fail_threshold=1)
    reg(fleet, "encode", "http://e")
    [inst] = fleet.live("encode")
    fleet.record_failure(inst, "x")
    assert fleet.candidates("encode") == []
