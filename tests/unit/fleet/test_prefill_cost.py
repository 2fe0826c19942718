from __future__ import annotations

import pytest

from epd_proxy.fleet.prefill_cost import (
    CHARS_PER_TOKEN,
    FIXED_TOKENS,
    MEAN_WEIGHT_SAMPLES,
    PRIOR_MEDIA_TOKENS,
    PromptSize,
    cheapest,
    claim,
    prefill_speed,
    seconds,
    seconds_per_token,
)


def test_a_prompts_size_is_its_texts_tokens_and_its_medias():
    size = PromptSize()
    assert size.tokens(400, 0.0) == 400 / CHARS_PER_TOKEN
    assert size.tokens(400, 2.0) == 100 + 2 * PRIOR_MEDIA_TOKENS


def test_the_tokens_an_image_takes_are_learnt_from_what_answers_report():
    size = PromptSize()
    for _ in range(100):
        # 100 tokens of text and two images of 64 tokens each.
        size.observe(400, 2.0, 228)
    assert size.tokens(400, 1.0) == pytest.approx(164, abs=1)
    # Nothing to learn from: no media, or no usage; a report the text alone exceeds is bounded.
    learnt = size.media_tokens
    size.observe(400, 0.0, 999), size.observe(400, 1.0, 0)
    assert size.media_tokens == learnt
    size.observe(4000, 1.0, 10)
    assert size.media_tokens >= 1.0


def test_a_placement_costs_its_own_wait_and_the_delay_its_prefill_adds_to_those_running_there():
    assert seconds(0.001, 1000.0, 200.0, 0) == pytest.approx(1.2)
    assert seconds(0.001, 1000.0, 200.0, 3) == pytest.approx(1.0 + 0.2 * 4)


def test_a_claim_is_the_fixed_part_and_what_the_consumer_does_not_hold():
    assert claim(1000.0, 320.0) == FIXED_TOKENS + 680.0
    assert claim(1000.0, 5000.0) == FIXED_TOKENS  # holding more than the estimate: nothing to compute


def measured(seconds_per_token: float, first_tokens: int):
    speed = prefill_speed()
    for n in range(first_tokens):
        speed.observe(1000.0, 20.0 * n + 10.0 - 1000.0 * seconds_per_token, 20.0 * n + 10.0)
    return speed


def test_a_consumer_not_measured_counts_at_the_mean_of_the_measured():
    fast, slow, new = measured(0.001, 1000), measured(0.003, 1000), prefill_speed()
    assert seconds_per_token([fast, slow, new], now=19991.0) == pytest.approx([0.001, 0.003, 0.002], rel=0.07)
    assert seconds_per_token([prefill_speed(), prefill_speed()], now=0.0) == [1.0, 1.0]
    # Idle and unheard from for long: the mean again, so one slow spell does not leave it idle.
    assert seconds_per_token([fast, slow, new], now=30000.0) == [1.0, 1.0, 1.0]


def test_a_few_first_tokens_move_a_consumers_speed_only_a_little_from_the_mean():
    # One slow first token against many fast ones: drawn to the mean, not taken at its word.
    few, many = prefill_speed(), measured(0.001, 1000)
    few.observe(1000.0, 19970.0, 19980.0), few.observe(1000.0, 19980.0, 19990.0)
    slow, fast = seconds_per_token([few, many], now=19991.0)
    assert slow == pytest.approx((0.010 * 2 + 0.0055 * MEAN_WEIGHT_SAMPLES) / (2 + MEAN_WEIGHT_SAMPLES))
    assert slow / fast < 6.0


def test_a_claim_queued_behind_another_measures_only_its_own_time():
    speed = prefill_speed()
    speed.observe(1000.0, 0.0, 1.0)
    speed.observe(1000.0, 0.0, 2.0)  # sent at once, prefilled after the first
    assert speed.item_s == pytest.approx(0.001)


def test_the_cheapest_wins_and_equals_go_to_the_preferred_then_in_the_walks_order():
    assert cheapest([3.0, 1.0, 2.0], 0, [0, 1, 2]) == 1
    assert cheapest([1.0, 1.0, 1.0], 2, [0, 1]) == 2
    assert cheapest([1.0, 0.5, 0.5], 0, [0, 2, 1]) == 2
    # The walk is followed only as far as the first equal of the cheapest.
    walked: list[int] = []

    def walk():
        for i in [0, 2, 1, 0, 2, 1]:
            walked.append(i)
            yield i

    assert cheapest([1.0, 0.5, 0.5], 0, walk()) == 2 and walked == [0, 2]
