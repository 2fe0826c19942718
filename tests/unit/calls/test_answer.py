"""What a backend call comes back with: the kinds of "no answer", their messages, and which limit
a phase gets."""

from __future__ import annotations

import pytest

from epd_proxy.calls.answer import (
    BROKEN,
    CONNECT_TIMEOUT,
    REFUSED,
    REFUSED_ANSWER,
    RESET,
    NoAnswer,
    kind_of,
    smaller,
)
from epd_proxy.calls.connection import Closed


def no_answer(kind: str, detail: str = "", limit_s: float | None = None) -> NoAnswer:
    return NoAnswer(kind, detail, what="Encoder request", stage="encode", backend="http://e", limit_s=limit_s)


def test_a_timeout_is_a_504_naming_the_phase_and_its_limit():
    failure = no_answer(CONNECT_TIMEOUT, limit_s=2.5)
    assert failure.timed_out and failure.status == 504
    assert failure.message == "Encoder request timed out after 2.5s while connecting"
    assert failure.reason == "connect_timeout within 2.5s"
    assert no_answer(CONNECT_TIMEOUT).message == "Encoder request timed out while connecting"


def test_a_transport_failure_is_a_502_with_its_detail():
    failure = no_answer(REFUSED, "ConnectionRefusedError: [Errno 111]")
    assert not failure.timed_out and failure.status == 502
    assert failure.message == "Encoder request failed: ConnectionRefusedError: [Errno 111]"
    assert failure.reason == "refused: ConnectionRefusedError: [Errno 111]"
    assert (failure.stage, failure.backend) == ("encode", "http://e")


@pytest.mark.parametrize(
    "closed, kind",
    [
        (Closed("reset by peer", answered=False), RESET),
        (Closed("cut off", answered=True), BROKEN),
        (Closed("too large", answered=True, refused=True), REFUSED_ANSWER),
    ],
)
def test_a_closed_exchange_is_classified_by_how_far_the_answer_got(closed, kind):
    assert kind_of(closed) == kind


def test_the_smaller_limit_wins_and_none_means_no_limit():
    assert smaller(None, None) is None
    assert smaller(3.0, None) == smaller(None, 3.0) == 3.0
    assert smaller(2.0, 5.0) == smaller(5.0, 2.0) == 2.0
