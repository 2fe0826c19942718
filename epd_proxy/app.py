"""The HTTP layer: thin handlers over the pipeline; all state is owned by the app object."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from epd_proxy.backends import DECODE, ENCODE, PREFILL, Instance, build_instances, make_session
from epd_proxy.config import Config
from epd_proxy.errors import BadRequest, ProxyError, UpstreamError
from epd_proxy.extract import extract_media, validate_request
from epd_proxy.pipeline import Pipeline, Trace, healthy
from epd_proxy.relay import relay
from epd_proxy.routing import make_policy

log = logging.getLogger("epd_proxy.app")
access_log = logging.getLogger("epd_proxy.request")
CLUSTER_KEYS = {ENCODE: "encode_cluster", PREFILL: "prefill_cluster", DECODE: "decode_cluster"}
HEALTH_TIMEOUT_S = 5.0


class ProxyState:
    """Everything that lives as long as the server: instances, routing cursors, the client pool."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.instances = build_instances(config)
        self.policies = {
            ENCODE: make_policy(config.encode_policy),
            PREFILL: make_policy(config.prefill_policy),
            DECODE: make_policy(config.decode_policy),
        }
        self.session: aiohttp.ClientSession | None = None
        self.pipeline: Pipeline | None = None

    async def start(self) -> None:
        self.session = make_session(self.config)
        self.pipeline = Pipeline(self.config, self.instances, self.session, self.policies)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


STATE = web.AppKey("state", ProxyState)


def error_response(exc: ProxyError, request_id: str | None = None) -> web.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    if isinstance(exc, UpstreamError) and exc.raw_body:
        # A backend's own error body (vLLM's OpenAI error object) is the most faithful answer.
        headers["x-epd-stage"] = exc.stage
        return web.Response(
            status=exc.status, body=exc.raw_body, headers={"Content-Type": exc.content_type or "application/json", **headers}
        )
    return web.Response(status=exc.status, body=exc.body(), content_type="application/json", headers=headers)


def parse_json_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    config = state.config
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    trace = Trace(request_id)
    status = 500
    route = None
    try:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds {config.max_body_bytes} bytes", stage="request") from None
        body = validate_request(parse_json_body(raw), trust_client_fields=config.trust_client_fields)
        items = extract_media(body, honour_client_uuid=config.trust_client_fields)
        trace.items = len(items)
        route = state.pipeline.choose_route(request_id)
        with route.decoder.busy():
            upstream = await state.pipeline.open(body, items, route, trace)
            try:
                status = upstream.status
                return await relay(request, upstream, {"x-request-id": request_id})
            finally:
                upstream.release()
    except ProxyError as exc:
        status = exc.status
        return error_response(exc, request_id)
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as exc:  # the client must get JSON, whatever broke inside the proxy
        log.exception("request %s: unexpected proxy failure", request_id)
        status = 500
        return error_response(ProxyError(500, f"Proxy error: {exc!r}"), request_id)
    finally:
        _log_request(trace, status, route)


def _log_request(trace: Trace, status: int, route: Any) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    total_ms = (time.perf_counter() - trace.started) * 1000
    access_log.info(
        "req=%s status=%d items=%d encoder_requests=%d failovers=%d attempts=%d decode=%s prefill=%s "
        "encode_ms=%.1f prefill_ms=%.1f decode_ttfb_ms=%.1f total_ms=%.1f",
        trace.request_id, status, trace.items, trace.encoder_requests, trace.encoder_failovers, trace.attempts,
        route.decoder.url if route else "-", route.prefill.url if route and route.prefill else "-",
        trace.encode_s * 1000, trace.prefill_s * 1000, trace.decode_ttfb_s * 1000, total_ms,
    )


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    decoder = state.policies[DECODE].choose(healthy(state.instances[DECODE]), ("models",))[0]
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S * 2):
            async with state.session.get(f"{decoder.url}/v1/models") as resp:
                body = await resp.read()
                content_type = resp.headers.get("Content-Type", "application/json")
                return web.Response(status=resp.status, body=body, headers={"Content-Type": content_type})
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(ProxyError(502, f"model list from {decoder.url} failed: {exc!r}", stage="decode", backend=decoder.url))


async def _probe(session: aiohttp.ClientSession, instance: Instance) -> str:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            async with session.get(f"{instance.url}/health") as resp:
                await resp.read()
                return "healthy" if resp.status == 200 else f"unhealthy: HTTP {resp.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"unhealthy: {type(exc).__name__}"


def stage_status(results: list[str]) -> str:
    if not results:
        return "empty"
    up = sum(r == "healthy" for r in results)
    if up == len(results):
        return "healthy"
    return "degraded" if up else "unhealthy"


async def health(request: web.Request) -> web.Response:
    """200 while every configured stage has a live instance; 503 names the stage that has none."""
    state = request.app[STATE]
    everyone = [(role, inst) for role in (ENCODE, PREFILL, DECODE) for inst in state.instances[role]]
    results = await asyncio.gather(*(_probe(state.session, inst) for _, inst in everyone))
    body: dict[str, Any] = {"proxy": "healthy"}
    for role in (ENCODE, PREFILL, DECODE):
        body[CLUSTER_KEYS[role]] = stage_status([r for (rl, _), r in zip(everyone, results) if rl == role])
    body["instances"] = {inst.url: result for (_, inst), result in zip(everyone, results)}
    down = any(body[key] == "unhealthy" for key in CLUSTER_KEYS.values())
    return web.json_response(body, status=503 if down else 200, dumps=lambda o: orjson.dumps(o).decode())


async def _profile_one(session: aiohttp.ClientSession, instance: Instance, action: str, payload: bytes, api_key: str):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        async with asyncio.timeout(30):
            async with session.post(f"{instance.url}/{action}", data=payload, headers=headers) as resp:
                text = (await resp.read()).decode("utf-8", "replace")
                if resp.status == 404:
                    return None
                return {"status": resp.status, "body": text}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": None, "error": repr(exc)}


def profile_handler(action: str):
    async def handler(request: web.Request) -> web.Response:
        """Every instance of every stage, concurrently (the reference picked one at random)."""
        state = request.app[STATE]
        payload = await request.read() or b"{}"
        everyone = [(role, inst) for role in (ENCODE, PREFILL, DECODE) for inst in state.instances[role]]
        results = await asyncio.gather(
            *(_profile_one(state.session, inst, action, payload, state.config.backend_api_key) for _, inst in everyone)
        )
        out: dict[str, Any] = {}
        for role in (ENCODE, PREFILL, DECODE):
            per_instance = {inst.url: r for (rl, inst), r in zip(everyone, results) if rl == role and r is not None}
            out[role] = per_instance or None
        if all(v is None for v in out.values()):
            return error_response(ProxyError(503, "Profiling endpoints are disabled on all clusters", stage="profile"))
        return web.json_response(out, dumps=lambda o: orjson.dumps(o).decode())

    return handler


@web.middleware
async def request_logging(request: web.Request, handler):
    started = time.perf_counter()
    response = await handler(request)
    log.debug("%s %s -> %s in %.1f ms", request.method, request.path, response.status, (time.perf_counter() - started) * 1000)
    return response


def create_app(config: Config) -> web.Application:
    middlewares = [request_logging] if config.log_requests else []
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    state = ProxyState(config)
    app[STATE] = state

    async def lifespan(app: web.Application):
        await state.start()
        yield
        await state.close()

    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_post("/start_profile", profile_handler("start_profile"))
    app.router.add_post("/stop_profile", profile_handler("stop_profile"))
    return app
