"""What one request did (trace.py): the record every step fills in."""

from __future__ import annotations

import time

from epd_proxy.journey.trace import Trace


def test_a_trace_starts_empty_and_clocked_now():
    before = time.perf_counter()
    trace = Trace("r-1")
    assert before <= trace.started <= time.perf_counter()
    assert (trace.request_id, trace.items, trace.attempts, trace.outcome) == ("r-1", 0, 0, "-")
    assert trace.encode_s == trace.prefill_s == trace.decode_ttfb_s == 0.0


def test_traces_share_no_state():
    first, second = Trace("a"), Trace("b")
    first.charged_5xx.add("http://e0")
    assert second.charged_5xx == set()


def test_a_trace_takes_no_attribute_it_does_not_declare():
    # slots: a step writing a misspelt field fails at once instead of feeding nothing to the log.
    trace = Trace("r")
    try:
        trace.encoder_request = 1
    except AttributeError:
        return
    raise AssertionError("Trace accepted an undeclared attribute")
