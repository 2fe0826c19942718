"""The HTTP routes: thin handlers over the proxy's parts (proxy.py), error rendering, the access log.

Every answer is in the proxy's JSON error shape, whoever makes it: a handler, aiohttp's router
(404, 405) or an unexpected exception (a generic 500, its details in the log only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from epd_proxy.calls.upstream import NoAnswer, Timeouts
from epd_proxy.config import Config
from epd_proxy.errors import ErrorAnswer, InternalError, ProxyError
from epd_proxy.fleet.backends import DECODE
from epd_proxy.fleet.registry import normalize_url, parse_registration
from epd_proxy.http.auth import (
    CHANGE_FLEET,
    PROFILE,
    READ_FLEET,
    X_API_KEY_PATHS,
    Gateway,
    check_client_key,
    guard_admin,
    guarded,
    identify,
    may,
)
from epd_proxy.http.guard import ClientTimeout, read_chunks
from epd_proxy.http.request_id import request_id
from epd_proxy.journey.admission import (
    DEADLINE_HEADER,
    WITHIN,
    TurnedAway,
    request_deadline,
    shed_decision,
    turned_away,
)
from epd_proxy.journey.doors import CHAT, Door
from epd_proxy.journey.encode import request_priority
from epd_proxy.journey.extract import MediaItem, NormalisedRequest, ReadOptions, parse_json_body
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.relay import ABORTED, CLIENT_GONE, relay
from epd_proxy.journey.remote import fetch_media
from epd_proxy.journey.route import ClientBody, text_chars
from epd_proxy.journey.splice import Spliced
from epd_proxy.journey.trace import Trace, account
from epd_proxy.ops import tracing
from epd_proxy.proxy import STATE, ProxyState
from epd_proxy.tenants import DEFAULT, Tenant, clamp_priority, salt_prompt

# The name operators' log filters know; logs.py turns it up for --log-requests.
log = logging.getLogger("epd_proxy.app")
# Bodies above this are read (lifted, hashed, normalised) in a worker thread, so one huge upload
# does not stall every other stream on the loop; sha256 runs at about 2 ms per MB here. Smaller
# bodies stay on the loop: measured with `epd-proxy bench --variant`, a thread for every
# multi-image request cost 4-16% more CPU per request and 6% less throughput, pinned to one core
# or not, because the worker and the loop take turns on the GIL for everything but the hashing.
OFFLOAD_READ_BYTES = 4 * 1024 * 1024
# Whose request it is (--tenants), as the client manners found it before routing.
TENANT = web.RequestKey("tenant", Tenant)


def error_response(exc: ProxyError, request_id: str | None = None, door: Door = CHAT) -> web.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    if exc.stage == "admission" or exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s or 1)
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
    """The body in one buffer, read with the client body clock (guard.py): `request.read()`
    would copy it twice more (a megabyte per multi-image request) and have no clock; orjson
    parses a bytearray directly. Every body the proxy reads comes through here."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    body = bytearray()
    chunk: bytes | None = None
    try:
        async for chunk in read_chunks(request):
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientTimeout as exc:
        # `serve` keeps the error (trace.error), whose traceback would keep the half-read body in
        # a cycle until the next collection, which the worker makes rare: leave without it.
        del body
        chunk = None
        raise exc.with_traceback(None) from None
    return body


async def parse_body(door: Door, raw: bytearray, options: ReadOptions) -> tuple[NormalisedRequest, Spliced | None]:
    """`door.parse`, in a worker thread for a body above OFFLOAD_READ_BYTES."""
    if len(raw) > OFFLOAD_READ_BYTES:
        return await asyncio.to_thread(door.parse, raw, options)
    return door.parse(raw, options)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body exceeds {limit} bytes", stage="request")


def client_manners(api_key: str, tenanted: bool = False, gateway: Gateway | None = None):
    """Every answer a handler does not make itself, in the proxy's JSON error shape: 401 before
    routing (auth.py; in the Messages door's shape on its paths), aiohttp's 404 and 405, and a
    generic 500 for an unexpected exception, whose details go to the log only. With `tenanted`
    (--tenants) it finds each guarded request's tenant (TENANT), by key or through `gateway`."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if tenanted or api_key:
            headers = request.headers
            try:
                if not tenanted:
                    check_client_key(
                        api_key, request.method, request.path, headers.get("Authorization"), headers.get("x-api-key")
                    )
                elif guarded(request.method, request.path):
                    tenants = request.app[STATE].tenants
                    assert tenants is not None, "a tenanted proxy reads its tenants file as it starts"
                    named = gateway.named(headers.get(gateway.header), request.remote) if gateway else None
                    request[TENANT] = identify(
                        tenants.current,
                        api_key,
                        request.path,
                        headers.get("Authorization"),
                        headers.get("x-api-key"),
                        named,
                    )
            except ProxyError as exc:
                return error_response(exc, door=MESSAGES if request.path in X_API_KEY_PATHS else CHAT)
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
            # One a handler let escape, such as the body timeout out of `read_body`.
            return error_response(exc)
        except Exception:
            if request.writer.output_size > 0:
                raise  # the answer has begun: aiohttp closes the connection, nothing else can be said
            rid = request_id(request.headers)
            log.exception("request %s: unexpected failure in %s %s", rid, request.method, request.path)
            return error_response(InternalError(rid.value), rid.value)

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
    rid = request_id(request.headers)
    trace = Trace(rid.value, client_request_id=rid.refused)
    tenant = request.get(TENANT)
    if tenant is not None:
        trace.tenant, trace.isolated = tenant.name, tenant.isolated
    trace.spans = tracing.begin(request.headers, rid.value, trace.started, door.path)
    trace.endpoint = door.name
    status: int | str = 500  # or "aborted": the answer was cut off under way
    # With --tenants: the fair-shares ledger, and the tenant counted there while its request runs.
    fairness = state.lanes.fairness
    counted: str | None = None
    try:
        raw = await read_body(request, config.max_body_bytes)
        read = time.perf_counter()
        trace.read_s = read - trace.started
        if trace.spans is not None:
            tracing.lap(trace.spans, "read_body", trace.started, **{"http.request.body.size": len(raw)})
        # With splice, `raw` lives on in `spliced` (the media are slices of it) and the parsed
        # body holds only the skeleton; otherwise the parsed body holds the media and raw goes.
        # An isolated tenant's media are named apart from everyone else's as they are read.
        options = state.parse_options.salted(tenant.cache_salt if tenant is not None else None)
        normalised, spliced = await parse_body(door, raw, options)
        chars = text_chars(len(raw), normalised.items, spliced)
        del raw
        body, items = normalised.body, normalised.items
        trace.items = len(items)
        if trace.spans is not None:
            model = str(body.get("model"))
            tracing.lap(trace.spans, "extract", read, **{"epd.items": len(items), "gen_ai.request.model": model})
        (state.metrics.parsed_spliced if spliced is not None else state.metrics.parsed_full).inc()
        wait = arrive(state, request, tenant, body, items)
        if fairness is not None and tenant is not None:
            fairness.began(tenant.name, tenant.weight)
            counted = tenant.name
        with state.admission.admit(wait):
            if any(item.fetch for item in normalised.items):
                with trace.stage("fetch_media"):
                    normalised = await fetch_media(normalised, state.media, door, options.digest)
            # From here on only the pipeline holds the body, and it lets go once decode commits.
            job = ClientBody(normalised.body, normalised.items, spliced, chars)
            del normalised, body, items, spliced
            pipeline = state.pipeline
            assert pipeline is not None, "start() builds the pipeline before the server takes requests"
            listener = pipeline.usage(job, counted, door)
            route = await pipeline.place(job, trace, door)
            with route.held():
                answer = await pipeline.open(job, route, trace, door)
                try:
                    with trace.stage("relay"):
                        response, trace.outcome = await relay(
                            request,
                            answer,
                            {"x-request-id": rid.value},
                            door,
                            listener,
                        )
                    outcomes: dict[str, int | str] = {ABORTED: "aborted", CLIENT_GONE: 499}
                    status = outcomes.get(trace.outcome, answer.status)
                    if trace.outcome == CLIENT_GONE:
                        log.info("request %s: the client disconnected during the answer", rid)
                    return response
                finally:
                    answer.release()
    except ProxyError as exc:
        status = exc.status
        trace.error = exc
        if isinstance(exc, TurnedAway):
            state.metrics.shed.labels(trace.tenant or DEFAULT, exc.reason).inc()
            state.metrics.shed_answer.labels(exc.reason).observe(time.perf_counter() - trace.started)
        return error_response(exc, rid.value, door)
    except asyncio.CancelledError:
        status = 499
        trace.outcome = CLIENT_GONE
        raise
    except Exception:  # the client must get JSON, whatever broke inside the proxy
        log.exception("request %s: unexpected proxy failure", rid)
        status = 500
        return error_response(InternalError(rid.value), rid.value, door)
    finally:
        if fairness is not None and counted is not None:
            fairness.ended(counted, time.perf_counter())
        account(state.metrics, trace, status)


def arrive(
    state: ProxyState, request: web.Request, tenant: Tenant | None, body: dict, items: list[MediaItem]
) -> Callable[[], float] | None:
    """A request as it arrives: its `priority` clamped into its tenant's range (and --priority-range),
    and turned away at once if it cannot start within its deadline. Returns how to predict its wait
    in seconds, for the Retry-After of --max-inflight (None when there is no limit to refuse it)."""
    config = state.config
    allowed = tenant.priority.within(config.priority_range) if tenant is not None else config.priority_range
    if allowed is not None:
        clamp_priority(body, allowed)
    if tenant is not None:
        salt_prompt(body, tenant)
    fairness = state.lanes.fairness if tenant is not None else None
    now, encoders = time.perf_counter(), 0.0
    if fairness is not None and tenant is not None:
        asked, encoders = state.asked_of_encoders(sum(item.cost for item in items))
        fairness.asked(tenant.name, tenant.weight, asked, now)
    deadline = request_deadline(request.headers.get(DEADLINE_HEADER), tenant.deadline_s if tenant else None)
    if deadline is None and not state.admission.limit:
        return None
    largest = max((item.cost for item in items), default=0.0)
    if deadline is not None:
        share = WITHIN if fairness is None or tenant is None else fairness.share(tenant.name, now, encoders)
        wait = state.wait_at_arrival(largest, tenant.name if tenant is not None else None, request_priority(body))
        shed = shed_decision(wait, deadline, share)
        if shed is not None:
            raise turned_away(shed, wait.seconds, deadline)
    return lambda: state.wait_at_arrival(largest).seconds


@dataclass(frozen=True, slots=True)
class DecoderCall:
    """A call any decoder answers as every other would, relayed as it answers it."""

    method: str
    path: str
    timeouts: Timeouts
    what: str
    # None: the call counts towards the decoder's in-flight figures like any other.
    count_inflight: bool | None = None


MODELS = DecoderCall("GET", "/v1/models", Timeouts(total=10), "model list", count_inflight=False)


async def ask_a_decoder(state: ProxyState, call: DecoderCall, body: bytes | None = None) -> web.Response:
    """`call` on one live decoder, its answer as it gave it; a ProxyError if there is none to ask."""
    pipeline, upstream = state.pipeline, state.upstream
    assert pipeline is not None and upstream is not None, "start() builds them before the server takes requests"
    candidates = pipeline.decoders()
    if not candidates:
        raise ProxyError(503, "no live decode instance", stage="route")
    decoder = state.policies[DECODE].choose(candidates, (call.path,))[0]
    try:
        answer = await upstream.call(
            decoder,
            call.method,
            call.path,
            body=body,
            headers=None if body is None else {"Content-Type": "application/json"},
            timeouts=call.timeouts,
            stage="decode",
            what=f"{call.what} from {decoder.url}",
            count_inflight=call.count_inflight,
        )
    except NoAnswer as exc:
        raise ProxyError(502, exc.message, stage="decode", backend=decoder.url) from None
    return web.Response(status=answer.status, body=answer.body, headers={"Content-Type": answer.content_type})


async def list_models(request: web.Request) -> web.Response:
    try:
        return await ask_a_decoder(request.app[STATE], MODELS)
    except ProxyError as exc:
        return error_response(exc)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    status, body = state.report.answer(may(state.config, READ_FLEET, request.headers.get("X-API-Key")))
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def profile_handler(action: str):
    async def handler(request: web.Request) -> web.Response:
        state = request.app[STATE]
        try:
            guard_admin(state.config, PROFILE, request.headers.get("X-API-Key"))
            assert state.profiling is not None, "start() builds it before the server takes requests"
            out = await state.profiling.fan_out(
                action, bytes(await read_body(request, state.config.max_body_bytes)) or b"{}"
            )
        except ProxyError as exc:
            return error_response(exc)
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
    try:
        guard_admin(state.config, READ_FLEET, request.headers.get("X-API-Key"))
    except ProxyError as exc:
        return error_response(exc)
    roster = state.fleet.snapshot(state.health.in_rotation)
    return web.Response(body=orjson.dumps(roster), content_type="application/json")


async def register_instance(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        guard_admin(state.config, CHANGE_FLEET, request.headers.get("X-API-Key"))
        payload = parse_json_body(await read_body(request, state.config.max_body_bytes))
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
        guard_admin(state.config, CHANGE_FLEET, request.headers.get("X-API-Key"))
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
    gateway = Gateway(config.tenant_header, config.trusted_proxies) if config.tenant_header else None
    chain.append(client_manners(config.api_key, bool(config.tenants_file), gateway))
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
