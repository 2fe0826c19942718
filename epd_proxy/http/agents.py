"""The agent APIs' doors: `/v1/responses` (OpenAI Responses) and `/v1/messages` (Anthropic
Messages), each the chat path's journey with its own reading and forwarding (journey/doors.py)."""

from __future__ import annotations

import orjson
from aiohttp import web

from epd_proxy.calls.upstream import Timeouts
from epd_proxy.errors import ProxyError
from epd_proxy.http.routes import (
    TENANT,
    DecoderCall,
    ask_a_decoder,
    error_response,
    parse_body,
    read_body,
    serve,
)
from epd_proxy.journey.admission import TurnedAway
from epd_proxy.journey.messages_api import COUNT_TOKENS_PATH, MESSAGES, MESSAGES_PATH
from epd_proxy.journey.remote import fetch_media
from epd_proxy.journey.responses_api import RESPONSES, RESPONSES_PATH
from epd_proxy.proxy import STATE
from epd_proxy.tenants import DEFAULT


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve(request, RESPONSES)


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, MESSAGES)


# Counting renders the prompt (images through the processor, not the encoder) and runs nothing.
COUNT_TOKENS = DecoderCall("POST", COUNT_TOKENS_PATH, Timeouts(total=60), "token count")


async def count_tokens(request: web.Request) -> web.Response:
    """Claude Code asks before each turn; any decoder renders the prompt as every other would.
    Every image costs that decoder's processor, so the call keeps /v1/messages' limits: its reading
    (the same checks, the same media count), off the loop when large, and a slot of --max-inflight."""
    state = request.app[STATE]
    try:
        raw = await read_body(request, state.config.max_body_bytes)
        normalised, spliced = await parse_body(MESSAGES, raw, state.parse_options)
        with state.admission.admit(lambda: state.wait_at_arrival(0.0).seconds):
            # The decoder counts the bytes the proxy fetched, and fetches nothing itself.
            fetched = await fetch_media(normalised, state.media, MESSAGES, state.parse_options.digest)
            if fetched is not normalised:
                body = spliced.dumps(fetched.body) if spliced is not None else [orjson.dumps(fetched.body)]
                raw = bytearray(b"".join(body))
            return await ask_a_decoder(state, COUNT_TOKENS, bytes(raw))
    except ProxyError as exc:
        if isinstance(exc, TurnedAway):
            tenant = request.get(TENANT)
            state.metrics.shed.labels(tenant.name if tenant else DEFAULT, exc.reason).inc()
        return error_response(exc, door=MESSAGES)


def add_agent_routes(app: web.Application) -> None:
    app.router.add_post(RESPONSES_PATH, create_response)
    app.router.add_post(MESSAGES_PATH, create_message)
    app.router.add_post(COUNT_TOKENS_PATH, count_tokens)
