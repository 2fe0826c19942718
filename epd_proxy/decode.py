"""Step 7: send decode the prepared body and hand back the open response once it has answered.

The client's status is decided only after decode's headers arrive, so a failure anywhere in the
pipeline reaches a streaming client as a real HTTP error instead of a 200 stream that breaks off.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from epd_proxy.backends import Instance, reaching
from epd_proxy.errors import UpstreamError


async def open_decode(
    session: aiohttp.ClientSession,
    decoder: Instance,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float | None,
) -> aiohttp.ClientResponse:
    """A 2xx response whose body is still unread; the caller must release it."""
    data = orjson.dumps(body)
    # Only the wait for headers is bounded: a long stream after them is legitimate.
    with reaching(decoder, "decode", "Decode request", timeout_s):
        async with asyncio.timeout(timeout_s):
            resp = await session.post(decoder.chat_url, data=data, headers=headers)
    if resp.status >= 400:
        try:
            raw = await resp.read()
        except aiohttp.ClientError:
            raw = b""
        finally:
            resp.release()
        raise UpstreamError(resp.status, raw, resp.content_type, stage="decode", backend=decoder.url)
    return resp
