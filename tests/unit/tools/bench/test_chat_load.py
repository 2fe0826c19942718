"""Reading chat answers for the real-engine bench (chat_load.py)."""

from __future__ import annotations

from epd_proxy.http.request_id import request_id
from epd_proxy_tools.bench.chat_load import (
    Answer,
    Result,
    arrival_times,
    carries_a_token,
    read_answer,
    turn_request_id,
)

ROLE = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TOKEN = b'{"choices":[{"index":0,"delta":{"content":"ab"}}]}'
LAST = b'{"choices":[{"index":0,"delta":{"content":"c"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2}}'


def test_the_role_only_opening_chunk_is_not_a_token():
    assert not carries_a_token(ROLE)
    assert carries_a_token(TOKEN) and carries_a_token(LAST)
    assert not carries_a_token(b"[DONE]") and not carries_a_token(b'{"delta": not json')


def test_an_answer_is_assembled_from_its_events_up_to_done():
    assert read_answer([ROLE, TOKEN, LAST, b"[DONE]", TOKEN]) == (Answer("abc", "stop", 9, 2), None)


def test_an_in_band_error_after_the_200_is_the_result():
    answer, error = read_answer([ROLE, TOKEN, b'{"error": {"message": "engine died"}}'])
    assert answer is None and "engine died" in error


def test_a_result_is_ok_only_with_a_200_an_answer_and_no_error():
    answer = Answer("x", "stop", 1, 1)
    assert Result(0, 0, 1.0, 3.5, 200, answer=answer).ok
    assert Result(0, 0, 1.0, 3.5, 200, answer=answer).latency == 2.5
    assert not Result(0, 0, 1.0, 2.0, 500, answer=answer).ok
    assert not Result(0, 0, 1.0, 2.0, 200, answer=answer, error="late").ok


def test_open_loop_arrivals_are_seeded_increasing_and_at_the_rate():
    times = arrival_times(2000, rate=50.0, seed=3)
    assert times == arrival_times(2000, rate=50.0, seed=3) != arrival_times(2000, rate=50.0, seed=4)
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert 35 < len(times) / times[-1] < 65


def test_each_turn_is_sent_under_an_id_naming_its_conversation_and_turn_that_a_proxy_keeps():
    first, again = turn_request_id(12, 3), turn_request_id(12, 3)
    assert first.startswith("c12-t3-") and first != again
    assert request_id({"x-request-id": first}).value == first
