"""Health on a driven clock: ejection (transport, 5xx, gateway), half-open, doubling, the ejection budget,
active checks."""

from __future__ import annotations

import pytest

from epd_proxy.calls import upstream
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.health import DOWN, EJECTED, HALF_OPEN, HEALTHY, Health, counts_against_instance


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
        "consecutive_5xx": 0,
        "consecutive_gateway_failures": 0,
        "ejections": 0,
        "ejected_for_s": None,
        "ejection_reason": None,
        "out_for_s": None,
        "last_check_age_s": 4.0,
        "last_check": "ok",
        "last_problem": None,
    }
    assert view_b["state"] == "ejected" and view_b["ejected_for_s"] == 30 and view_b["in_rotation"] is False
    assert view_b["out_for_s"] == 0
    assert view_b["last_problem"] == "ClientConnectorError" and view_b["last_check"] is None
    assert view_b["ejection_reason"] == "transport"


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


# -- outlier detection on answers ---------------------------------------------------------------


def test_an_instance_answering_500_to_every_call_is_ejected_at_the_threshold_and_says_why():
    health, _, (a, b) = fleet(2, ejection_time_s=30)
    for _ in range(4):
        health.answered(b, 500, "boom")
    assert health.state(b.url) == HEALTHY, "Envoy's default: five in a row, not four"
    assert health.snapshot([b])[0]["consecutive_5xx"] == 4
    health.answered(b, 500, "boom")
    view = health.snapshot([b])[0]
    assert view["state"] == EJECTED and health.available([a, b]) == [a]
    assert view["ejection_reason"] == "5xx" and view["last_problem"] == "HTTP 500: boom"
    assert view["ejected_for_s"] == 30 and view["consecutive_5xx"] == 0


@pytest.mark.parametrize("status", [200, 400, 404, 422, 429])
def test_an_answer_below_500_ends_the_run_and_4xx_never_counts(status):
    health, _, (a, b) = fleet(2)
    for _ in range(4):
        health.answered(b, 500)
    health.answered(b, status)
    for _ in range(4):
        health.answered(b, 500)
    assert health.state(b.url) == HEALTHY
    for _ in range(100):
        health.answered(b, status)
    view = health.snapshot([b])[0]
    assert view["state"] == HEALTHY and view["consecutive_5xx"] == view["consecutive_gateway_failures"] == 0


def test_gateway_failures_add_up_answers_and_transport_failures_each_with_its_own_threshold():
    health, _, (a, b) = fleet(2, fail_threshold=3, consecutive_5xx=0, consecutive_gateway_failure=5)
    for _ in range(2):
        health.failed(b, "refused")
        health.answered(b, 503, "overloaded")  # an answer: the transport run starts over
    view = health.snapshot([b])[0]
    assert view["state"] == HEALTHY and view["consecutive_gateway_failures"] == 4 and view["consecutive_failures"] == 0
    health.failed(b, "refused")
    view = health.snapshot([b])[0]
    assert view["state"] == EJECTED and view["ejection_reason"] == "gateway"
    assert view["last_problem"] == "refused"


def test_a_500_ends_a_gateway_run_but_continues_a_5xx_run():
    health, _, (a, b) = fleet(2, consecutive_5xx=5, consecutive_gateway_failure=3)
    health.answered(b, 502)
    health.answered(b, 504)
    health.answered(b, 500)
    health.answered(b, 503)
    view = health.snapshot([b])[0]
    assert view["state"] == HEALTHY and view["consecutive_gateway_failures"] == 1 and view["consecutive_5xx"] == 4
    health.answered(b, 501)
    assert health.snapshot([b])[0]["ejection_reason"] == "5xx"


def test_transport_failures_neither_count_towards_nor_end_a_5xx_run():
    health, _, (a, b) = fleet(2, fail_threshold=3, consecutive_5xx=3, consecutive_gateway_failure=0)
    health.answered(b, 500)
    health.failed(b, "reset")
    health.answered(b, 500)
    health.failed(b, "reset")
    assert health.state(b.url) == HEALTHY
    health.answered(b, 500)
    assert health.snapshot([b])[0]["ejection_reason"] == "5xx"


def test_zero_turns_an_answer_signal_off_and_its_answers_are_successes():
    health, clock, (a, b) = fleet(
        2, fail_threshold=1, consecutive_5xx=0, consecutive_gateway_failure=0, ejection_time_s=5
    )
    for _ in range(50):
        health.answered(b, 500)
        health.answered(b, 503)
    assert health.state(b.url) == HEALTHY
    health.failed(b, "refused")
    clock.now += 5
    assert health.state(b.url) == HALF_OPEN
    health.answered(b, 503)
    assert health.state(b.url) == HEALTHY, "with both off, an answer proves it is back, as before"
    health2, _, (_, c) = fleet(2, consecutive_5xx=0, consecutive_gateway_failure=2)
    health2.answered(c, 500)
    health2.answered(c, 500)
    assert health2.state(c.url) == HEALTHY
    health2.answered(c, 503)
    health2.answered(c, 503)
    assert health2.snapshot([c])[0]["ejection_reason"] == "gateway"


def test_half_open_after_a_5xx_ejection_goes_back_out_on_one_5xx_for_twice_as_long():
    health, clock, (a, b) = fleet(2, ejection_time_s=10)
    for _ in range(5):
        health.answered(b, 500)
    clock.now += 10
    assert health.state(b.url) == HALF_OPEN
    assert health.snapshot([b])[0]["ejection_reason"] == "5xx", "the reason stays until a success"
    health.answered(b, 500)
    view = health.snapshot([b])[0]
    assert view["state"] == EJECTED and view["ejected_for_s"] == 20 and view["ejection_reason"] == "5xx"
    clock.now += 20
    health.answered(b, 400)
    view = health.snapshot([b])[0]
    assert view["state"] == HEALTHY and view["ejection_reason"] is None
    for _ in range(5):
        health.answered(b, 500)
    assert health.snapshot([b])[0]["ejected_for_s"] == 10, "a success reset the doubling"


def test_half_open_after_a_5xx_ejection_goes_back_out_on_a_transport_failure_too():
    health, clock, (a, b) = fleet(2, ejection_time_s=10)
    for _ in range(5):
        health.answered(b, 500)
    clock.now += 10
    health.failed(b, "refused")
    view = health.snapshot([b])[0]
    assert view["state"] == EJECTED and view["ejection_reason"] == "transport"


def test_5xx_ejection_keeps_the_budget_and_never_takes_the_last_instance():
    health, _, members = fleet(4, max_ejection_percent=50)
    for inst in members:
        for _ in range(20):
            health.answered(inst, 500)
    assert [health.state(m.url) for m in members] == [EJECTED, EJECTED, HEALTHY, HEALTHY]
    health1, _, (only,) = fleet(1, max_ejection_percent=100)
    for _ in range(20):
        health1.answered(only, 500)
    assert health1.available([only]) == [only]


def test_a_passing_check_ends_a_transport_ejection_but_not_one_for_answers():
    health, clock, (a, b) = fleet(2, fail_threshold=1, ejection_time_s=30)
    for _ in range(5):
        health.answered(b, 500)
    health.checked(b, None)
    assert health.state(b.url) == EJECTED, "GET /health says nothing about what chat requests get"
    health.checked(b, "HTTP 503")
    assert health.state(b.url) == DOWN
    health.checked(b, None)
    assert health.state(b.url) == EJECTED, "no longer down, still ejected for its answers"
    clock.now += 30
    assert health.available([a, b]) == [a, b]
    health.answered(b, 200)
    assert health.state(b.url) == HEALTHY
    health.failed(b, "refused")
    health.checked(b, None)
    assert health.state(b.url) == HEALTHY


def test_every_ejection_is_told_with_its_reason():
    health, clock, (a, b, c, d) = fleet(4, fail_threshold=1, consecutive_gateway_failure=2, ejection_time_s=1)
    told = []
    health.on_ejection(lambda role, url, reason: told.append((role, url, reason)))
    health.failed(a, "refused")
    for _ in range(5):
        health.answered(b, 500)
    assert told == [("encode", a.url, "transport"), ("encode", b.url, "5xx")]
    clock.now += 1
    health.answered(b, 200)
    for _ in range(2):
        health.answered(b, 503)
    assert told[-1] == ("encode", b.url, "gateway")
