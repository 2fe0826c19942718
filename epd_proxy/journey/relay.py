"""Step 8: pass decode's answer to the client byte for byte (JSON or SSE), and say how it ended."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import orjson
from aiohttp import web

from epd_proxy.calls.sse import EventTooLarge, Framer, output_tokens
from epd_proxy.errors import BackendUnreachable, ProxyError
from epd_proxy.journey.decode import DecodeAnswer
from epd_proxy.journey.doors import Door, Relayed
from epd_proxy.journey.stream_usage import UnaskedUsage

log = logging.getLogger("epd_proxy.relay")

# How a relayed answer ended, for the request log and epd_requests_total.
COMPLETE, ABORTED, CLIENT_GONE = "complete", "aborted", "client_disconnect"
# An event vLLM sends when generation failed after its 200. Inside generated text a quote is
# escaped, so this can only match the start of an error event.
VLLM_ERROR_EVENT = b'data: {"error"'
# The same in the Messages and Responses streams, whose events are named.
NAMED_ERROR_EVENT = b"event: error\n"


def _has_error(ready: bytes) -> bool:
    return VLLM_ERROR_EVENT in ready or NAMED_ERROR_EVENT in ready


async def relay(
    request: web.Request,
    answer: DecodeAnswer,
    extra_headers: dict[str, str],
    door: Door,
    listener: Listener | None = None,
) -> tuple[web.StreamResponse, str]:
    """Chunks are forwarded as they arrive, never decoded, so multibyte characters and SSE framing
    reach the client exactly as vLLM wrote them (less the usage only the proxy asked for). A JSON
    answer was read whole before it was committed (`decode.hold_head`), so one that breaks off is
    still a real HTTP error. A stream that breaks ends with `door`'s in-band error. The
    `listener` hears the tokens a complete answer reports it used, when it reports them
    (`read_usage`)."""
    headers = {"Content-Type": answer.content_type, **extra_headers}
    if not answer.streaming:
        body = answer.held
        if listener is not None and answer.status == 200:
            _report(listener.heard, body)
        return web.Response(status=answer.status, body=body, headers=headers), COMPLETE
    unasked = listener.unasked if listener is not None else None
    response = web.StreamResponse(status=answer.status, headers={**headers, "Cache-Control": "no-cache"})
    # Only whole events go out, whatever the line ends: if decode breaks off, the error event must
    # not be glued to half an event the client could not parse.
    framer = Framer()
    errored = False
    # The last whole events passed on, kept unread: a door may continue the stream from them when
    # it breaks (a Responses stream numbers its events).
    last = previous = b""
    try:
        await response.prepare(request)
        try:
            ready = _edited(framer.feed(answer.held), unasked)
            if ready:
                last = ready
                errored = _has_error(ready)
                await response.write(ready)
            async for chunk in answer.chunks:
                ready = _edited(framer.feed(chunk), unasked)
                if ready:
                    previous, last = last, ready
                    errored = errored or _has_error(ready)
                    await response.write(ready)
        except BackendUnreachable as exc:
            await _write_held(response, unasked)
            return await _end_in_band(response, door, exc, Relayed(answer.held, last), extra_headers), ABORTED
        except EventTooLarge as exc:
            ready = _edited(exc.ready, unasked)
            if ready:
                last = ready
                await response.write(ready)
            await _write_held(response, unasked)
            failure = _too_large(exc, answer.backend)
            return await _end_in_band(response, door, failure, Relayed(answer.held, last), extra_headers), ABORTED
        await _write_held(response, unasked)
        pending = framer.pending
        if pending:
            errored = errored or _has_error(pending)
            await response.write(pending)
        await response.write_eof()
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError: the client went away while we wrote to it.
        return response, CLIENT_GONE
    if listener is not None and not errored:
        # The usage event comes last before [DONE], which may arrive on its own.
        _report(listener.heard, unasked.heard if unasked is not None else previous + last + pending)
    # vLLM's own error event ends a stream that failed: relayed as sent, counted as aborted.
    return response, ABORTED if errored else COMPLETE


def _edited(ready: bytes, unasked: UnaskedUsage | None) -> bytes:
    return unasked.feed(ready) if unasked is not None and ready else ready


async def _write_held(response: web.StreamResponse, unasked: UnaskedUsage | None) -> None:
    held = unasked.end() if unasked is not None else b""
    if held:
        await response.write(held)


class Usage(NamedTuple):
    """Tokens an answer says the consumer computed: its prompt's (cached ones left out) and its output."""

    prompt: int
    output: int
    # The prompt's tokens found in the prefix cache (left out of `prompt`).
    cached: int = 0


@dataclass(frozen=True, slots=True)
class Listener:
    """What hears the tokens an answer reports (`heard`), and the edit that hides from the client the
    usage the proxy asked for on its behalf (the door's `ask_usage`)."""

    heard: Callable[[Usage], None]
    unasked: UnaskedUsage | None = None


def read_usage(data: bytes) -> Usage | None:
    """The last `usage` object in a JSON answer or in a stream's events, in any door's spelling
    (chat's prompt and completion tokens, Messages' and Responses' input and output tokens);
    None when there is none to read."""
    if b'"usage"' not in data:
        return None
    stripped = data.lstrip()
    texts = (
        [stripped]
        if stripped.startswith(b"{")
        else [line[5:] for line in data.splitlines() if line.startswith(b"data:")]
    )
    found = None
    for text in texts:
        if b'"usage"' not in text:
            continue
        try:
            payload = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(payload, dict):
            continue
        inner = payload.get("response")  # a Responses stream's response.completed
        used = payload.get("usage") or (inner.get("usage") if isinstance(inner, dict) else None)
        if isinstance(used, dict):
            found = used
    return None if found is None else _tokens(found)


def _tokens(used: dict) -> Usage | None:
    prompt = used.get("prompt_tokens", used.get("input_tokens", 0))
    output = output_tokens(used, missing=0)
    details = used.get("prompt_tokens_details") or used.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    if not all(type(v) is int and v >= 0 for v in (prompt, output)):
        return None
    cached = cached if type(cached) is int and 0 <= cached <= prompt else 0
    return Usage(prompt - cached, output, cached)


def _report(usage: Callable[[Usage], None], data: bytes) -> None:
    found = read_usage(data)
    if found is not None:
        usage(found)


async def _end_in_band(
    response: web.StreamResponse, door: Door, failure: ProxyError, relayed: Relayed, extra_headers: dict[str, str]
) -> web.StreamResponse:
    """Status 200 is on the wire: the error can only travel in-band, in the door's stream shape."""
    log.warning("request %s: %s", extra_headers.get("x-request-id"), failure.message)
    await response.write(door.stream_error(failure, relayed))
    await response.write_eof()
    return response


def _too_large(exc: EventTooLarge, backend: str) -> ProxyError:
    """The event is dropped unread, so memory stays bounded; the decode connection is closed."""
    return ProxyError(
        502,
        f"Decode request failed: an event of its stream is larger than {exc.limit} bytes",
        stage="decode",
        backend=backend,
    )
