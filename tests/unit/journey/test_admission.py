"""--max-inflight admission without a server."""

from __future__ import annotations

import pytest

from epd_proxy.errors import ProxyError
from epd_proxy.journey.admission import Admission


class Count:
    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


def test_requests_past_the_limit_are_a_counted_overloaded_503():
    rejected = Count()
    admission = Admission(2, rejected)
    with admission.admit(), admission.admit():
        assert admission.inflight == 2
        with pytest.raises(ProxyError) as refusal, admission.admit():
            pass
        assert (refusal.value.status, refusal.value.stage, refusal.value.error_type) == (503, "admission", "overloaded")
        assert "limit of 2 requests in flight" in refusal.value.message
        assert rejected.value == 1 and admission.inflight == 2
    assert admission.inflight == 0
    with admission.admit():  # a freed slot admits again
        assert admission.inflight == 1


def test_a_request_that_fails_gives_its_slot_back():
    admission = Admission(1, Count())
    with pytest.raises(RuntimeError), admission.admit():
        raise RuntimeError("the pipeline broke")
    assert admission.inflight == 0


def test_without_a_limit_everything_is_admitted_and_still_counted():
    rejected = Count()
    admission = Admission(0, rejected)
    with admission.admit(), admission.admit(), admission.admit():
        assert admission.inflight == 3
    assert rejected.value == 0


# -- the wait a request is predicted at arrival, and what is turned away ---------------------------

from epd_proxy.journey.admission import (  # noqa: E402
    DEADLINE,
    INFLIGHT,
    OVER,
    SHARE,
    WITHIN,
    Backlog,
    Encoder,
    Wait,
    predicted_wait,
    request_deadline,
    shed_decision,
)


def backlog(*encoders: tuple[float, float, float], **others) -> Backlog:
    return Backlog(tuple(Encoder(*e) for e in encoders), **others)


def test_the_wait_is_the_earliest_any_encoder_could_finish_the_largest_item():
    # Backlogs 4 s and 1 s; a sub-request costs 0.1 s, an image 0.5 s on each.
    fleet = backlog((4.0, 0.1, 0.5), (1.0, 0.1, 0.5))
    assert predicted_wait(fleet, largest_item=2.0) == Wait(pytest.approx(1.0 + 0.1 + 0.5 * 2.0), True)
    # A request without media waits for no encoder.
    assert predicted_wait(fleet, largest_item=0.0) == Wait(0.0, False)
    # An idle encoder: the request's own encoding, and no queue.
    assert predicted_wait(backlog((0.0, 0.1, 0.5), (1.0, 0.1, 0.5)), 1.0) == Wait(pytest.approx(0.6), False)


def test_without_encoders_in_rotation_no_encoder_wait_is_predicted():
    assert predicted_wait(backlog(), largest_item=1.0) == Wait(0.0, False)


def test_beyond_the_consumers_last_resort_media_go_raw_so_the_encoder_wait_stops_there():
    fleet = backlog((60.0, 0.1, 0.5), raw_after_s=10.0)
    assert predicted_wait(fleet, largest_item=1.0) == Wait(10.0, True)


def test_a_full_consumer_makes_a_request_wait_for_a_slot():
    # Each consumer serves 4 at once, a slot is held 2 s on average; the least busy has 6 in flight:
    # 3 are ahead of a new request for 4 slots, so it waits 3/4 of a service time.
    fleet = backlog(consumers=(9, 6), consumer_slots=4, service_s=2.0)
    assert predicted_wait(fleet, largest_item=0.0) == Wait(pytest.approx(1.5), True)
    # Not full, or no service time measured yet: no wait.
    assert predicted_wait(backlog(consumers=(3,), consumer_slots=4, service_s=2.0), 0.0) == Wait(0.0, False)
    assert predicted_wait(backlog(consumers=(9,), consumer_slots=4, service_s=0.0), 0.0) == Wait(0.0, False)
    # Encoding and the consumer's queue go on side by side: the later of the two.
    both = backlog((1.0, 0.0, 0.5), consumers=(6,), consumer_slots=4, service_s=2.0)
    assert predicted_wait(both, largest_item=1.0) == Wait(pytest.approx(1.5), True)


def test_while_tenants_compete_the_wait_for_a_consumer_window_is_part_of_the_wait():
    # The encoders would be done in 0.6 s, a place in a consumer's window frees in 2 s: 2 s.
    fleet = backlog((0.0, 0.1, 0.5), window_s=2.0)
    assert predicted_wait(fleet, largest_item=1.0) == Wait(pytest.approx(2.0), True)
    # Encoding takes longer than the window's wait: the encoding's.
    assert predicted_wait(backlog((3.0, 0.1, 0.5), window_s=2.0), 1.0) == Wait(pytest.approx(3.6), True)


def test_a_request_that_cannot_start_within_its_deadline_is_a_503_with_the_seconds_to_retry_after():
    shed = shed_decision(Wait(7.2, True), deadline_s=2.0, share=WITHIN)
    assert shed is not None and (shed.status, shed.reason, shed.retry_after_s) == (503, DEADLINE, 6)
    assert shed_decision(Wait(1.9, True), deadline_s=2.0, share=WITHIN) is None
    assert shed_decision(Wait(100.0, True), deadline_s=None, share=WITHIN) is None
    # Retry-After is whole seconds, at least one.
    assert shed_decision(Wait(2.01, True), deadline_s=2.0, share=WITHIN).retry_after_s == 1
    # Slower than the deadline with nothing queued is not overload: the fleet serves it.
    assert shed_decision(Wait(7.2, False), deadline_s=2.0, share=WITHIN) is None


def test_a_tenant_over_its_share_is_a_429_when_the_fleet_is_past_its_deadline_and_never_on_an_idle_fleet():
    shed = shed_decision(Wait(2.5, True), deadline_s=2.0, share=OVER)
    assert shed is not None and (shed.status, shed.reason, shed.retry_after_s) == (429, SHARE, 3)
    # Within its deadline, or with none, or on an idle fleet, being over its share is no reason.
    assert shed_decision(Wait(1.5, True), deadline_s=2.0, share=OVER) is None
    assert shed_decision(Wait(9.0, True), deadline_s=None, share=OVER) is None
    assert shed_decision(Wait(9.0, False), deadline_s=2.0, share=OVER) is None


def test_groups_fair_queueing_sends_after_a_request_are_not_part_of_its_wait():
    # 3 s of backlog on the encoder, 2.5 s of it groups queued in the proxy of tenants served more.
    encoder = Encoder(3.0, 0.0, 0.5)
    assert predicted_wait(Backlog((encoder,)), 1.0) == Wait(pytest.approx(3.5), True)
    fair = Encoder(3.0, 0.0, 0.5, behind_s=2.5)
    assert predicted_wait(Backlog((fair,)), 1.0) == Wait(pytest.approx(1.0), True)
    # Only such groups: nothing is surely ahead of it.
    idle = Encoder(2.0, 0.0, 0.5, behind_s=2.0)
    assert predicted_wait(Backlog((idle,)), 1.0) == Wait(pytest.approx(0.5), False)


@pytest.mark.parametrize(
    "header, tenant_s, expected",
    [
        (None, None, None),
        (None, 2.0, 2.0),
        ("500", None, 0.5),
        ("500", 2.0, 0.5),
        # A client may shorten its tenant's deadline, never lengthen it.
        ("9000", 2.0, 2.0),
        ("99999999999", None, 3600.0),
        # Past what int() reads by default (4300 digits): still only the longest deadline.
        ("9" * 5000, None, 3600.0),
    ],
)
def test_the_deadline_is_the_clients_header_bounded_by_the_tenants(header, tenant_s, expected):
    assert request_deadline(header, tenant_s) == expected


@pytest.mark.parametrize("header", ["", "soon", "0", "-5", "1.5", "1e3"])
def test_a_deadline_header_that_is_not_a_positive_integer_is_a_400(header):
    with pytest.raises(ProxyError) as refusal:
        request_deadline(header, None)
    assert refusal.value.status == 400 and "x-request-deadline-ms" in refusal.value.message


def test_the_max_inflight_503_says_when_to_retry_from_the_backlog():
    admission = Admission(1, Count())
    with admission.admit(), pytest.raises(ProxyError) as refusal, admission.admit(lambda: 4.2):
        pass
    assert refusal.value.retry_after_s == 5 and INFLIGHT == "inflight"
    with admission.admit(), pytest.raises(ProxyError) as refusal, admission.admit():
        pass
    assert refusal.value.retry_after_s == 1
