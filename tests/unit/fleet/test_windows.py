"""A consumer's prefill window while tenants compete (fleet/windows.py)."""

from __future__ import annotations

import asyncio

import pytest

from epd_proxy.fleet.fairness import Ledger
from epd_proxy.fleet.windows import Windows


def competing(**tokens: int) -> Ledger:
    ledger = Ledger()
    for tenant in tokens:
        ledger.began(tenant, 1.0)
    for tenant, count in tokens.items():
        ledger.charge_tokens(tenant, count, 0)
    return ledger


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_full_window_sends_the_best_priority_then_the_least_served_tenant_then_the_oldest():
    windows = Windows(1, competing(a=100, b=10, c=50))
    entered: list[str] = []

    async def request(name: str, tenant: str, priority: int = 0) -> None:
        async with windows.turn("pd", tenant, priority):
            entered.append(name)
            await asyncio.sleep(0)  # held until the test's next step lets everyone move

    first = windows.of("pd")
    await first.enter("a", 0, -1)  # the window is full
    tasks = [
        asyncio.create_task(request(name, tenant, priority))
        for name, tenant, priority in (
            ("a1", "a", 1),
            ("c1", "c", 1),
            ("b1", "b", 1),
            ("b2", "b", 1),
            ("late", "a", 0),
        )
    ]
    await settle()
    assert windows.waiting() == 5 and not entered
    first.leave()
    await asyncio.gather(*tasks)
    assert entered == ["late", "b1", "b2", "c1", "a1"]
    assert first.open == 0 and windows.waiting() == 0


async def test_one_tenant_alone_is_never_held_back():
    windows = Windows(1, competing(a=0))
    window = windows.of("pd")
    for n in range(5):
        await asyncio.wait_for(window.enter("a", 0, n), 1)
    assert window.open == 5


async def test_a_waiter_that_goes_away_leaves_no_trace_and_the_next_is_sent():
    windows = Windows(1, competing(a=10, b=0))
    window = windows.of("pd")
    await window.enter("a", 0, 0)
    gone = asyncio.create_task(window.enter("b", 0, 1))
    stays = asyncio.create_task(window.enter("a", 0, 2))
    await settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert windows.waiting() == 1
    window.leave()
    await asyncio.wait_for(stays, 1)
    assert window.open == 1 and windows.waiting() == 0


async def test_a_waiter_cancelled_as_it_is_admitted_hands_its_place_on():
    windows = Windows(1, competing(a=10, b=0))
    window = windows.of("pd")
    await window.enter("a", 0, 0)
    first = asyncio.create_task(window.enter("b", 0, 1))
    second = asyncio.create_task(window.enter("a", 0, 2))
    await settle()
    window.leave()  # admits b's, whose task is cancelled before it runs again
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert window.open == 1


async def test_the_wait_predicted_for_a_place_counts_what_goes_first_and_the_measured_hold():
    windows = Windows(2, competing(a=100, b=0))
    window = windows.of("pd")
    assert window.wait_s("a", 0) == 0.0, "nothing measured yet"
    window.hold_s = 1.0
    for n in range(2):
        await window.enter("a", 0, n)
    queued = [asyncio.create_task(window.enter("a", 0, 2 + n)) for n in range(4)]
    await settle()
    # a's four waiting go before a new one of a's: five places short, two given back a second.
    assert window.wait_s("a", 0) == pytest.approx(2.5)
    # b, less served, goes before all of them: one place short.
    assert window.wait_s("b", 0) == pytest.approx(0.5)
    assert windows.wait_s(["pd", "idle"], "a", 0) == 0.0, "another consumer has room"
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


def test_a_place_given_back_updates_the_average_hold():
    window = Windows(1, competing(a=0)).of("pd")
    window.open = 2
    window.leave(2.0)
    assert window.hold_s == 2.0
    window.leave(1.0)
    assert window.hold_s == pytest.approx(1.8)


async def test_a_class_request_goes_at_once_takes_no_place_and_is_predicted_no_wait():
    windows = Windows(1, competing(a=0, b=100))
    window = windows.of("pd")
    window.hold_s = 1.0
    await window.enter("a", 0, 0)  # the window is full
    waiter = asyncio.create_task(window.enter("a", 0, 1))
    await settle()
    assert windows.wait_s(["pd"], "b", 0) > 0 and windows.wait_s(["pd"], "b", -1) == 0.0
    async with asyncio.timeout(5), windows.turn("pd", "b", -1):
        assert window.open == 1 and windows.waiting() == 1, "it took no place and jumped no one"
    assert window.open == 1 and not waiter.done()
    window.leave()
    await asyncio.wait_for(waiter, 1)
