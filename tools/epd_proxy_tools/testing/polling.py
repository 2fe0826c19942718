"""Synchronise on state, never on elapsed time: poll with a deadline (loaded 2-core machines)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

# What a message is: text, or a function asked only once the deadline passed (to say what was seen last).
What = str | Callable[[], str]


def _failure(timeout: float, what: What, check: Callable[[], Any]) -> AssertionError:
    said = what() if callable(what) else what
    return AssertionError(f"not true within {timeout:g}s: {said or check}")


async def eventually(
    check: Callable[[], Any],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: What = "",
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call `check` (plain or async) until it returns something truthy, and return that. An exception
    of a type in `ignoring` counts as not yet (a server still starting), any other one fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except ignoring:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise _failure(timeout, what, check)
        await asyncio.sleep(interval)


def eventually_sync(check: Callable[[], Any], *, interval: float = 0.1, **options: Any) -> Any:
    """`eventually` for tests that block (threads, subprocesses) rather than run on an event loop:
    the same loop, on an event loop of its own, so both forms keep one set of rules."""
    return asyncio.run(eventually(check, interval=interval, **options))


async def get_json(client, url: str) -> tuple[int, Any]:
    async with client.get(url) as resp:
        return resp.status, await resp.json()
