"""Fixtures of the HTTP tests beyond the shared stacks (tests/conftest.py)."""

import pytest
import zmq.asyncio

from tests.http.raw_backends import peer, upstream  # noqa: F401 (fixtures of the upstream tests)


@pytest.fixture
async def context():
    """A ZMQ context for tests that publish or follow KV events, closed without lingering."""
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)
