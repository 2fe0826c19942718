"""Hand-driven HTTP/1.1 backends on raw asyncio sockets, and pools of the backend-call layer
that close with the test: the fixtures of the upstream tests (see conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream
from epd_proxy.fleet.backends import Instance

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@dataclass
class Peer:
    url: str
    connections: int = 0
    closed_by_client: int = 0


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@pytest.fixture
async def peer():
    servers = []

    async def start(behaviour: Handler) -> Peer:
        state = Peer("")

        async def handle(reader, writer):
            state.connections += 1
            try:
                await behaviour(reader, writer)
                # Wait for the client to hang up: that is how a closed connection is observed.
                while await reader.read(65536):
                    pass
                state.closed_by_client += 1
            except (ConnectionError, asyncio.IncompleteReadError):
                state.closed_by_client += 1
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return state

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def upstream():
    pools = []

    def make(**kwargs) -> Upstream:
        pool = Upstream(**kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.close()


async def call(pool: Upstream, inst: Instance, timeouts: Timeouts = Timeouts(), path: str = "/x"):
    return await pool.call(inst, "POST", path, body=b"{}", timeouts=timeouts, stage="encode", what="Encoder request")


async def failure_of(awaitable) -> NoAnswer:
    with pytest.raises(NoAnswer) as err:
        async with asyncio.timeout(10):
            await awaitable
    return err.value


async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(OK)


def tag_of(request: bytes) -> bytes:
    return request.rsplit(b"\r\n\r\n", 1)[1]


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def echo_tags(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request with its own body: a caller can tell its answer from another's."""
    while True:
        writer.write(answer(tag_of(await read_request(reader))))
