"""The one polling helper the tests synchronise with (tools/epd_proxy_tools/testing/polling.py)."""

from __future__ import annotations

import pytest

from epd_proxy_tools.testing.polling import eventually, eventually_sync


async def test_a_sync_or_async_check_is_polled_until_truthy_and_its_value_returned():
    calls = []

    async def third_time() -> str | None:
        calls.append(1)
        return "done" if len(calls) == 3 else None

    assert await eventually(third_time, interval=0) == "done"
    assert await eventually(lambda: 7, interval=0) == 7


async def test_ignored_exceptions_count_as_not_yet_and_others_fail_at_once():
    calls = []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("starting")
        return True

    assert await eventually(flaky, interval=0, ignoring=(ConnectionError,)) is True
    with pytest.raises(ValueError):
        await eventually(lambda: int("x"), ignoring=(ConnectionError,))


async def test_the_deadline_fails_with_a_message_made_when_it_passed():
    seen: list[int] = []
    with pytest.raises(AssertionError, match=r"^not true within 0.05s: \d+ polls, none true$"):
        await eventually(
            lambda: seen.append(1), timeout=0.05, interval=0.01, what=lambda: f"{len(seen)} polls, none true"
        )


def test_the_blocking_form_follows_the_same_rules():
    calls = []
    assert eventually_sync(lambda: calls.append(1) or len(calls) >= 2, interval=0) is True
    with pytest.raises(AssertionError, match="never"):
        eventually_sync(lambda: False, timeout=0.05, interval=0.01, what="never")
