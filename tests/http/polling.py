"""Synchronise on state, never on elapsed time: poll with a deadline (loaded 2-core machines)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def eventually(check: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.02, what: str = "") -> Any:
    """Call `check` (plain or async) until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout:g}s: {what or check}")
        await asyncio.sleep(interval)


async def get_json(client, url: str) -> tuple[int, Any]:
    async with client.get(url) as resp:
        return resp.status, await resp.json()
