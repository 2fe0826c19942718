"""Just enough HTTP/1.1 (Content-Length bodies, keep-alive) for the benchmark's fakes and clients.

aiohttp's server and client cost tens of microseconds per message in Python; at a few hundred
requests per second with multi-megabyte bodies that would put the harness, not the proxy, on the
critical path. Requests always carry Content-Length (aiohttp sends it for `data=bytes`); chunked
bodies are read only because a streamed answer relayed by the proxy comes chunked (`--stream`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

MAX_HEAD = 64 * 1024
CHUNKED = -2


class ProtocolError(Exception):
    pass


class MessageReader:
    """Incremental parser of one message stream; feed bytes, get (head, body) pairs."""

    __slots__ = ("_buf", "_need", "_head", "_chunks")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need = -1
        self._head = b""
        self._chunks = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        out = []
        while True:
            if self._need == -1:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > MAX_HEAD:
                        raise ProtocolError("header block too large")
                    return out
                self._head = bytes(self._buf[:end])
                del self._buf[: end + 4]
                self._need = content_length(self._head)
            if self._need == CHUNKED:
                if not self._read_chunks():
                    return out
                body = bytes(self._chunks)
                self._chunks.clear()
            else:
                if len(self._buf) < self._need:
                    return out
                body = bytes(self._buf[: self._need])
                del self._buf[: self._need]
            out.append((self._head, body))
            self._need = -1

    def _read_chunks(self) -> bool:
        """Move whole chunks into the body; True once the last (empty) chunk arrived."""
        while True:
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                return False
            size = int(bytes(self._buf[:line_end]).split(b";")[0], 16)
            start = line_end + 2
            if len(self._buf) < start + size + 2:
                return False
            self._chunks += self._buf[start : start + size]
            del self._buf[: start + size + 2]
            if size == 0:
                return True


def content_length(head: bytes) -> int:
    lower = head.lower()
    if b"\r\ntransfer-encoding: chunked" in lower:
        return CHUNKED
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = lower.find(b"\r\n", at + 2)
    return int(lower[at + 17 : end if end >= 0 else None])


def header(head: bytes, name: bytes) -> bytes | None:
    """`name` must be lower case and include the colon, e.g. b"x-request-id:"."""
    lower = head.lower()
    at = lower.find(b"\r\n" + name)
    if at < 0:
        return None
    start = at + 2 + len(name)
    end = head.find(b"\r\n", start)
    return head[start : end if end >= 0 else None].strip()


def response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = b"OK" if status == 200 else b"ERR"
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (status, reason, content_type, len(body)),
            body,
        )
    )


class ServerProtocol(asyncio.Protocol):
    """Calls `handler(head, body)`; it returns response bytes, an awaitable of them, or a tuple of
    such parts written in order (a streamed answer). Responses on one connection keep request
    order, as HTTP/1.1 requires."""

    def __init__(self, handler: Callable) -> None:
        self._handler = handler
        self._reader = MessageReader()
        self._transport: asyncio.Transport | None = None
        self._tail: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._reader.feed(data)
        except (ProtocolError, ValueError):
            if self._transport is not None:
                self._transport.write(response(400, b'{"error":"bad request"}'))
                self._transport.close()
            return
        for head, body in messages:
            result = self._handler(head, body)
            if isinstance(result, bytes) and self._tail is None:
                self._transport.write(result)
            else:
                self._chain(result)

    def _chain(self, result) -> None:
        previous = self._tail

        async def send():
            if previous is not None:
                await previous
            for part in result if isinstance(result, tuple) else (result,):
                payload = await part if not isinstance(part, bytes) else part
                if self._transport is not None:
                    self._transport.write(payload)

        task = asyncio.ensure_future(send())
        self._tail = task
        task.add_done_callback(self._clear_tail)

    def _clear_tail(self, task: asyncio.Future) -> None:
        if self._tail is task:
            self._tail = None


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection, one request at a time (closed loop)."""

    def __init__(self) -> None:
        self._reader = MessageReader()
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        self._transport = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._reader.feed(data)
        except (ProtocolError, ValueError) as exc:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)
            return
        for message in messages:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(message)

    @property
    def alive(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes, bytes]:
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.writelines((head, body))
        resp_head, resp_body = await self._waiter
        self._waiter = None
        # "HTTP/1.1 200 OK"
        return int(resp_head[9:12]), resp_head, resp_body

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def request_head(method: str, host: str, path: str, length: int, extra: bytes = b"") -> bytes:
    return (
        (
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n"
        ).encode()
        + extra
        + b"\r\n"
    )


async def connect(host: str, port: int) -> ClientConnection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(ClientConnection, host, port)
    return protocol
