"""What a client gets for a wrong path, a wrong method, a missing key or a fault inside the proxy:
always JSON in the proxy's error shape, over the production server class."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import aiohttp.web
import openai
import pytest
from multidict import CIMultiDict

from epd_proxy.http.app import STATE
from epd_proxy_tools.testing.harness import serve_process
from tests.media import chat, image

KEY = "client-secret"


async def answer(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[int, CIMultiDict, dict]:
    async with session.request(method, url, **kwargs) as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, resp.headers.copy(), await resp.json()


async def test_wrong_paths_and_methods_answer_json_like_the_other_errors(make_stack):
    url = (await make_stack(encoders=1)).url
    async with aiohttp.ClientSession() as session:
        for path in ("/nope", "/v1/nope", "/v1/chat/completions/", "/v1"):
            status, _, body = await answer(session, "GET", url + path)
            assert status == 404 and body["error"]["code"] == 404, (path, body)
            assert path in body["error"]["message"]
        status, headers, body = await answer(session, "GET", url + "/v1/chat/completions")
        assert status == 405 and headers["Allow"] == "POST" and body["error"]["code"] == 405
        status, headers, body = await answer(session, "DELETE", url + "/health")
        assert status == 405 and set(headers["Allow"].split(",")) == {"GET", "HEAD"}, headers
        # A request aiohttp's parser refuses never reaches a handler; it is JSON all the same.
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"NOT AN HTTP REQUEST\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"400" and b"Content-Type: application/json" in head, raw
        assert b'"code":400' in payload


async def test_api_key_guards_every_v1_path_as_vllm_does():
    """vLLM's AuthenticationMiddleware checks the key before routing, on every path under its
    guarded prefixes (a string prefix, so /v1x too), and lets OPTIONS through."""
    async with serve_process("--api-key", KEY) as served, aiohttp.ClientSession() as session:
        url = served.url
        wrong = {"Authorization": "Bearer wrong"}
        for path in ("/v1/nope", "/v1", "/v1x", "/v2/models", "/v1/chat/completions"):
            for headers in ({}, wrong):
                status, _, body = await answer(session, "GET", url + path, headers=headers)
                assert status == 401 and body["error"]["type"] == "authentication_error", (path, headers, body)
        good = {"Authorization": f"Bearer {KEY}"}
        status, _, _ = await answer(session, "GET", url + "/v1/nope", headers=good)
        assert status == 404
        # The scheme is case-insensitive (RFC 9110 §11.1), as vLLM reads it.
        status, headers, _ = await answer(
            session, "GET", url + "/v1/chat/completions", headers={"Authorization": f"bearer {KEY}"}
        )
        assert status == 405 and headers["Allow"] == "POST"
        status, headers, _ = await answer(session, "OPTIONS", url + "/v1/chat/completions")
        assert status == 405 and headers["Allow"] == "POST"
        for path in ("/nope", "/metricsx"):
            status, _, _ = await answer(session, "GET", url + path)
            assert status == 404, path

        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
            with pytest.raises(openai.NotFoundError):
                await client.get("/files", cast_to=object)
            assert [m.id for m in (await client.models.list()).data] == ["tiny-vlm"]
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.get("/files", cast_to=object)


SECRET = "db password is hunter2"


def broken(*_args, **_kwargs):
    raise RuntimeError(SECRET)


async def test_an_internal_fault_tells_the_client_only_the_request_id(make_stack, caplog):
    proxy = await make_stack(encoders=1)
    app, url = proxy.runner.app, proxy.url
    state = app[STATE]
    caplog.set_level(logging.ERROR, logger="epd_proxy")
    async with aiohttp.ClientSession() as session:
        # A fault in the chat handler's own pipeline, and one in a handler without its own guard.
        state.pipeline.choose_route = broken
        status, headers, body = await answer(
            session, "POST", url + "/v1/chat/completions", json=chat(image("A")), headers={"x-request-id": "rid-7"}
        )
        assert status == 500 and headers["x-request-id"] == "rid-7", body
        state.health.snapshot = broken
        status, headers, health_body = await answer(session, "GET", url + "/health")
        assert status == 500, health_body
        health_id = headers["x-request-id"]
    for error, request_id in ((body["error"], "rid-7"), (health_body["error"], health_id)):
        assert error["code"] == 500 and request_id in error["message"]
        assert SECRET not in error["message"] and "RuntimeError" not in error["message"]
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert logged and logged[0].exc_info and str(logged[0].exc_info[1]) == SECRET


async def test_a_fault_no_middleware_caught_is_a_generic_json_500_from_the_server_class(make_stack, caplog):
    """The server's own middleware answers whatever escapes an app (here one with no middleware of its own)."""

    async def raising(request):
        raise RuntimeError(SECRET)

    app = aiohttp.web.Application()
    app.router.add_get("/", raising)
    stack = await make_stack(encoders=1, app=app)
    caplog.set_level(logging.ERROR, logger="epd_proxy")
    status, _, body = await answer(stack.client, "GET", f"{stack.url}/", headers={"x-request-id": "r9"})
    assert status == 500 and "r9" in body["error"]["message"] and SECRET not in body["error"]["message"]
    logged = [r for r in caplog.records if "r9" in r.getMessage()]
    assert logged and str(logged[0].exc_info[1]) == SECRET
