"""Failure semantics against real vLLM: its in-band stream errors and a decode that dies mid-stream.

How vLLM 0.32 (CPU build) can be made to fail a generation on purpose, with no Mooncake: a
request whose `image_embeds` reference names an identifier PD's encoder cache already holds with
another number of embeddings is finished with `finish_reason="error"`
(Scheduler._reject_on_encoder_cache_embed_mismatch). Streaming, that is a 200 whose events are the
role chunk, `data: {"error": ...}` and `[DONE]`; that is the in-band error the proxy must treat
like a 500. (The transient case the retry exists for, a Mooncake push that never arrives, needs
the Mooncake transfer engine, which the CPU build does not have.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request

import pytest

from epd_proxy_tools.local.supervisor import http_ok
from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import chat_body, chat_ok, extra_proxy, finished_requests, make_image, metric_total, post_json

pytestmark = pytest.mark.e2e

SEEDS = iter(range(20_000, 30_000))


def stream_events(url: str, body: dict, on_first_content=None, timeout: float = 120.0) -> tuple[int, list]:
    """Status and the parsed SSE events of a streaming request (raw text for non-JSON data)."""
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    events: list = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        status = resp.status
        buffer = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                if not frame.startswith(b"data: "):
                    continue
                data = frame[6:].decode()
                event = data if data == "[DONE]" else json.loads(data)
                events.append(event)
                if on_first_content is not None and _content(event):
                    on_first_content()
                    on_first_content = None
    return status, events


def _content(event) -> str:
    if not isinstance(event, dict) or not event.get("choices"):
        return ""
    return event["choices"][0].get("delta", {}).get("content") or ""


@pytest.fixture
def trusting_proxy(stack):
    """A second proxy in front of the same servers that lets a client send `image_embeds`
    references (what a trusted router in front may do), with one decode retry."""
    with extra_proxy(stack, "trusting-proxy", "--trust-client-fields", "--decode-retries", "1") as url:
        yield url


def test_vllm_in_band_error_is_retried_then_relayed_as_sent(stack, trusting_proxy):
    image = make_image(next(SEEDS))
    # Publish the image: PD's encoder cache now holds its identifier with 48 embeddings.
    chat_ok(stack.proxy_url, chat_body([image]))
    uuid = hashlib.sha256(image.encode()).hexdigest()
    body = chat_body([])
    # A grid that claims 24 embeddings for the same identifier: vLLM fails the generation.
    body["messages"][0]["content"].append(
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 12]}, "uuid": uuid}
    )

    direct_status, direct = stream_events(stack.pd_url, body)
    assert direct_status == 200
    errors = [e for e in direct if isinstance(e, dict) and "error" in e]
    if not errors:
        pytest.fail(f"vLLM did not fail the generation in-band; its events: {direct!r}")
    assert direct[-1] == "[DONE]" and not any(_content(e) for e in direct)

    retries = metric_total(trusting_proxy, "epd_retries_total", stage="decode")
    pd_before = finished_requests(stack.pd_url)
    status, via_proxy = stream_events(trusting_proxy, body)
    assert status == 200
    # The first attempt's error was held back and retried; the second one is relayed as vLLM sent it.
    assert metric_total(trusting_proxy, "epd_retries_total", stage="decode") == retries + 1
    assert [e for e in via_proxy if isinstance(e, dict) and "error" in e] == errors
    assert via_proxy[-1] == "[DONE]"
    eventually_sync(
        lambda: finished_requests(stack.pd_url) >= pd_before + 2, interval=0.3, what="PD counts both generations"
    )
    assert http_ok(stack.by_name("pd").health_url), "PD died"


def test_pd_killed_mid_stream_ends_in_an_error_event_counted_as_aborted(stack):
    image = make_image(next(SEEDS))
    body = chat_body([image], max_tokens=1500, ignore_eos=True)
    aborted = metric_total(stack.proxy_url, "epd_requests_total", status="aborted")
    pd = stack.by_name("pd")

    def kill_pd():
        os.killpg(pd.pgid, signal.SIGKILL)

    started = time.monotonic()
    status, events = stream_events(stack.proxy_url, body, on_first_content=kill_pd)
    assert status == 200
    assert any(_content(e) for e in events), events[:3]
    error = events[-2]["error"]
    assert events[-1] == "[DONE]" and error["stage"] == "decode" and error["code"] == 502, events[-3:]
    assert time.monotonic() - started < 60
    assert metric_total(stack.proxy_url, "epd_requests_total", status="aborted") == aborted + 1


class CountingRelay:
    """A TCP relay in front of the real PD that counts the chat requests it forwards and, once
    armed, calls `on_answer` at the first byte of PD's answer and drops that byte and the
    connection: to the proxy, PD read the whole request and died before answering."""

    CHAT = b"POST /v1/chat/completions "

    def __init__(self, target_url: str, on_answer) -> None:
        parts = urllib.parse.urlsplit(target_url)
        self.target = (parts.hostname, parts.port)
        self.on_answer = on_answer
        self.requests = 0
        self.armed = False
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CountingRelay:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    async def _relay(self, client_reader, client_writer) -> None:
        first = await client_reader.read(65536)
        self.requests += first.count(self.CHAT)  # counted even when PD is no longer there
        try:
            pd_reader, pd_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()
            return
        pd_writer.write(first)

        async def to_pd() -> None:
            while data := await client_reader.read(65536):
                self.requests += data.count(self.CHAT)  # request heads are small: never split here
                pd_writer.write(data)
                await pd_writer.drain()

        async def to_proxy() -> None:
            while data := await pd_reader.read(65536):
                if self.armed:
                    self.armed = False
                    self.on_answer()
                    client_writer.transport.abort()
                    pd_writer.transport.abort()
                    return
                client_writer.write(data)
                await client_writer.drain()

        tasks = [asyncio.ensure_future(to_pd()), asyncio.ensure_future(to_proxy())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        client_writer.transport.abort()
        pd_writer.transport.abort()


def test_pd_that_dies_after_reading_a_request_is_not_sent_it_again(stack):
    """Exactly once (RFC 9110 9.2.2): PD read the whole request on a reused keep-alive connection
    and died before any byte of its answer reached the proxy. The connection layer must not send
    the generation again on a new connection; the client gets a clear 502 from the decode stage."""
    pd = stack.by_name("pd")
    with CountingRelay(stack.pd_url, lambda: os.killpg(pd.pgid, signal.SIGKILL)) as relay:
        with extra_proxy(stack, "relayed-proxy", "--decode-retries", "1", decode_url=relay.url) as url:
            chat_ok(url, chat_body([make_image(next(SEEDS))]))  # leaves a pooled connection to PD
            sent_before = relay.requests
            relay.armed = True
            # Text only, so it reaches decode at once, on the connection the first one left.
            status, error = post_json(url, chat_body([]))
            assert status == 502, error
            assert error["error"]["stage"] == "decode", error
            assert relay.requests == sent_before + 1, "the generation was sent to decode more than once"
