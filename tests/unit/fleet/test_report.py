"""The /health answer from the fleet's parts, without a server."""

from __future__ import annotations

import pytest

from epd_proxy.config import Config
from epd_proxy.fleet.backends import ENCODE, PREFILL_DECODE
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry
from epd_proxy.fleet.report import HealthReport, stage_status


class StatusOf:
    """A roster or DNS discovery as the report sees it: something with a status."""

    def __init__(self, status: dict) -> None:
        self._status = status

    def status(self) -> dict:
        return self._status


def parts(config: Config) -> tuple[Registry, Health]:
    fleet = Registry.from_config(config)
    health = Health(fail_threshold=1)
    fleet.watch(health)
    return fleet, health


def down(fleet: Registry, health: Health, url: str) -> None:
    [inst] = [inst for inst in fleet.all() if inst.url == url]
    health.checked(inst, "refused")


@pytest.mark.parametrize(
    "in_rotation, status",
    [([], "empty"), ([True, True], "healthy"), ([True, False], "degraded"), ([False, False], "unhealthy")],
)
def test_a_stage_is_named_by_how_many_of_its_instances_are_in_rotation(in_rotation, status):
    assert stage_status(in_rotation) == status


def test_static_mode_is_200_while_every_stage_serves_and_503_naming_the_one_that_cannot():
    config = Config(encode_urls=("http://e1", "http://e2"), decode_urls=("http://pd",))
    fleet, health = parts(config)
    report = HealthReport(config, fleet, health, None, None)
    status, body = report.answer()
    assert status == 200
    assert (body["encode_cluster"], body["prefill_cluster"], body["decode_cluster"]) == ("healthy", "empty", "healthy")
    assert set(body["instances"]) == {"http://e1", "http://e2", "http://pd"}
    assert body["instances"]["http://pd"]["role"] == PREFILL_DECODE and "url" not in body["instances"]["http://pd"]
    down(fleet, health, "http://e1")
    assert report.answer()[0] == 200 and report.answer()[1]["encode_cluster"] == "degraded"
    down(fleet, health, "http://pd")
    status, body = report.answer()
    assert status == 503 and body["decode_cluster"] == "unhealthy"


def test_static_mode_with_a_dns_name_that_resolves_to_nothing_is_503_and_says_so():
    config = Config(encode_urls=("dns://encoders.local:8000",), decode_urls=("http://pd",))
    fleet, health = parts(config)
    dns = {"encoders.local": {"status": "pending", "addresses": []}}
    status, body = HealthReport(config, fleet, health, None, StatusOf(dns)).answer()
    assert status == 503 and body["encode_cluster"] == "empty" and body["dns"] == dns


def test_dynamic_mode_is_always_200_with_the_roster_and_the_stores_state():
    config = Config(dynamic_registration=True, admin_api_key="adm")
    fleet, health = parts(config)
    store = {"status": "down", "seconds_since_sync": 12.0, "error": "refused"}
    report = HealthReport(config, fleet, health, StatusOf(store), None)
    status, body = report.answer()
    assert status == 200 and body == {
        "proxy": "healthy",
        "instances": fleet.snapshot(health.in_rotation),
        "health": {},
        "roster": store,
    }
    fleet.register({"role": ENCODE, "url": "http://e"})
    down(fleet, health, "http://e")
    status, body = report.answer()
    assert status == 200 and body["instances"][ENCODE] == {"live": [], "evicted": ["http://e"]}
    assert body["health"]["http://e"]["in_rotation"] is False


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_answer_that_names_no_backend_keeps_the_status_and_counts_per_role(dynamic):
    static = {"encode_urls": ("dns://encoders.local:8000", "http://e2"), "decode_urls": ("http://pd",)}
    config = Config(**({"dynamic_registration": True, "admin_api_key": "adm"} if dynamic else static))
    fleet, health = parts(config)
    if dynamic:
        fleet.register({"role": ENCODE, "url": "http://e2"})
        fleet.register({"role": PREFILL_DECODE, "url": "http://pd"})
    dns = {"encoders.local": {"status": "failing", "addresses": ["http://10.0.0.1:8000"], "error": "refused"}}
    report = HealthReport(config, fleet, health, StatusOf({"store": "redis://store"}), StatusOf(dns))
    down(fleet, health, "http://pd")
    status, body = report.answer(names_backends=False)
    assert status == report.answer()[0] == (200 if dynamic else 503)
    assert body == {
        "proxy": "healthy",
        "encode_cluster": "healthy",
        "prefill_cluster": "empty",
        "decode_cluster": "unhealthy",
        "roles": {ENCODE: {"members": 1, "in_rotation": 1}, PREFILL_DECODE: {"members": 1, "in_rotation": 0}},
    }
