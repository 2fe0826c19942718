"""The HTTP routes' own logic (routes.py): error rendering, body reading, client manners, /health."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from epd_proxy.config import Config
from epd_proxy.errors import ErrorAnswer, ProxyError
from epd_proxy.http.routes import client_manners, error_response, health, middlewares, read_body
from epd_proxy.proxy import STATE, ProxyState


def test_an_error_is_json_with_its_status_and_the_request_id():
    response = error_response(ProxyError(503, "busy", stage="admission"), "rid-1")
    assert response.status == 503 and response.content_type == "application/json"
    assert response.headers["x-request-id"] == "rid-1"
    assert orjson.loads(response.body)["error"] == {
        "message": "busy",
        "type": "service_unavailable",
        "code": 503,
        "stage": "admission",
    }
    assert "x-request-id" not in error_response(ProxyError(400, "bad")).headers


def test_a_backends_own_error_body_is_passed_on_as_it_was():
    raw = b'{"object":"error","message":"too long","code":400}'
    response = error_response(ErrorAnswer(400, raw, "application/json", stage="decode", backend="http://d"), "r")
    assert (response.status, response.body, response.headers["x-epd-stage"]) == (400, raw, "decode")
    text = error_response(ErrorAnswer(500, b"boom", "", stage="encode", backend="http://e"))
    assert text.headers["Content-Type"] == "application/json" and text.body == b"boom"


async def serve(app: web.Application) -> TestClient:
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
async def body_reader():
    async def handler(request: web.Request) -> web.Response:
        try:
            body = await read_body(request, limit=10)
        except ProxyError as exc:
            return error_response(exc)
        return web.Response(body=bytes(body))

    app = web.Application()
    app.router.add_post("/", handler)
    client = await serve(app)
    yield client
    await client.close()


async def test_a_body_up_to_the_limit_is_read_whole(body_reader):
    async with body_reader.post("/", data=b"0123456789") as resp:
        assert resp.status == 200 and await resp.read() == b"0123456789"


async def test_a_body_over_the_limit_is_413_whether_announced_or_streamed(body_reader):
    async with body_reader.post("/", data=b"x" * 11) as resp:
        assert resp.status == 413 and "exceeds 10 bytes" in (await resp.json())["error"]["message"]

    async def chunks():
        for _ in range(4):
            yield b"xxxx"

    async with body_reader.post("/", data=chunks()) as resp:  # chunked: no Content-Length to refuse early
        assert resp.status == 413


@pytest.fixture
async def mannered():
    async def fault(request: web.Request) -> web.Response:
        raise RuntimeError("secret detail")

    async def refused(request: web.Request) -> web.Response:
        raise ProxyError(408, "too slow", stage="request")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[client_manners("k3y")])
    app.router.add_get("/v1/fault", fault)
    app.router.add_get("/v1/refused", refused)
    app.router.add_post("/v1/ok", ok)
    app.router.add_get("/health", ok)
    client = await serve(app)
    yield client
    await client.close()


BEARER = {"Authorization": "Bearer k3y"}


async def test_the_client_key_is_checked_before_routing(mannered):
    for path in ("/v1/ok", "/v1/unknown"):
        async with mannered.post(path) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    async with mannered.get("/health") as resp:
        assert resp.status == 200


async def test_router_errors_are_json_and_keep_allow(mannered):
    async with mannered.get("/v1/unknown", headers=BEARER) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["message"] == "no such path: /v1/unknown"
    async with mannered.get("/v1/ok", headers=BEARER) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["message"] == "GET is not allowed on /v1/ok (allowed: POST)"


async def test_an_escaped_proxy_error_keeps_its_status_and_a_fault_tells_only_the_request_id(mannered):
    async with mannered.get("/v1/refused", headers=BEARER) as resp:
        assert resp.status == 408 and (await resp.json())["error"]["message"] == "too slow"
    async with mannered.get("/v1/fault", headers={**BEARER, "x-request-id": "rid-3"}) as resp:
        assert resp.status == 500 and resp.headers["x-request-id"] == "rid-3"
        message = (await resp.json())["error"]["message"]
        assert "rid-3" in message and "secret" not in message


def test_request_logging_wraps_the_manners_only_when_asked():
    listed = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}
    assert len(middlewares(Config(**listed))) == 1
    assert len(middlewares(Config(log_requests=True, **listed))) == 2


async def health_of(state: ProxyState) -> tuple[int, dict]:
    app = web.Application()
    app[STATE] = state
    response = await health(make_mocked_request("GET", "/health", app=app))
    return response.status, orjson.loads(response.body)


async def test_static_health_is_503_naming_the_stage_with_no_instance_in_rotation():
    state = ProxyState(Config(encode_urls=("http://e0", "http://e1"), decode_urls=("http://pd",), fail_threshold=1))
    status, body = await health_of(state)
    assert status == 200
    assert (body["encode_cluster"], body["prefill_cluster"], body["decode_cluster"]) == ("healthy", "empty", "healthy")
    assert set(body["instances"]) == {"http://e0", "http://e1", "http://pd"}
    e0, e1 = (inst for inst in state.fleet.all() if inst.role == "encode")
    state.health.checked(e0, "HTTP 500")
    assert (await health_of(state))[1]["encode_cluster"] == "degraded"
    state.health.checked(e1, "HTTP 500")
    status, body = await health_of(state)
    assert status == 503 and body["encode_cluster"] == "unhealthy"


async def test_dynamic_health_is_200_with_the_roster_even_when_empty():
    state = ProxyState(Config(dynamic_registration=True, admin_api_key="a"))
    status, body = await health_of(state)
    assert status == 200 and body["proxy"] == "healthy" and body["health"] == {}
    assert "roster" not in body and "dns" not in body
