"""The operator's view: GET /status (one self-contained HTML page) and GET /status.json (its data).

The page has no external resources at all (many clusters are offline) and fills itself from
/status.json every few seconds. The JSON combines the live roster, a sliding window of recent
requests (see recent.py) and lifetime totals read from the same Prometheus collectors /metrics
serves, so the two never disagree.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from epd_proxy import __version__
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE
from epd_proxy.fleet.health import DOWN, EJECTED, HALF_OPEN, HEALTHY
from epd_proxy.fleet.scheduler import ExpectedFinish
from epd_proxy.http.auth import READ_FLEET, guard_admin
from epd_proxy.http.routes import error_response
from epd_proxy.journey import transports
from epd_proxy.proxy import ProxyState

if TYPE_CHECKING:
    from epd_proxy.ops.metrics import Metrics

ROLE_ORDER = {ENCODE: 0, PREFILL: 1, DECODE: 2, PREFILL_DECODE: 3}
# The live chart: the last five minutes in ten-second steps.
TIMELINE_BUCKET_S, TIMELINE_BUCKETS = 10.0, 30


# Health's states in the page's words; a healthy instance with failures piling up is "failing".
STATE_WORDS = {HEALTHY: "in rotation", HALF_OPEN: "half-open", EJECTED: "ejected", DOWN: "down"}


def roster(state: ProxyState) -> list[dict[str, Any]]:
    """Every member with its health, in the page's vocabulary: the health component's snapshot,
    read in this one place."""
    rows = []
    members = {(inst.role, inst.url): inst for inst in state.fleet.all()}
    for view in state.health.snapshot(members.values()):
        words = STATE_WORDS.get(view["state"], view["state"])
        if view["state"] == HEALTHY and (
            view["consecutive_failures"] or view["consecutive_5xx"] or view["consecutive_gateway_failures"]
        ):
            words = "failing"
        rows.append(
            {
                "role": view["role"],
                "url": view["url"],
                "state": words,
                "inflight": view["inflight"],
                "consecutive_failures": view["consecutive_failures"],
                "ejections": view["ejections"],
                "consecutive_5xx": view["consecutive_5xx"],
                "consecutive_gateway_failures": view["consecutive_gateway_failures"],
                # Which signal ejected it (transport, 5xx, gateway), while ejected or half-open.
                "ejection_reason": view["ejection_reason"],
                # How long it has been out of rotation, and how long until an ejection ends.
                "out_for_s": view["out_for_s"],
                "back_in_s": view["ejected_for_s"],
                "last_probe_age_s": view["last_check_age_s"],
                "last_probe": view["last_check"],
                "last_problem": view["last_problem"],
                # What its KV events say (prefill / PD only): state, blocks indexed, per engine.
                "kv_events": state.kv_events.view(view["url"]) if state.kv_events is not None else None,
                # How it receives encoder output, and which features that gives it (consumers only).
                "transport": transports.view(members[view["role"], view["url"]]),
            }
        )
    rows.sort(key=lambda row: (ROLE_ORDER.get(row["role"], 9), row["url"]))
    return rows


def scheduler(state: ProxyState) -> dict[str, Any]:
    """What the encoder scheduler does and knows: its options and each encoder's learnt speed,
    sub-requests in flight and groups waiting to share one (lanes.Lane)."""
    policy = state.policies[ENCODE]
    placing = policy if isinstance(policy, ExpectedFinish) else None
    return {
        "policy": state.config.encode_policy,
        "affinity": placing is not None and placing.affinity,
        "adaptive_fan_out": placing is not None and placing.adaptive,
        "coalescing": state.pipeline is not None and state.pipeline.encode.coalesce,
        "encoders": sorted((lane.view() for lane in state.lanes.all()), key=lambda view: view["url"]),
    }


def tenants(state: ProxyState) -> dict[str, Any]:
    """With --tenants, what each tenant of the file was served and where it stands against its
    share (fleet/fairness.py); empty without."""
    fairness, file = state.lanes.fairness, state.tenants
    if fairness is None or file is None:
        return {}
    _, encoders = state.asked_of_encoders(0.0)
    return fairness.view(file.current.names(), time.perf_counter(), encoders)


def _samples(metric) -> list:
    return [sample for family in metric.collect() for sample in family.samples]


def _totals(metrics: Metrics) -> dict[str, Any]:
    """Lifetime counts from the Prometheus collectors themselves."""
    requests = {s.labels["status"]: int(s.value) for s in _samples(metrics.requests) if s.name.endswith("_total")}
    subrequests = {
        s.labels["encoder"]: int(s.value) for s in _samples(metrics.encoder_subrequests) if s.name.endswith("_total")
    }
    items = {s.name: s.value for s in _samples(metrics.items_per_subrequest)}
    endpoints: dict[str, int] = {}
    for sample in _samples(metrics.endpoint_requests):
        if sample.name.endswith("_total"):
            name = sample.labels["endpoint"]
            endpoints[name] = endpoints.get(name, 0) + int(sample.value)

    def total(counter) -> int:
        return int(sum(s.value for s in _samples(counter) if s.name.endswith("_total")))

    return {
        "requests": sum(requests.values()),
        "status": dict(sorted(requests.items())),
        # Which API they came in by (chat, responses, messages).
        "endpoints": dict(sorted(endpoints.items())),
        "retries": total(metrics.retries),
        "failovers": total(metrics.failovers),
        "encoder_subrequests": subrequests,
        "coalesced_subrequests": total(metrics.coalesced),
        "split_retries": total(metrics.split_retries),
        "affinity_hits": total(metrics.affinity_hits),
        "items_reused": total(metrics.reused),
        "items_consumer_encoded": total(metrics.consumer_encoded),
        "images_per_subrequest": (
            round(items["epd_encoder_items_per_subrequest_sum"] / items["epd_encoder_items_per_subrequest_count"], 2)
            if items.get("epd_encoder_items_per_subrequest_count")
            else None
        ),
    }


def snapshot(state: ProxyState) -> dict[str, Any]:
    config, autoscale = state.config, state.metrics.autoscale
    return {
        "proxy": {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(state.metrics.recent.uptime_s(), 1),
            "mode": "dynamic" if config.dynamic_registration else "static",
            "inflight": state.admission.inflight,
            "max_inflight": config.max_inflight,
            "probe_interval_s": config.probe_interval_s,
            "fail_threshold": config.fail_threshold,
            "consecutive_5xx": config.consecutive_5xx,
            "consecutive_gateway_failure": config.consecutive_gateway_failure,
            "ejection_time_s": config.ejection_time_s,
        },
        "roster": roster(state),
        "scheduler": scheduler(state),
        "kv_index": (
            {
                "blocks": state.kv_index.blocks,
                "max_blocks": state.kv_index.max_blocks,
                "evictions": state.kv_index.evictions,
                "stale_after_s": state.kv_index.stale_after_s,
            }
            if state.kv_index is not None
            else None
        ),
        # What placement estimates a prompt's size from: tokens per image-equivalent, as learnt.
        "prompt_size": state.pipeline.prompt_size.view() if state.pipeline is not None else None,
        "tenants": tenants(state),
        "window": state.metrics.recent.summary(),
        "totals": _totals(state.metrics),
        "timeline": {
            "bucket_s": TIMELINE_BUCKET_S,
            "span_s": TIMELINE_BUCKET_S * TIMELINE_BUCKETS,
            "requests": state.metrics.recent.timeline(TIMELINE_BUCKET_S, TIMELINE_BUCKETS),
            "encoder_backlog": autoscale.backlog_timeline(TIMELINE_BUCKET_S * TIMELINE_BUCKETS)
            if autoscale is not None
            else [],
        },
    }


def _load_page() -> tuple[bytes, str]:
    """The page and a Content-Security-Policy that allows exactly its own inline script and style."""
    html = resources.files("epd_proxy.http").joinpath("static/status.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html.encode(), csp


def add_status_routes(app: web.Application, state: ProxyState) -> None:
    """The data names every backend and the requests in flight, so it is read as the roster is
    (auth.READ_FLEET); the page itself holds none, only the code that asks for it, and asks the
    viewer for the admin key when the data is refused."""
    page, csp = _load_page()
    page_headers = {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": csp,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
    }

    async def status_page(request: web.Request) -> web.Response:
        return web.Response(body=page, headers=page_headers)

    async def status_json(request: web.Request) -> web.Response:
        try:
            guard_admin(state.config, READ_FLEET, request.headers.get("X-API-Key"))
        except ProxyError as exc:
            return error_response(exc)
        return web.Response(
            body=orjson.dumps(snapshot(state)),
            headers={"Content-Type": "application/json", "Cache-Control": "no-store"},
        )

    app.router.add_get("/status", status_page)
    app.router.add_get("/status.json", status_json)
