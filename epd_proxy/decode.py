"""Step 7: send decode the prepared body and hand back the open response once it has answered.

The client's status is decided only after decode's headers arrive, so a failure anywhere in the
pipeline reaches a streaming client as a real HTTP error instead of a 200 stream that breaks off.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from epd_proxy.backends import Instance
from epd_proxy.errors import BackendUnreachable, UpstreamError, describe


async def open_decode(
    session: aiohttp.ClientSession,
    decoder: Instance,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float | None,
) -> aiohttp.ClientResponse:
    """A 2xx response whose body is still unread; the caller must release it."""
    data = orjson.dumps(body)
    try:
        # Only the wait for headers is bounded: a long stream after them is legitimate.
        async with asyncio.timeout(timeout_s):
            resp = await session.post(decoder.chat_url, data=data, headers=headers)
    except TimeoutError:
        raise BackendUnreachable(
            f"Decode did not answer within {timeout_s:g}s", stage="decode", backend=decoder.url, timed_out=True
        ) from None
    except aiohttp.ClientError as exc:
        raise BackendUnreachable(
            f"Decode request failed: {describe(exc)}", stage="decode", backend=decoder.url
        ) from None
    if resp.status >= 400:
        try:
            raw = await resp.read()
        except aiohttp.ClientError:
            raw = b""
        finally:
            resp.release()
        raise UpstreamError(resp.status, raw, resp.content_type, stage="decode", backend=decoder.url)
    return resp
