"""Health on a driven clock: ejection, half-open, doubling, the ejection budget, active checks."""

from __future__ import annotations

import pytest

from epd_proxy import upstream
from epd_proxy.backends import Instance
from epd_proxy.health import DOWN, EJECTED, HALF_OPEN, HEALTHY, Health, counts_against_instance


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def fleet(n, role="encode", **kwargs):
    clock = Clock()
    health = Health(clock=clock, **kwargs)
    members = [Instance(f"http://{role}{i}", role) for i in range(n)]
    for inst in members:
        health.joined(inst)
    return health, clock, members


def test_without_active_checks_an_ejected_instance_comes_back_after_the_ejection_time():
    health, clock, (a, b) = fleet(2, fail_threshold=1, ejection_time_s=30)
    health.failed(b, "refused")
    assert health.available([a, b]) == [a] and health.state(b.url) == EJECTED
    clock.now += 29.9
    assert health.available([a, b]) == [a]
    clock.now += 0.2
    assert health.available([a, b]) == [a, b] and health.state(b.url) == HALF_OPEN
    health.succeeded(b)
    assert health.state(b.url) == HEALTHY


def test_ejection_needs_the_threshold_in_a_row():
    health, _, (a, b) = fleet(2, fail_threshold=3)
    health.failed(b, "x")
    health.failed(b, "x")
    health.succeeded(b)
    health.failed(b, "x")
    health.failed(b, "x")
    assert health.state(b.url) == HEALTHY, "a success clears the run"
    health.failed(b, "x")
    assert health.state(b.url) == EJECTED


def test_repeated_ejections_double_up_to_the_cap_and_a_success_resets_them():
    health, clock, (a, b) = fleet(2, fail_threshold=1, ejection_time_s=10, max_ejection_time_s=35)
    lengths = []
    for _ in range(4):
        health.failed(b, "refused")  # first failure ejects, or the half-open retry fails
        started = clock.now
        while health.state(b.url) == EJECTED:
            clock.now += 1
        lengths.append(clock.now - started)
    assert lengths == [10, 20, 35, 35]
    health.succeeded(b)
    health.failed(b, "refused")
    assert health.snapshot([b])[0]["ejected_for_s"] == 10
    assert health.snapshot([b])[0]["ejections"] == 5


def test_half_open_needs_only_one_failure_to_go_back_out():
    health, clock, (a, b) = fleet(2, fail_threshold=3, ejection_time_s=5)
    for _ in range(3):
        health.failed(b, "x")
    clock.now += 5
    assert health.state(b.url) == HALF_OPEN
    health.failed(b, "x")
    assert health.state(b.url) == EJECTED


def test_max_ejection_percent_holds_with_four_encoders_and_three_failing():
    health, _, members = fleet(4, fail_threshold=1, max_ejection_percent=50)
    for inst in members[1:]:
        for _ in range(5):
            health.failed(inst, "refused")
    states = [health.state(m.url) for m in members]
    assert states == [HEALTHY, EJECTED, EJECTED, HEALTHY]
    assert health.available(members) == [members[0], members[3]]


@pytest.mark.parametrize("percent", [50, 100])
def test_the_last_instance_of_a_role_is_never_ejected(percent):
    health, _, (a, b) = fleet(2, fail_threshold=1, max_ejection_percent=percent)
    health.failed(a, "x")
    health.failed(b, "x")
    assert health.available([a, b]) == [b]
    health1, _, (only,) = fleet(1, fail_threshold=1, max_ejection_percent=100)
    health1.failed(only, "x")
    assert health1.available([only]) == [only]


def test_the_budget_is_per_role():
    health, _, encoders = fleet(2, fail_threshold=1)
    decoder = Instance("http://d", "prefill_decode")
    health.joined(decoder)
    health.failed(encoders[0], "x")
    health.failed(decoder, "x")
    assert health.available(encoders) == [encoders[1]]
    assert health.available([decoder]) == [decoder], "the only decoder stays"


def test_active_checks_mark_down_after_the_threshold_and_a_passing_check_ends_everything():
    health, clock, (a, b) = fleet(2, fail_threshold=2, ejection_time_s=30)
    health.checked(b, "HTTP 503")
    assert health.available([a, b]) == [a, b]
    health.checked(b, "HTTP 503")
    assert health.state(b.url) == DOWN and health.available([a, b]) == [a]
    clock.now += 1000
    assert health.available([a, b]) == [a], "down has no timeout: only a passing check ends it"
    health.checked(b, None)
    assert health.available([a, b]) == [a, b]
    health.failed(a, "x")
    health.failed(a, "x")
    assert health.state(a.url) == EJECTED
    health.checked(a, None)
    assert health.state(a.url) == HEALTHY, "a passing check ends an ejection"


def test_only_active_checks_can_empty_a_role_and_static_mode_then_tries_everyone():
    for panic, expected in ((False, []), (True, None)):
        health, _, members = fleet(2, fail_threshold=1, panic_when_all_down=panic)
        for inst in members:
            health.checked(inst, "ClientConnectorError")
        assert health.available(members) == (members if expected is None else expected)


def test_an_ejected_role_that_shrank_keeps_its_instances_in_rotation():
    health, _, (a, b, c, d) = fleet(4, fail_threshold=1)
    health.failed(a, "x")
    health.failed(b, "x")
    health.left(c)
    health.left(d)
    assert health.available([a, b]) == [a, b]


def test_re_registration_resets_an_ejection_and_departure_drops_late_reports():
    health, _, (a, b) = fleet(2, fail_threshold=1)
    health.failed(b, "x")
    health.rejoined(b)
    assert health.state(b.url) == HEALTHY and health.available([a, b]) == [a, b]
    health.left(b)
    health.failed(b, "late")
    health.checked(b, "late")
    assert health.snapshot([b])[0]["consecutive_failures"] == 0
    health.joined(b)
    assert health.state(b.url) == HEALTHY


def test_instances_out_of_rotation_too_long_are_reported_for_forgetting():
    health, clock, (a, b) = fleet(2, fail_threshold=1, ejection_time_s=10)
    health.failed(b, "x")
    clock.now += 50  # half-open now, still no success since the ejection
    assert health.out_longer_than(60) == []
    clock.now += 20
    assert health.out_longer_than(60) == [b.url]
    health.succeeded(b)
    assert health.out_longer_than(60) == []


def test_snapshot_shape_for_status_pages():
    health, clock, (a, b) = fleet(2, fail_threshold=1, ejection_time_s=30)
    a.inflight = 2
    health.checked(a, None)
    clock.now += 4
    health.failed(b, "ClientConnectorError")
    view_a, view_b = health.snapshot([a, b])
    assert view_a == {
        "url": "http://encode0",
        "role": "encode",
        "state": "healthy",
        "in_rotation": True,
        "inflight": 2,
        "consecutive_failures": 0,
        "ejections": 0,
        "ejected_for_s": None,
        "out_for_s": None,
        "last_check_age_s": 4.0,
        "last_check": "ok",
        "last_problem": None,
    }
    assert view_b["state"] == "ejected" and view_b["ejected_for_s"] == 30 and view_b["in_rotation"] is False
    assert view_b["out_for_s"] == 0
    assert view_b["last_problem"] == "ClientConnectorError" and view_b["last_check"] is None


@pytest.mark.parametrize(
    "kind, counts",
    [
        (upstream.REFUSED, True),
        (upstream.RESET, True),
        (upstream.CONNECT_TIMEOUT, True),
        # Connected, then slow: a long generation, not a broken instance.
        (upstream.HEADERS_TIMEOUT, False),
        (upstream.IDLE_TIMEOUT, False),
        # Our own per-backend cap made it wait.
        (upstream.POOL_TIMEOUT, False),
        (upstream.BROKEN, False),
    ],
)
def test_which_backend_call_failures_count_against_the_instance(kind, counts):
    assert counts_against_instance(kind) is counts


def test_a_refused_ejection_is_logged_once_per_run_of_failures(caplog):
    health, _, (a, b) = fleet(2, fail_threshold=2)
    for _ in range(2):
        health.failed(a, "x")
    with caplog.at_level("WARNING", logger="epd_proxy.health"):
        for _ in range(10):
            health.failed(b, "x")
    assert health.state(b.url) == HEALTHY
    assert len([r for r in caplog.records if "stays in rotation" in r.getMessage()]) == 1
