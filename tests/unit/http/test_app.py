"""`create_app` (app.py): one proxy's state and routes, started and stopped with the server."""

from __future__ import annotations

from aiohttp.test_utils import TestServer

from epd_proxy.config import Config
from epd_proxy.http.app import create_app
from epd_proxy.proxy import STATE

STATIC = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}


def routes_of(app) -> set[tuple[str, str]]:
    return {(route.method, route.resource.canonical) for route in app.router.routes()}


def test_the_static_app_has_the_reference_routes_and_the_operators_pages():
    routes = routes_of(create_app(Config(**STATIC)))
    expected = {
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("POST", "/start_profile"),
        ("POST", "/stop_profile"),
        ("GET", "/status"),
        ("GET", "/status.json"),
    }
    assert expected <= routes and not any(path == "/instances" for _, path in routes)


def test_only_the_dynamic_app_takes_registrations():
    routes = routes_of(create_app(Config(dynamic_registration=True, admin_api_key="a")))
    assert {("GET", "/instances"), ("POST", "/instances"), ("DELETE", "/instances")} <= routes


def test_the_body_limit_is_the_configs():
    assert create_app(Config(max_body_bytes=1234, **STATIC))._client_max_size == 1234


async def test_the_state_starts_and_stops_with_the_server():
    app = create_app(Config(probe_interval_s=0, **STATIC))
    state = app[STATE]
    assert state.pipeline is None
    server = TestServer(app)
    await server.start_server()
    try:
        assert state.pipeline is not None and state.upstream is not None
    finally:
        await server.close()
    assert state.upstream._closed
