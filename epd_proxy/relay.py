"""Step 8: pass decode's answer to the client byte for byte (JSON or SSE), and say how it ended."""

from __future__ import annotations

import logging

from aiohttp import web

from epd_proxy.decode import DecodeAnswer
from epd_proxy.errors import BackendUnreachable
from epd_proxy.sse import complete_events, error_event

log = logging.getLogger("epd_proxy.relay")

# How a relayed answer ended, for the request log and epd_requests_total.
COMPLETE, ABORTED, CLIENT_GONE = "complete", "aborted", "client_disconnect"
# An event vLLM sends when generation failed after its 200. Inside generated text a quote is
# escaped, so this can only match the start of an error event.
VLLM_ERROR_EVENT = b'data: {"error"'


async def relay(
    request: web.Request, answer: DecodeAnswer, extra_headers: dict[str, str]
) -> tuple[web.StreamResponse, str]:
    """Chunks are forwarded as they arrive, never decoded, so multibyte characters and SSE framing
    reach the client exactly as vLLM wrote them. A JSON answer is read whole first, so one that
    breaks off is still a real HTTP error (BackendUnreachable, raised to the caller)."""
    headers = {"Content-Type": answer.content_type, **extra_headers}
    if not answer.streaming:
        body = answer.held + b"".join([chunk async for chunk in answer.chunks])
        return web.Response(status=answer.status, body=body, headers=headers), COMPLETE
    response = web.StreamResponse(status=answer.status, headers={**headers, "Cache-Control": "no-cache"})
    # Only whole events go out: if decode breaks off, the error event must not be glued to half an
    # event the client could not parse.
    pending = answer.held
    errored = False
    try:
        await response.prepare(request)
        try:
            cut = complete_events(pending)
            if cut:
                errored = VLLM_ERROR_EVENT in pending[:cut]
                await response.write(pending[:cut])
                pending = pending[cut:]
            async for chunk in answer.chunks:
                pending += chunk
                cut = complete_events(pending)
                if cut:
                    errored = errored or VLLM_ERROR_EVENT in pending[:cut]
                    await response.write(pending[:cut])
                    pending = pending[cut:]
        except BackendUnreachable as exc:
            # Status 200 is on the wire: the error can only travel in-band, as vLLM sends its own.
            log.warning("request %s: %s", extra_headers.get("x-request-id"), exc.message)
            await response.write(
                error_event(
                    exc.message, error_type=exc.error_type, code=exc.status, stage=exc.stage, backend=exc.backend
                )
            )
            await response.write_eof()
            return response, ABORTED
        if pending:
            errored = errored or VLLM_ERROR_EVENT in pending
            await response.write(pending)
        await response.write_eof()
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError: the client went away while we wrote to it.
        return response, CLIENT_GONE
    # vLLM's own error event ends a stream that failed: relayed as sent, counted as aborted.
    return response, ABORTED if errored else COMPLETE
