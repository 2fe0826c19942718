"""The test stacks every category builds, from the one harness (epd_proxy_tools.testing.harness)."""

from __future__ import annotations

from typing import Any

import pytest

from epd_proxy_tools.testing.harness import Stack, start_stack


@pytest.fixture
async def make_stack():
    """`await make_stack(...)`: fakes and an in-process proxy (see `start_stack`), stopped after the test."""
    stacks: list[Stack] = []

    async def build(**options: Any) -> Stack:
        stack = await start_stack(**options)
        stacks.append(stack)
        return stack

    yield build
    for stack in reversed(stacks):
        await stack.close()
