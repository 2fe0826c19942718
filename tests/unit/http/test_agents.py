"""The agent doors' routes: POST only, on the paths vLLM serves them at."""

from __future__ import annotations

from aiohttp import web

from epd_proxy.http.agents import add_agent_routes


def test_the_doors_are_posted_to_at_vllms_paths():
    app = web.Application()
    add_agent_routes(app)
    routes = {(route.method, route.resource.canonical) for route in app.router.routes()}
    assert routes == {
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
    }
