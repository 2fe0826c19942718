"""Step 8: pass decode's answer to the client byte for byte (JSON or SSE)."""

from __future__ import annotations

import logging

from aiohttp import web

from epd_proxy.upstream import Answer, UpstreamFailure

log = logging.getLogger("epd_proxy.relay")


async def relay(request: web.Request, answer: Answer, extra_headers: dict[str, str]) -> web.StreamResponse:
    """Chunks are forwarded as they arrive, never re-split or decoded, so multibyte characters
    and SSE framing reach the client exactly as vLLM wrote them."""
    content_type = answer.headers.get("Content-Type", "application/json")
    headers = {"Content-Type": content_type, **extra_headers}
    if not content_type.startswith("text/event-stream"):
        body = await answer.read()
        return web.Response(status=answer.status, body=body, headers=headers)
    response = web.StreamResponse(status=answer.status, headers={**headers, "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for chunk in answer.chunks():
            await response.write(chunk)
    except UpstreamFailure as exc:
        # Status 200 is already on the wire; cutting the connection (no terminating chunk) is the
        # one signal left that tells the client the stream is incomplete.
        log.warning("decode stream from %s broke off: %s", exc.backend, exc.message)
        if request.transport is not None:
            request.transport.close()
        return response
    await response.write_eof()
    return response
