"""The HTTP routes: thin handlers over the proxy's parts (proxy.py), error rendering, the access log.

Every answer is in the proxy's JSON error shape, whoever makes it: a handler, aiohttp's router
(404, 405) or an unexpected exception (a generic 500, its details in the log only).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream, bearer
from epd_proxy.config import Config
from epd_proxy.errors import ErrorAnswer, InternalError, ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.registry import normalize_url, parse_registration
from epd_proxy.http.auth import check_admin_key, check_client_key
from epd_proxy.journey.doors import CHAT, Door
from epd_proxy.journey.extract import parse_json_body
from epd_proxy.journey.pipeline import ClientBody
from epd_proxy.journey.relay import ABORTED, CLIENT_GONE, relay
from epd_proxy.journey.trace import Trace
from epd_proxy.ops.metrics import Metrics
from epd_proxy.proxy import STATE

# The names operators' log filters know; logs.py turns the first up for --log-requests.
log = logging.getLogger("epd_proxy.app")
access_log = logging.getLogger("epd_proxy.request")
CLUSTER_KEYS = {ENCODE: "encode_cluster", PREFILL: "prefill_cluster", DECODE: "decode_cluster"}
# Bodies above this are read (lifted, hashed, normalised) in a worker thread, so one huge upload
# does not stall every other stream on the loop; sha256 runs at about 2 ms per MB here. Smaller
# bodies stay on the loop: measured with `epd-proxy bench --variant`, a thread for every
# multi-image request cost 4-16% more CPU per request and 6% less throughput, pinned to one core
# or not, because the worker and the loop take turns on the GIL for everything but the hashing.
OFFLOAD_READ_BYTES = 4 * 1024 * 1024
MODELS_TIMEOUTS = Timeouts(total=10)
PROFILE_TIMEOUTS = Timeouts(total=30)


def error_response(exc: ProxyError, request_id: str | None = None, door: Door = CHAT) -> web.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    shaped = door.error(exc)
    if shaped is not None:
        if isinstance(exc, ErrorAnswer):
            headers["x-epd-stage"] = exc.stage
        return web.Response(status=exc.status, body=shaped, content_type="application/json", headers=headers)
    if isinstance(exc, ErrorAnswer) and exc.raw_body:
        # A backend's own error body (vLLM's OpenAI error object) is the most faithful answer.
        headers["x-epd-stage"] = exc.stage
        return web.Response(
            status=exc.status,
            body=exc.raw_body,
            headers={"Content-Type": exc.content_type or "application/json", **headers},
        )
    return web.Response(status=exc.status, body=exc.body(), content_type="application/json", headers=headers)


async def read_body(request: web.Request, limit: int) -> bytearray:
    """The body in one buffer: `request.read()` would copy it twice more (a megabyte per
    multi-image request), and orjson parses a bytearray directly."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return body


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body exceeds {limit} bytes", stage="request")


def client_manners(api_key: str):
    """Every answer a handler does not make itself, in the proxy's JSON error shape: 401 before
    routing (auth.py), aiohttp's 404 and 405, and a generic 500 for an unexpected exception, whose
    details go to the log only."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if api_key:
            try:
                check_client_key(
                    api_key,
                    request.method,
                    request.path,
                    request.headers.get("Authorization"),
                    request.headers.get("x-api-key"),
                )
            except ProxyError as exc:
                return error_response(exc)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = error_response(ProxyError(exc.status, _http_error_message(request, exc), stage="request"))
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except ProxyError as exc:
            # One a handler let escape, such as the body timeout out of a plain `request.read()`.
            return error_response(exc)
        except Exception:
            if request.writer.output_size > 0:
                raise  # the answer has begun: aiohttp closes the connection, nothing else can be said
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            log.exception("request %s: unexpected failure in %s %s", request_id, request.method, request.path)
            return error_response(InternalError(request_id), request_id)

    return middleware


def _http_error_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no such path: {request.path}"
    if exc.status == 405:
        return f"{request.method} is not allowed on {request.path} (allowed: {exc.headers.get('Allow', '')})"
    return exc.text or exc.reason


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, CHAT)


async def serve(request: web.Request, door: Door) -> web.StreamResponse:
    """One request through `door`: read, admitted, run through the pipeline, relayed, logged."""
    state = request.app[STATE]
    config = state.config
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    trace = Trace(request_id)
    trace.endpoint = door.name
    status = 500
    route = None
    admitted = False
    try:
        raw = await read_body(request, config.max_body_bytes)
        # With splice, `raw` lives on in `spliced` (the media are slices of it) and the parsed
        # body holds only the skeleton; otherwise the parsed body holds the media and raw goes.
        if len(raw) > OFFLOAD_READ_BYTES:
            normalised, spliced = await asyncio.to_thread(door.parse, raw, **state.parse_options)
        else:
            normalised, spliced = door.parse(raw, **state.parse_options)
        del raw
        body, items = normalised.body, normalised.items
        trace.items = len(items)
        (state.metrics.parsed_spliced if spliced is not None else state.metrics.parsed_full).inc()
        # Admission counts work, not waiting: a client still sending its body holds no slot.
        if config.max_inflight and state.inflight >= config.max_inflight:
            state.metrics.rejected.inc()
            raise ProxyError(
                503,
                f"the proxy is at its limit of {config.max_inflight} requests in flight; retry shortly",
                stage="admission",
                error_type="overloaded",
            )
        state.inflight += 1
        admitted = True
        # From here on only the pipeline holds the body, and it lets go once decode commits.
        job = ClientBody(body, items, spliced)
        del normalised, body, items, spliced
        route = state.pipeline.choose_route(request_id)
        with route.decoder.busy():
            answer = await state.pipeline.open(job, route, trace, door)
            try:
                response, trace.outcome = await relay(request, answer, {"x-request-id": request_id})
                status = {ABORTED: "aborted", CLIENT_GONE: 499}.get(trace.outcome, answer.status)
                if trace.outcome == CLIENT_GONE:
                    log.info("request %s: the client disconnected during the answer", request_id)
                return response
            finally:
                answer.release()
    except ProxyError as exc:
        status = exc.status
        response = error_response(exc, request_id, door)
        if exc.stage == "admission":
            response.headers["Retry-After"] = "1"
        return response
    except asyncio.CancelledError:
        status = 499
        trace.outcome = CLIENT_GONE
        raise
    except Exception:  # the client must get JSON, whatever broke inside the proxy
        log.exception("request %s: unexpected proxy failure", request_id)
        status = 500
        return error_response(InternalError(request_id), request_id, door)
    finally:
        if admitted:
            state.inflight -= 1
        _finish(state.metrics, trace, status, route)


def _finish(metrics: Metrics, trace: Trace, status: int | str, route: Any) -> None:
    """One log line and the stage histograms per request."""
    total_s = time.perf_counter() - trace.started
    metrics.requests.labels(str(status)).inc()
    metrics.endpoint_requests.labels(trace.endpoint, str(status)).inc()
    metrics.recent.record(trace.started + total_s, status, total_s, trace)
    stage = metrics.stage
    stage["total"].observe(total_s)
    if trace.encoder_requests:
        stage["encode"].observe(trace.encode_s)
    if trace.prefill_s:
        stage["prefill"].observe(trace.prefill_s)
    if trace.decode_ttfb_s:
        stage["decode_ttfb"].observe(trace.decode_ttfb_s)
    if not access_log.isEnabledFor(logging.INFO):
        return
    fields = {
        "request_id": trace.request_id,
        "endpoint": trace.endpoint,
        "status": status,
        "items": trace.items,
        "encoder_requests": trace.encoder_requests,
        "coalesced": trace.coalesced,
        "affinity_hits": trace.affinity_hits,
        "encoder_failovers": trace.encoder_failovers,
        "attempts": trace.attempts,
        "outcome": trace.outcome,
        "decode": route.decoder.url if route else None,
        "prefill": route.prefill.url if route and route.prefill else None,
        "encode_ms": round(trace.encode_s * 1000, 2),
        "prefill_ms": round(trace.prefill_s * 1000, 2),
        "decode_ttfb_ms": round(trace.decode_ttfb_s * 1000, 2),
        "total_ms": round(total_s * 1000, 2),
    }
    access_log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()), extra={"fields": fields})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    candidates = state.pipeline.decoders()
    if not candidates:
        return error_response(ProxyError(503, "no live decode instance", stage="route"))
    decoder = state.policies[DECODE].choose(candidates, ("models",))[0]
    try:
        answer = await state.upstream.call(
            decoder,
            "GET",
            "/v1/models",
            timeouts=MODELS_TIMEOUTS,
            stage="decode",
            what=f"model list from {decoder.url}",
            count_inflight=False,
        )
    except NoAnswer as exc:
        return error_response(ProxyError(502, exc.message, stage="decode", backend=decoder.url))
    return web.Response(status=answer.status, body=answer.body, headers={"Content-Type": answer.content_type})


def stage_status(in_rotation: list[bool]) -> str:
    if not in_rotation:
        return "empty"
    if all(in_rotation):
        return "healthy"
    return "degraded" if any(in_rotation) else "unhealthy"


async def health(request: web.Request) -> web.Response:
    """Answers from the latest active checks and outlier detection, never by probing on the
    caller's behalf (anyone may call this as often as they like). Static mode: 200 while every
    configured stage has an instance in rotation, 503 naming the stage that has none. Dynamic
    mode: always 200 with the roster, since an empty fleet is a normal state there."""
    state = request.app[STATE]
    config = state.config
    views = state.health.snapshot(state.fleet.all())
    instances = {view["url"]: {k: v for k, v in view.items() if k != "url"} for view in views}
    if config.dynamic_registration:
        roster = state.fleet.snapshot(state.health.in_rotation)
        body = {"proxy": "healthy", "instances": roster, "health": instances}
        if state.roster is not None:
            # Reported, not fatal: routing goes on from the last roster read while the store is away.
            body["roster"] = state.roster.status()
        if state.discovery is not None:
            body["dns"] = state.discovery.status()  # also reported, not fatal
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    body: dict[str, Any] = {"proxy": "healthy"}
    consumer_role = {ENCODE: (ENCODE,), PREFILL: (PREFILL,), DECODE: (DECODE, PREFILL_DECODE)}
    for stage, key in CLUSTER_KEYS.items():
        body[key] = stage_status([view["in_rotation"] for view in views if view["role"] in consumer_role[stage]])
    body["instances"] = instances
    # Only a DNS name can leave a stage it names empty: that stage cannot serve either.
    configured = {ENCODE: config.encode_urls, PREFILL: config.prefill_urls, DECODE: config.decode_urls}
    down = any(
        body[key] == "unhealthy" or (body[key] == "empty" and configured[stage]) for stage, key in CLUSTER_KEYS.items()
    )
    if state.discovery is not None:
        body["dns"] = state.discovery.status()
    return web.Response(body=orjson.dumps(body), status=503 if down else 200, content_type="application/json")


async def _profile_one(upstream: Upstream, instance: Instance, action: str, payload: bytes, api_key: str):
    headers = {"Content-Type": "application/json", **bearer(api_key)}
    try:
        answer = await upstream.call(
            instance,
            "POST",
            f"/{action}",
            body=payload,
            headers=headers,
            timeouts=PROFILE_TIMEOUTS,
            stage="profile",
            what=action,
            count_inflight=False,
        )
    except NoAnswer as exc:
        return {"status": None, "error": exc.message}
    if answer.status == 404:
        return None
    return {"status": answer.status, "body": answer.body.decode("utf-8", "replace")}


def profile_handler(action: str):
    async def handler(request: web.Request) -> web.Response:
        """Every instance of every stage, concurrently (the reference picked one at random)."""
        state = request.app[STATE]
        config = state.config
        # Profiling slows every engine: an admin action. A proxy with neither key stays the
        # reference's open drop-in; one that authenticates clients needs the admin key here.
        if config.admin_api_key or config.api_key:
            try:
                check_admin_key(config.admin_api_key, request.headers.get("X-API-Key"), "profile", "profile")
            except ProxyError as exc:
                return error_response(exc)
        payload = await request.read() or b"{}"
        everyone = [inst for inst in state.fleet.all() if state.health.in_rotation(inst)]
        profile_key = config.profile_api_key or config.backend_api_key
        results = await asyncio.gather(
            *(_profile_one(state.upstream, inst, action, payload, profile_key) for inst in everyone)
        )
        # Static mode answers in the reference's shape (encode/prefill/decode); dynamic mode by role.
        dynamic = state.config.dynamic_registration
        out: dict[str, Any] = {} if dynamic else {ENCODE: None, PREFILL: None, DECODE: None}
        for inst, result in zip(everyone, results):
            key = inst.role if dynamic or inst.role != PREFILL_DECODE else DECODE
            out.setdefault(key, None)
            if result is not None:
                out[key] = {**(out[key] or {}), inst.url: result}
        if all(v is None for v in out.values()):
            return error_response(ProxyError(503, "Profiling endpoints are disabled on all clusters", stage="profile"))
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    return handler


@web.middleware
async def request_logging(request: web.Request, handler):
    started = time.perf_counter()
    response = await handler(request)
    log.debug(
        "%s %s -> %s in %.1f ms", request.method, request.path, response.status, (time.perf_counter() - started) * 1000
    )
    return response


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def list_instances(request: web.Request) -> web.Response:
    state = request.app[STATE]
    # The roster names every backend: an authenticated proxy shows it to admins only.
    if state.config.api_key:
        try:
            check_admin_key(state.config.admin_api_key, request.headers.get("X-API-Key"), "read the fleet")
        except ProxyError as exc:
            return error_response(exc)
    roster = state.fleet.snapshot(state.health.in_rotation)
    return web.Response(body=orjson.dumps(roster), content_type="application/json")


async def register_instance(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        check_admin_key(state.config.admin_api_key, request.headers.get("X-API-Key"))
        payload = parse_json_body(await request.read())
        if state.roster is not None:
            record = parse_registration(payload)
            state.fleet.check_registrable(record.url, "registered")
            created = await state.roster.add(record)
        else:
            created = state.fleet.register(payload)
    except ProxyError as exc:
        return error_response(exc)
    return web.Response(body=orjson.dumps({"registered": created}), content_type="application/json")


async def unregister_instance(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        check_admin_key(state.config.admin_api_key, request.headers.get("X-API-Key"))
        if state.roster is not None:
            url = normalize_url(request.query.get("url"))
            state.fleet.check_registrable(url, "unregistered")
            removed = await state.roster.remove(url)
        else:
            removed = state.fleet.unregister(request.query.get("url"))
    except ProxyError as exc:
        return error_response(exc)
    return web.Response(body=orjson.dumps({"removed": removed}), content_type="application/json")


def middlewares(config: Config) -> list:
    # The logging middleware is outermost, so it sees the answers client_manners makes.
    chain = [request_logging] if config.log_requests else []
    chain.append(client_manners(config.api_key))
    return chain


def add_routes(app: web.Application, config: Config) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_post("/start_profile", profile_handler("start_profile"))
    app.router.add_post("/stop_profile", profile_handler("stop_profile"))
    app.router.add_get("/metrics", metrics)
    if config.dynamic_registration:
        app.router.add_get("/instances", list_instances)
        app.router.add_post("/instances", register_instance)
        app.router.add_delete("/instances", unregister_instance)
