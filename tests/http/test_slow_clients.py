"""Slow and greedy clients against the proxy's own server (epd_proxy.http.server), driven with raw sockets."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from epd_proxy_tools.testing.harness import serve_process, wait_healthy
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

DEADLINE_S = 15.0
JSON = {"Content-Type": "application/json"}


def upload_head(length: int, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def big_body(size: int) -> bytes:
    """A valid chat request of about `size` bytes (one large image)."""
    body = orjson.dumps(chat(image("x")))
    padding = size - len(body)
    return orjson.dumps(chat(image("x" * (padding * 3 // 4))))


async def read_until_closed(reader: asyncio.StreamReader, deadline_s: float = DEADLINE_S) -> bytes:
    """Everything the proxy sends until it closes the connection (a reset counts as closed)."""
    received = bytearray()
    async with asyncio.timeout(deadline_s):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    return bytes(received)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    return int(lines[0].split()[1]), headers, body


async def test_stalled_uploads_leave_admission_to_the_other_clients(make_stack):
    proxy = await make_stack(encoders=1, max_inflight=3, client_body_timeout_s=60.0)
    body = big_body(600_000)
    stalled = []
    try:
        for _ in range(3):
            reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
            writer.write(upload_head(len(body)) + body[: len(body) // 2])
            await writer.drain()
            stalled.append(writer)
        # Their heads are parsed and their handlers run: they hold whatever a request holds while
        # its body is still on the way.
        await eventually(
            lambda: proxy.handlers_in_progress() == 3, what="three stalled uploads inside the proxy", timeout=DEADLINE_S
        )

        async def answered(body: dict) -> tuple[int, dict]:
            async with await proxy.chat(body) as resp:
                return resp.status, await resp.json()

        for round_ in range(2):  # up to the limit at once, twice
            results = await asyncio.gather(*(answered(chat(image(f"{round_}-{n}"))) for n in range(3)))
            assert [status for status, _ in results] == [200] * 3, results
        assert proxy.handlers_in_progress() == 3
    finally:
        for writer in stalled:
            writer.close()


# /start_profile reads with a plain `await request.read()`: the timeout escapes the handler.
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/start_profile"])
async def test_a_stalled_upload_gets_408_within_the_body_timeout(make_stack, path):
    proxy = await make_stack(encoders=1, client_body_timeout_s=1.0)
    body = big_body(600_000)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(upload_head(len(body), path) + body[: len(body) // 2])
        await writer.drain()
        sent = time.monotonic()
        status, headers, answer = parse_response(await read_until_closed(reader))
        waited = time.monotonic() - sent
    finally:
        writer.close()
    assert status == 408 and headers["connection"] == "close"
    assert orjson.loads(answer)["error"]["type"] == "timeout"
    assert waited >= 0.9, "the body clock fired before the client had been silent for the timeout"
    assert proxy.timeouts("body") == 1
    assert 'epd_client_timeouts_total{kind="body"} 1.0' in await proxy.metrics()


async def test_a_slow_but_steady_upload_is_not_cut_off(make_stack):
    """nginx's meaning: the clock runs between two reads, not over the whole body."""
    proxy = await make_stack(encoders=1, client_body_timeout_s=2.0)
    body = orjson.dumps(chat(image("steady")))
    pieces = [body[i : i + len(body) // 12 + 1] for i in range(0, len(body), len(body) // 12 + 1)]
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(upload_head(len(body)))
        started = time.monotonic()
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.25)  # the client's pace, not a synchronisation
        writer.write_eof()
        status, _, answer = parse_response(await read_until_closed(reader))
    finally:
        writer.close()
    assert time.monotonic() - started > 2.0, "the upload must outlast the body timeout to prove anything"
    assert status == 200, answer
    assert proxy.timeouts("body") == 0


@pytest.mark.parametrize("dribble", [False, True], ids=["stalled", "slowloris"])
async def test_a_stalled_request_head_gets_408_within_the_header_timeout(make_stack, dribble):
    proxy = await make_stack(encoders=1, client_header_timeout_s=1.0)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    started = time.monotonic()
    closed = asyncio.ensure_future(read_until_closed(reader))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")
        await writer.drain()
        # A slowloris keeps sending header lines; the head clock does not start over for them.
        while dribble and not closed.done():
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
            await asyncio.wait([closed], timeout=0.2)
        status, headers, answer = parse_response(await closed)
    finally:
        writer.close()
    waited = time.monotonic() - started
    assert status == 408 and headers["connection"] == "close"
    assert orjson.loads(answer)["error"]["type"] == "timeout"
    assert 0.9 <= waited < DEADLINE_S
    assert proxy.timeouts("header") == 1


async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(make_stack):
    proxy = await make_stack(encoders=1, client_header_timeout_s=1.0, client_keepalive_timeout_s=60.0)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    started = time.monotonic()
    try:
        assert await read_until_closed(reader) == b""
    finally:
        writer.close()
    assert time.monotonic() - started >= 0.9
    await eventually(lambda: proxy.gate.open == 0, what="the proxy to forget the connection", timeout=DEADLINE_S)


async def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout(make_stack):
    proxy = await make_stack(encoders=1, client_keepalive_timeout_s=1.0, client_header_timeout_s=60.0)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: proxy\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
        _, headers, _ = parse_response(head)
        assert head.startswith(b"HTTP/1.1 200") and headers.get("connection") != "close"
        await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), DEADLINE_S)
        idle_since = time.monotonic()
        assert await read_until_closed(reader) == b"", "an idle connection is closed without an answer"
    finally:
        writer.close()
    assert time.monotonic() - idle_since >= 0.9
    assert proxy.timeouts("keepalive") == 1 and proxy.timeouts("header") == 0


async def test_connections_over_the_limit_are_refused_while_the_others_are_served(make_stack):
    proxy = await make_stack(encoders=1, max_client_connections=4, client_header_timeout_s=60.0)
    idle = [await asyncio.open_connection(proxy.host, proxy.port) for _ in range(3)]
    try:
        await eventually(lambda: proxy.gate.open == 3, what="three idle connections to be counted", timeout=DEADLINE_S)
        # The fourth: one kept-alive client connection that keeps being served.
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        try:
            async with client.post(f"{proxy.url}/v1/chat/completions", json=chat(image("a"))) as resp:
                assert resp.status == 200
            for _ in range(3):
                reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
                refused = await read_until_closed(reader)
                writer.close()
                # Answered 503 at accept and closed (or just closed, if the answer lost the race).
                if refused:
                    status, headers, body = parse_response(refused)
                    assert status == 503 and headers["retry-after"] == "1"
                    assert orjson.loads(body)["error"]["type"] == "overloaded"
            async with client.post(f"{proxy.url}/v1/chat/completions", json=chat(image("b"))) as resp:
                assert resp.status == 200
            async with client.get(f"{proxy.url}/metrics") as resp:
                text = await resp.text()
            assert "epd_client_connections_refused_total 3.0" in text
            assert "epd_client_connections 4.0" in text
            # A slot freed is a slot for the next client.
            idle.pop()[1].close()
            await eventually(
                lambda: proxy.gate.open == 3, what="the closed connection to be released", timeout=DEADLINE_S
            )
            async with proxy.client.get(f"{proxy.url}/health") as resp:
                assert resp.status == 200
        finally:
            await client.close()
    finally:
        for _, writer in idle:
            writer.close()


# -- `epd-proxy serve` as a process: the limits hold there, with --workers too -------------------


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


async def stalled_upload(port: int, head: bytes, half: bytes) -> int | None:
    """Sends a request head and half its body, then waits for the proxy to answer and close:
    the answer's status, or None for a connection closed or reset without one."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    try:
        writer.write(head + half)
        await writer.drain()
        answer = await read_until_closed(reader, deadline_s=60)
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        writer.close()
    return parse_response(answer)[0] if answer else None


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("limit", [40, 200])
async def test_memory_stays_bounded_under_many_slow_uploads_and_drops_back(limit):
    """200 uploads of 600 KB stall at half: the connection limit caps what the proxy buffers at
    max-client-connections x max-body-bytes, and the memory is given back once they are gone.
    Without a limit the flood adds about 90 MB, twice the bound at 40 connections; at 200
    glibc keeps most of it unless the heap is trimmed."""
    max_body = 1_000_000
    flags = ("--max-client-connections", str(limit), "--max-body-bytes", str(max_body))
    async with serve_process(*flags, "--client-body-timeout", "2") as served:
        proc, url, port = served.proc, served.url, served.port
        body = big_body(600_000)
        head = upload_head(len(body))
        # One kept-alive client holds one of the slots throughout and must be served.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
            for _ in range(3):  # warm up with full-size requests, so the baseline includes their buffers
                async with client.post(f"{url}/v1/chat/completions", data=body, headers=JSON) as resp:
                    assert resp.status == 200
            baseline = rss_bytes(proc.pid)
            flood = asyncio.gather(*(stalled_upload(port, head, body[: len(body) // 2]) for _ in range(200)))
            async with client.post(f"{url}/v1/chat/completions", json=chat(image("meanwhile"))) as resp:
                assert resp.status == 200
            answers = await flood
            peak_growth = rss_bytes(proc.pid, "VmHWM") - baseline
            timed_out = answers.count(408)
            refused = len(answers) - timed_out
            assert set(answers) <= {408, 503, None}, answers
            # Everyone admitted had half a body buffered until the body clock closed it.
            assert 0.75 * (limit - 1) <= timed_out <= limit - 1
            async with client.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert metric(text, "epd_client_connections_refused_total") == refused
            assert metric(text, 'epd_client_timeouts_total{kind="body"}') == timed_out
            print(
                f"limit {limit}: baseline {baseline / 1e6:.1f} MB, peak growth {peak_growth / 1e6:.1f} MB "
                f"(bound {limit * max_body / 1e6:.0f} MB), {timed_out} timed out, {refused} refused"
            )
            assert peak_growth <= limit * max_body, f"peak RSS grew {peak_growth / 1e6:.1f} MB"
            # Gone, and given back (within a few MB of the baseline).
            await eventually(
                lambda: rss_bytes(proc.pid) - baseline <= 8e6,
                timeout=30,
                interval=0.2,
                what=lambda: f"RSS stays {(rss_bytes(proc.pid) - baseline) / 1e6:.1f} MB above the baseline",
            )
            print(f"limit {limit}: {(rss_bytes(proc.pid) - baseline) / 1e6:.1f} MB above the baseline after")
            async with client.post(f"{url}/v1/chat/completions", json=chat(image("after"))) as resp:
                assert resp.status == 200


async def test_the_connection_limit_holds_across_workers():
    async with serve_process("--workers", "2", "--max-client-connections", "3") as served:
        proc, url, port = served.proc, served.url, served.port
        held = []
        try:
            # Connections land on either worker; three of them fill the port's limit, whichever.
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
                assert head.startswith(b"HTTP/1.1 200"), head
                held.append(writer)
            for _ in range(6):  # enough to reach both workers
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
                answer = await read_until_closed(reader)
                writer.close()
                assert not answer or parse_response(answer)[0] == 503
            held.pop().close()
            # The freed slot serves the next client, on whichever worker.
            await wait_healthy(proc, url, DEADLINE_S, what="a freed connection slot was not reused")
        finally:
            for writer in held:
                writer.close()
