"""The backend-call layer against a raw TCP peer that misbehaves on purpose: every kind of "no
answer" is classified, nothing is left in flight, and a cancelled call closes its connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import pytest

from epd_proxy.calls.upstream import (
    BROKEN,
    CONNECT_TIMEOUT,
    HEADERS_TIMEOUT,
    IDLE_TIMEOUT,
    POOL_TIMEOUT,
    REFUSED,
    RESET,
    NoAnswer,
    Timeouts,
)
from epd_proxy.fleet.backends import Instance
from epd_proxy_tools.testing.polling import eventually
from tests.http.raw_backends import OK, call, failure_of, keep_answering, read_request


async def answer_ok(reader, writer):
    await read_request(reader)
    writer.write(OK)


async def test_an_answer_of_any_status_is_an_answer(peer, upstream):
    async def not_found(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope")

    inst = Instance((await peer(not_found)).url, "encode")
    answer = await call(upstream(), inst)
    assert (answer.status, answer.body) == (404, b"nope")
    assert inst.inflight == 0


async def test_refused(upstream):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    failure = await failure_of(call(upstream(), Instance(f"http://127.0.0.1:{port}", "encode")))
    assert failure.kind == REFUSED and failure.status == 502 and failure.stage == "encode"
    assert failure.message.startswith("Encoder request failed")


async def test_closed_before_any_answer_is_a_reset(peer, upstream):
    async def hang_up(reader, writer):
        await read_request(reader)
        writer.close()

    backend = await peer(hang_up)
    inst = Instance(backend.url, "encode")
    failure = await failure_of(call(upstream(), inst))
    assert failure.kind == RESET and failure.status == 502
    assert inst.inflight == 0
    assert backend.connections == 1, "a new connection that fails is not retried"


async def test_an_answer_cut_off_is_broken(peer, upstream):
    async def cut(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    failure = await failure_of(call(upstream(), Instance((await peer(cut)).url, "encode")))
    assert failure.kind == BROKEN and failure.status == 502


async def test_headers_timeout_closes_the_connection(peer, upstream):
    async def silent(reader, writer):
        await read_request(reader)

    backend = await peer(silent)
    inst = Instance(backend.url, "decode")
    failure = await failure_of(call(upstream(), inst, Timeouts(headers=0.2)))
    assert failure.kind == HEADERS_TIMEOUT and failure.status == 504
    assert failure.message == "Encoder request timed out after 0.2s waiting for the answer"
    await eventually(lambda: backend.closed_by_client == 1)
    assert inst.inflight == 0


async def test_the_total_limit_covers_the_body_and_is_named(peer, upstream):
    async def slow_body(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")

    backend = await peer(slow_body)
    failure = await failure_of(call(upstream(), Instance(backend.url, "encode"), Timeouts(total=0.3)))
    assert failure.kind == IDLE_TIMEOUT and failure.limit_s == 0.3 and failure.status == 504
    await eventually(lambda: backend.closed_by_client == 1)


async def test_stream_idle_timeout_between_chunks(peer, upstream):
    async def stall_after_one_chunk(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")

    backend = await peer(stall_after_one_chunk)
    inst = Instance(backend.url, "decode")
    pool = upstream()
    answer = await pool.open(inst, "POST", "/x", body=b"{}", timeouts=Timeouts(), stage="decode", what="Decode")
    assert answer.status == 200 and inst.inflight == 1
    received = []
    with pytest.raises(NoAnswer) as err:
        async for chunk in answer.chunks(idle_timeout=0.2):
            received.append(chunk)
    assert received == [b"first"] and err.value.kind == IDLE_TIMEOUT and err.value.limit_s == 0.2
    assert inst.inflight == 0
    await eventually(lambda: backend.closed_by_client == 1)
    answer.release()  # idempotent
    assert inst.inflight == 0


async def test_pool_wait_is_bounded_under_the_per_backend_cap(peer, upstream):
    async def stream_forever(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")

    inst = Instance((await peer(stream_forever)).url, "decode")
    pool = upstream(max_connections_per_backend=1)
    held = await pool.open(inst, "POST", "/x", body=b"{}", timeouts=Timeouts(), stage="decode", what="Decode")
    failure = await failure_of(call(pool, inst, Timeouts(pool=0.2)))
    assert failure.kind == POOL_TIMEOUT and failure.status == 504
    held.release()
    assert inst.inflight == 0


async def test_a_separate_pool_is_not_limited_by_the_request_pool(peer, upstream):
    async def answer_or_stream(reader, writer):
        request = await read_request(reader)
        if b"/health" in request:
            writer.write(OK)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")

    inst = Instance((await peer(answer_or_stream)).url, "decode")
    requests, probes = upstream(max_connections_per_backend=1), upstream(count_inflight=False)
    held = await requests.open(inst, "POST", "/x", body=b"{}", timeouts=Timeouts(), stage="decode", what="Decode")
    answer = await probes.call(inst, "GET", "/health", timeouts=Timeouts(total=2), stage="probe", what="Probe")
    assert answer.status == 200 and inst.inflight == 1
    held.release()


@contextlib.contextmanager
def never_accepting() -> Iterator[int]:
    """The port of a listener that never accepts, its accept queue full: the kernel drops further SYNs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in (*fillers, listener):
            sock.close()


async def test_connect_timeout(upstream):
    with never_accepting() as port:
        failure = await failure_of(
            call(upstream(), Instance(f"http://127.0.0.1:{port}", "encode"), Timeouts(connect=0.3))
        )
    assert failure.kind == CONNECT_TIMEOUT and failure.limit_s == 0.3 and failure.status == 504
    assert failure.message == "Encoder request timed out after 0.3s while connecting"


async def test_cancelling_a_call_closes_its_connection(peer, upstream):
    async def silent(reader, writer):
        await read_request(reader)

    backend = await peer(silent)
    inst = Instance(backend.url, "encode")
    task = asyncio.create_task(call(upstream(), inst))
    await eventually(lambda: backend.connections == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: backend.closed_by_client == 1)
    assert inst.inflight == 0


async def test_connections_are_reused(peer, upstream):
    async def keep_answering(reader, writer):
        for _ in range(3):
            await read_request(reader)
            writer.write(OK)

    backend = await peer(keep_answering)
    pool, inst = upstream(), Instance(backend.url, "encode")
    for _ in range(3):
        assert (await call(pool, inst)).status == 200
    assert backend.connections == 1


async def answer_once_then_drop(reader, writer):
    await read_request(reader)
    writer.write(OK)
    await read_request(reader)
    writer.close()  # read the whole request, then dropped it without an answer


async def test_an_idempotent_request_dropped_on_a_pooled_connection_is_sent_once_more(peer, upstream):
    backend = await peer(answer_once_then_drop)
    pool, inst = upstream(), Instance(backend.url, "encode")
    assert (await call(pool, inst)).status == 200
    answer = await pool.call(
        inst, "POST", "/x", body=b"{}", timeouts=Timeouts(), stage="encode", what="Encoder", idempotent=True
    )
    assert answer.status == 200 and backend.connections == 2


async def test_a_generation_the_backend_read_and_dropped_is_never_sent_again(peer, upstream):
    """RFC 9110 9.2.2: the backend may have run it; only the pipeline's own retries may resend."""
    backend = await peer(answer_once_then_drop)
    pool, inst = upstream(), Instance(backend.url, "decode")
    assert (await call(pool, inst)).status == 200
    failure = await failure_of(call(pool, inst))
    assert failure.kind == RESET and failure.status == 502
    assert backend.connections == 1


async def test_a_pooled_connection_that_began_answering_is_not_retried(peer, upstream):
    async def answer_once_then_break(reader, writer):
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        writer.write(b"HTTP/1.1 2")
        await writer.drain()
        writer.close()

    backend = await peer(answer_once_then_break)
    pool, inst = upstream(), Instance(backend.url, "encode")
    assert (await call(pool, inst)).status == 200
    failure = await failure_of(call(pool, inst))
    assert failure.kind == BROKEN and backend.connections == 1


async def test_idle_connections_retire_after_keep_alive(peer, upstream):
    backend = await peer(keep_answering)
    pool, inst = upstream(keep_alive_s=0.2), Instance(backend.url, "encode")
    assert (await call(pool, inst)).status == 200
    await eventually(lambda: backend.closed_by_client == 1)
    assert (await call(pool, inst)).status == 200
    assert backend.connections == 2 and pool.connections_in_use() == 0


async def test_streamed_chunks_arrive_as_written(peer, upstream):
    sent = [b"data: 1\n\n", "data: é世\n\n".encode(), b"data: [DONE]\n\n"]

    async def stream(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in sent:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    inst = Instance((await peer(stream)).url, "decode")
    async with await upstream().open(
        inst, "POST", "/x", body=[b"{", b"}"], timeouts=Timeouts(), stage="decode", what="Decode"
    ) as answer:
        assert answer.content_type == "text/event-stream"
        assert b"".join([chunk async for chunk in answer.chunks()]) == b"".join(sent)
    assert inst.inflight == 0


async def test_a_calls_header_replaces_the_pools_own(peer, upstream):
    seen = []

    async def record(reader, writer):
        for _ in range(2):
            seen.append(await read_request(reader))
            writer.write(OK)

    inst = Instance((await peer(record)).url, "encode")
    pool = upstream(headers={"Authorization": "Bearer pool"})
    await pool.call(inst, "GET", "/a", timeouts=Timeouts(), stage="profile", what="Profile")
    await pool.call(
        inst, "GET", "/b", headers={"authorization": "Bearer own"}, timeouts=Timeouts(), stage="profile", what="Profile"
    )
    assert b"Authorization: Bearer pool\r\n" in seen[0]
    assert b"Bearer own" in seen[1] and b"Bearer pool" not in seen[1]


async def test_the_headers_limit_holds_for_a_head_that_trickles_in(peer, upstream):
    async def trickle(reader, writer):
        await read_request(reader)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: yes\r\n":
            writer.write(bytes([byte]))
            await asyncio.sleep(0.02)

    inst = Instance((await peer(trickle)).url, "decode")
    failure = await failure_of(call(upstream(), inst, Timeouts(headers=0.3)))
    assert failure.kind == HEADERS_TIMEOUT


# -- whether the request was sent: what may go elsewhere without risk ------------------------------


async def test_a_refused_connection_sent_nothing_and_a_drop_after_reading_sent_it(peer, upstream):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    refused = await failure_of(call(upstream(), Instance(f"http://127.0.0.1:{port}", "encode")))
    assert refused.kind == REFUSED and not refused.sent

    async def hang_up(reader, writer):
        await read_request(reader)
        writer.close()

    dropped = await failure_of(call(upstream(), Instance((await peer(hang_up)).url, "encode")))
    assert dropped.kind == RESET and dropped.sent


async def test_a_timeout_after_sending_is_sent_and_one_while_connecting_is_not(peer, upstream):
    async def silent(reader, writer):
        await read_request(reader)

    waited = await failure_of(call(upstream(), Instance((await peer(silent)).url, "encode"), Timeouts(headers=0.2)))
    assert waited.kind == HEADERS_TIMEOUT and waited.sent
    with never_accepting() as port:
        inst = Instance(f"http://127.0.0.1:{port}", "encode")
        connecting = await failure_of(call(upstream(), inst, Timeouts(connect=0.3)))
    assert connecting.kind == CONNECT_TIMEOUT and not connecting.sent


async def test_a_request_read_on_a_pooled_connection_stays_sent_when_its_resend_is_refused(upstream):
    servers: list[asyncio.Server] = []

    async def answer_then_read_and_die(reader, writer):
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await read_request(reader)
        servers[0].close()  # no longer listening: the resend on a fresh connection is refused
        writer.close()

    servers.append(await asyncio.start_server(answer_then_read_and_die, "127.0.0.1", 0))
    try:
        inst = Instance(f"http://127.0.0.1:{servers[0].sockets[0].getsockname()[1]}", "encode")
        pool = upstream()
        assert (await call(pool, inst)).status == 200
        failure = await failure_of(
            pool.call(inst, "POST", "/x", body=b"{}", timeouts=Timeouts(), stage="encode", what="E", idempotent=True)
        )
        assert failure.kind == REFUSED and failure.sent
    finally:
        servers[0].close()
