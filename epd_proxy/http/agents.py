"""The agent APIs' doors: `/v1/responses` (OpenAI Responses) and `/v1/messages` (Anthropic
Messages), each the chat path's journey with its own reading and forwarding (journey/doors.py)."""

from __future__ import annotations

from aiohttp import web

from epd_proxy.http.routes import serve
from epd_proxy.journey.messages_api import MESSAGES, MESSAGES_PATH
from epd_proxy.journey.responses_api import RESPONSES, RESPONSES_PATH


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve(request, RESPONSES)


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, MESSAGES)


def add_agent_routes(app: web.Application) -> None:
    app.router.add_post(RESPONSES_PATH, create_response)
    app.router.add_post(MESSAGES_PATH, create_message)
