"""The agent APIs' doors: `/v1/responses` (OpenAI Responses) and `/v1/messages` (Anthropic
Messages), each the chat path's journey with its own reading and forwarding (journey/doors.py)."""

from __future__ import annotations

from aiohttp import web

from epd_proxy.calls.upstream import NoAnswer, Timeouts
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE
from epd_proxy.http.routes import error_response, read_body, serve
from epd_proxy.journey.extract import check_body, parse_json_body
from epd_proxy.journey.messages_api import COUNT_TOKENS_PATH, MESSAGES, MESSAGES_PATH
from epd_proxy.journey.responses_api import RESPONSES, RESPONSES_PATH
from epd_proxy.proxy import STATE


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve(request, RESPONSES)


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, MESSAGES)


# Counting renders the prompt (images through the processor, not the encoder) and runs nothing.
COUNT_TIMEOUTS = Timeouts(total=60)


async def count_tokens(request: web.Request) -> web.Response:
    """Claude Code asks before each turn; any decoder renders the prompt as every other would."""
    state = request.app[STATE]
    try:
        raw = await read_body(request, state.config.max_body_bytes)
        check_body(parse_json_body(raw), state.config.trust_client_fields)
        candidates = state.pipeline.decoders()
        if not candidates:
            raise ProxyError(503, "no live decode instance", stage="route", error_type="service_unavailable")
        decoder = state.policies[DECODE].choose(candidates, ("count_tokens",))[0]
        try:
            answer = await state.upstream.call(
                decoder,
                "POST",
                COUNT_TOKENS_PATH,
                body=bytes(raw),
                headers={"Content-Type": "application/json"},
                timeouts=COUNT_TIMEOUTS,
                stage="decode",
                what=f"token count from {decoder.url}",
            )
        except NoAnswer as exc:
            raise ProxyError(502, exc.message, stage="decode", backend=decoder.url) from None
    except ProxyError as exc:
        return error_response(exc, door=MESSAGES)
    return web.Response(status=answer.status, body=answer.body, headers={"Content-Type": answer.content_type})


def add_agent_routes(app: web.Application) -> None:
    app.router.add_post(RESPONSES_PATH, create_response)
    app.router.add_post(MESSAGES_PATH, create_message)
    app.router.add_post(COUNT_TOKENS_PATH, count_tokens)
