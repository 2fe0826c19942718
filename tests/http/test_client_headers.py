"""Client headers the proxy passes on or records, bounded: an `x-request-id` that is not a short
plain token never reaches a backend, a span or the client's answer; the proxy's own id does, and
the request's log line keeps the client's value, cut and escaped, for correlation."""

from __future__ import annotations

import asyncio
import logging
import re

import orjson

from tests.media import chat, image

PROXY_ID = re.compile(r"[0-9a-f]{32}")


def ids_seen(stack) -> set[str]:
    """Every x-request-id the fake backends were sent (encoder ids carry a suffix of their own)."""
    return {seen.headers["x-request-id"] for fake in stack.encoders + [stack.pd] for seen in fake.requests}


def access_line(caplog) -> str:
    (record,) = [r for r in caplog.records if r.name == "epd_proxy.request"]
    return record.getMessage()


async def test_an_8000_byte_request_id_is_replaced_by_the_proxys_own(make_stack, caplog):
    stack = await make_stack(encoders=2)
    sent = "r" * 8000
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        async with await stack.chat(chat(image("A"), image("B")), headers={"x-request-id": sent}) as resp:
            assert resp.status == 200, await resp.text()
            own = resp.headers["x-request-id"]
    assert PROXY_ID.fullmatch(own)
    seen = ids_seen(stack)
    assert len(seen) == 3 and all(rid.startswith(own) for rid in seen), seen
    line = access_line(caplog)
    assert f"request_id={own} " in line and f"client_request_id={'r' * 64}..." in line
    assert len(line) < 2000


async def test_an_obs_text_request_id_is_replaced_and_logged_escaped(make_stack, caplog):
    stack = await make_stack(encoders=1)
    body = orjson.dumps(chat(image("A")))
    host, port = stack.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"x-request-id: rid\xff\xfe=1\r\nConnection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1")
    assert head.startswith("HTTP/1.1 200"), raw[:500]
    own = re.search(r"(?im)^x-request-id: ([^\r\n]*)", head).group(1)
    assert PROXY_ID.fullmatch(own), head
    assert all(rid.startswith(own) for rid in ids_seen(stack))
    line = access_line(caplog)
    assert f"request_id={own} " in line
    assert re.search(r"client_request_id=rid(\\x[0-9a-f]{2}|\\u[0-9a-f]{4})+\\x3d1( |$)", line), line
