"""The backend-call layer against hand-driven HTTP/1.1 servers that break the rules on purpose.

What must hold whatever a backend sends: an answer reaches only the exchange it answers, memory
stays bounded, a request that may have run is not sent twice, and a large body is written no
faster than the backend reads it.
"""

from __future__ import annotations

import asyncio
import random
import resource
import socket
import threading

import pytest

from epd_proxy.calls.upstream import (
    BROKEN,
    HEADERS_TIMEOUT,
    REFUSED_ANSWER,
    Limits,
    NoAnswer,
    Timeouts,
    Upstream,
)
from epd_proxy.fleet.backends import Instance
from epd_proxy_tools.testing.polling import eventually
from tests.http.raw_backends import answer, call, echo_tags, failure_of, keep_answering, read_request, tag_of


async def post(pool: Upstream, inst: Instance, body: bytes, stage: str = "decode", **options):
    return await pool.call(
        inst, "POST", "/x", body=body, timeouts=Timeouts(total=10), stage=stage, what="Call", **options
    )


class Refusals:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, stage: str, reason: str) -> None:
        self.seen.append((stage, reason))


async def test_a_second_answer_glued_after_a_complete_one_reaches_nobody(peer, upstream):
    glued = []

    async def glue(reader, writer):
        if not glued:
            glued.append(True)
            first = await read_request(reader)
            writer.write(answer(tag_of(first)) + answer(b"forged", b"X-Forged: yes\r\n"))  # one write
        await echo_tags(reader, writer)

    backend = await peer(glue)
    refusals = Refusals()
    pool, inst = upstream(on_refused=refusals), Instance(backend.url, "decode")
    first = await post(pool, inst, b"first")
    assert first.body == b"first" and "x-forged" not in first.headers
    second = await post(pool, inst, b"second")
    assert second.body == b"second" and "x-forged" not in second.headers
    assert backend.connections == 2, "the connection that carried the forged answer was closed, not reused"
    assert refusals.seen == [("decode", "second_answer")], refusals.seen


async def test_bytes_on_an_idle_connection_close_it_and_never_reach_the_next_exchange(peer, upstream):
    parked, stray_sent = asyncio.Event(), asyncio.Event()

    async def speak_out_of_turn(reader, writer):
        if not stray_sent.is_set():
            request = await read_request(reader)
            writer.write(answer(tag_of(request)))
            await parked.wait()
            writer.write(answer(b"stray"))  # nobody asked
            await writer.drain()
            stray_sent.set()
        await echo_tags(reader, writer)

    backend = await peer(speak_out_of_turn)
    refusals = Refusals()
    pool, inst = upstream(on_refused=refusals), Instance(backend.url, "decode")
    assert (await post(pool, inst, b"one")).body == b"one"
    parked.set()
    await eventually(lambda: refusals.seen == [("idle", "unsolicited")])
    assert (await post(pool, inst, b"two")).body == b"two"
    assert backend.connections == 2


def _read_request_blocking(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-l"))
    while len(rest) < length:
        rest += conn.recv(65536)
    return rest


async def test_a_readable_idle_connection_is_never_taken_from_the_pool(upstream):
    """httpcore's check before reuse: bytes already in the socket that the event loop has not yet
    handed to the connection. A server thread writes them while the loop is blocked, so the
    pool's check is the only thing that can notice them."""
    listener = socket.create_server(("127.0.0.1", 0))
    go, sent = threading.Event(), threading.Event()

    def serve() -> None:
        first, _ = listener.accept()
        first.sendall(answer(_read_request_blocking(first)))
        go.wait(10)
        first.sendall(answer(b"stray"))
        sent.set()
        second, _ = listener.accept()
        second.sendall(answer(_read_request_blocking(second)))
        second.recv(1)
        first.close()
        second.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    pool = upstream()
    inst = Instance(f"http://127.0.0.1:{listener.getsockname()[1]}", "decode")
    try:
        assert (await post(pool, inst, b"one")).body == b"one"
        go.set()
        assert sent.wait(10)  # blocking: the loop cannot read the stray bytes before the next call
        assert (await post(pool, inst, b"two")).body == b"two"
    finally:
        await pool.close()
        thread.join(10)
        listener.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


async def test_a_huge_head_is_refused_early_and_memory_stays_bounded(peer, upstream):
    async def huge_head(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Filler: " + b"a" * 4000 + b"\r\n"
        try:
            for _ in range(6000):  # 24 MB
                writer.write(line)
                await writer.drain()
        except ConnectionError:
            pass

    refusals = Refusals()
    inst = Instance((await peer(huge_head)).url, "encode")
    before = rss_bytes()
    failure = await failure_of(post(upstream(on_refused=refusals), inst, b"{}", stage="encode"))
    assert failure.kind == REFUSED_ANSWER and failure.status == 502
    assert failure.stage == "encode" and failure.backend == inst.url
    assert "response head over" in failure.message
    assert refusals.seen == [("encode", "head_too_large")]
    assert rss_bytes() - before < 16 << 20


@pytest.mark.parametrize(
    "head, reason",
    [
        (b"".join(b"X-H%d: v\r\n" % i for i in range(101)), "too_many_headers"),
        (b"X-Long: " + b"b" * 9000 + b"\r\n", "field_too_large"),
    ],
)
async def test_header_count_and_field_size_are_bounded(peer, upstream, head, reason):
    async def send(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"Content-Length: 2\r\n\r\n{}")

    refusals = Refusals()
    inst = Instance((await peer(send)).url, "encode")
    failure = await failure_of(post(upstream(on_refused=refusals), inst, b"{}", stage="encode"))
    assert failure.kind == REFUSED_ANSWER and refusals.seen == [("encode", reason)]


async def test_an_endless_answer_read_whole_is_cut_at_the_cap(peer, upstream):
    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (65536, b"z" * 65536)
        try:
            while True:
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            pass

    refusals = Refusals()
    inst = Instance((await peer(endless)).url, "encode")
    pool = upstream(on_refused=refusals, limits=Limits(buffered_body_bytes=4 << 20))
    before = rss_bytes()
    failure = await failure_of(post(pool, inst, b"{}", stage="encode"))
    assert failure.kind == REFUSED_ANSWER and "over 4194304 bytes" in failure.message
    assert refusals.seen == [("encode", "body_too_large")]
    assert rss_bytes() - before < 24 << 20
    assert inst.inflight == 0 and pool.connections_in_use() == 0


async def test_a_reset_mid_body_is_broken(peer, upstream):
    async def reset(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await writer.drain()
        writer.transport.abort()

    failure = await failure_of(post(upstream(), Instance((await peer(reset)).url, "decode"), b"{}"))
    assert failure.kind == BROKEN


async def test_duplicate_headers_are_kept_and_trailers_stay_apart(peer, upstream):
    async def send(reader, writer):
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nVary: x\r\nVary: y\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Checksum: 42\r\n\r\n"
        )

    got = await post(upstream(), Instance((await peer(send)).url, "decode"), b"{}")
    assert got.body == b"ok"
    assert got.headers.get_all("set-cookie") == ["a=1", "b=2"] and got.headers.get("Vary") == "x, y"
    assert "x-checksum" not in got.headers and got.trailers.get("x-checksum") == "42"


async def test_a_large_body_waits_for_the_backend_to_read_and_the_write_is_bounded(peer, upstream):
    """Back-pressure: a backend that never reads leaves the body with its owner, not copied into the
    transport's buffer; and the stage's timeout covers the write, so the call ends."""
    body = b"x" * (64 << 20)

    async def never_read(reader, writer):
        await asyncio.sleep(30)

    pool, inst = upstream(), Instance((await peer(never_read)).url, "decode")
    before = rss_bytes()
    failure = await failure_of(
        pool.call(inst, "POST", "/x", body=body, timeouts=Timeouts(headers=1.0), stage="decode", what="Decode")
    )
    assert failure.kind == HEADERS_TIMEOUT
    assert rss_bytes() - before < 16 << 20


async def test_an_instance_that_leaves_takes_its_pool_state_with_it(peer, upstream):
    backend = await peer(keep_answering)
    pool, inst = upstream(max_connections_per_backend=2), Instance(backend.url, "encode")
    assert (await call(pool, inst)).status == 200
    assert inst.url in pool._origins and inst.url in pool._slots
    pool.left(inst)
    assert inst.url not in pool._origins and inst.url not in pool._slots
    await eventually(lambda: backend.closed_by_client == 1)


async def test_under_concurrency_every_caller_gets_exactly_its_own_answer(peer, upstream):
    """Tagged answers through a backend that glues forged answers, breaks limits, cuts answers off
    and drops connections at random: an answer is the caller's own or a failure, never another's.
    (Bytes sent out of turn on an idle connection have their own tests above: under concurrency
    they race the next request, and no HTTP/1.1 client can tell them from its answer then.)"""
    rng = random.Random(20)

    async def chaotic(reader, writer):
        while True:
            request = await read_request(reader)
            tag = tag_of(request)
            roll = rng.random()
            if roll < 0.15:
                writer.write(answer(tag) + answer(b"forged-" + tag))
            elif roll < 0.25:
                writer.close()
                return
            elif roll < 0.32:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n" + b"X: y\r\n" * 200 + b"\r\n")
                writer.close()
                return
            elif roll < 0.38:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + tag[:3])
                writer.close()
                return
            else:
                writer.write(answer(tag))
            await writer.drain()

    pool, inst = upstream(), Instance((await peer(chaotic)).url, "decode")
    outcomes = {"own": 0, "failed": 0}

    async def client(n: int) -> None:
        for i in range(25):
            tag = b"client-%d-call-%d" % (n, i)
            try:
                got = await post(pool, inst, tag)
            except NoAnswer:
                outcomes["failed"] += 1
                continue
            assert got.body == tag, (got.body, tag)
            outcomes["own"] += 1

    await asyncio.gather(*(client(n) for n in range(40)))
    assert outcomes["own"] > 500 and outcomes["failed"] > 0
    await eventually(lambda: pool.connections_in_use() == 0)
    assert inst.inflight == 0
