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
