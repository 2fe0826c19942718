"""Ask a render server for a request's prompt before placing it (`--render-urls`).

The body rendered is the one a consumer would get with every item raw under the name the proxy
sends (its door's `consumer_body`, nothing encoded yet), so the items' identifiers are those the
consumer's blocks will carry. vLLM returns the token ids and each item's hash and placeholder
range (`mm_payload: "none"`: no tensors), which fleet/rendered.py turns into the prompt's block
chain. A render decodes and processes every image of the request again (vLLM renders with its
processor cache off): 10-22 ms for the benchmark's agent steps of 1-10 images on these machines,
on the render server's CPU (docs/benchmark.md).

A LoRA adapter's blocks are keyed by its name too, and render only echoes the request's `model`:
which models are adapters (`parent` set) the render server's `/v1/models` says, asked when an
answer names a model not heard of before (at most every REST_S). An adapter is rendered only by
an engine that serves it (`--enable-scale-out`; a GPU-less render server knows no adapters and
answers 404); a model `/v1/models` does not list is taken for a base model.

Rendering only sharpens placement: a render that fails, is slow or answers what is not vLLM's
shape leaves the request placed as without it, and is counted (`epd_render_total`). A server that
failed so is left alone for a while (the next in turn is asked instead), and one with many renders
in flight is not asked, so that a render server down or behind holds placement up by at most
`--render-timeout`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.rendered import Rendered, parse_render
from epd_proxy.journey.doors import Door
from epd_proxy.journey.match import Matches
from epd_proxy.journey.route import ClientBody
from epd_proxy.ops.metrics import Metrics

log = logging.getLogger("epd_proxy.render")

# How long a server that failed is left alone: each request would wait out its failure otherwise.
REST_S = 5.0
# Renders in flight on one server past which requests are placed without asking it.
MAX_INFLIGHT = 32
RENDERED, FAILED, SKIPPED = "rendered", "failed", "skipped"
# Models of one render server's list kept, past which its answer is not vLLM's.
MAX_MODELS = 4096


@dataclass(slots=True)
class RenderTarget:
    """A render server, as the connection pool takes a backend."""

    url: str
    inflight: int = 0
    # Not asked before this time (the renderer's clock): it failed.
    resting_until: float = 0.0
    # Each model its /v1/models lists: the model an adapter is of, None for a base model.
    models: dict[str, str | None] = field(default_factory=dict)
    models_asked: float = -REST_S


@dataclass(slots=True)
class Renderer:
    """The render servers, asked in turn."""

    upstream: Upstream
    urls: Sequence[str]
    metrics: Metrics
    # --render-timeout: a render is worth waiting for only while it is cheaper than the placement
    # it sharpens (10-25 ms on an idle server).
    timeout_s: float = 0.5
    # The consumer's body is rendered as the pipeline writes it (--no-rewrite: media as the client
    # sent them, which vLLM names by their content).
    rewrite: bool = True
    clock: Callable[[], float] = time.monotonic
    _targets: list[RenderTarget] = field(init=False)
    _turn: itertools.cycle[RenderTarget] = field(init=False)

    def __post_init__(self) -> None:
        self._targets = [RenderTarget(url.rstrip("/")) for url in self.urls]
        self._turn = itertools.cycle(self._targets)

    def _next(self) -> RenderTarget | None:
        """The next server in turn that is neither resting nor full."""
        now = self.clock()
        for _ in self._targets:
            target = next(self._turn)
            if target.inflight < MAX_INFLIGHT and now >= target.resting_until:
                return target
        return None

    async def render(self, job: ClientBody, door: Door) -> Rendered | None:
        """The request's prompt as vLLM renders it, or None."""
        if job.body is None:
            return None
        target = self._next()
        if target is None:
            self.metrics.renders.labels(SKIPPED).inc()
            return None
        body = door.consumer_body(job.body, job.items, Matches(), rewrite=self.rewrite, push_mode=False)
        body["mm_payload"] = "none"
        status = None
        try:
            answer = await self.upstream.call(
                target,
                "POST",
                door.path + "/render",
                body=job.dumps(body),
                headers={"Content-Type": "application/json"},
                timeouts=Timeouts(connect=self.timeout_s, total=self.timeout_s),
                stage="render",
                what="Render request",
                # It changes nothing on the server: sent again when a reused connection was dropped.
                idempotent=True,
            )
            status = answer.status
            parsed = orjson.loads(answer.body) if status == 200 else None
            rendered = parse_render(parsed)
            if rendered is not None and isinstance(parsed, dict):
                rendered.lora_name = await self._adapter(target, parsed.get("model"))
            why = f"answered {status}" if status != 200 else "answered what is not a rendered prompt"
        except (NoAnswer, ProxyError) as exc:
            rendered, why = None, str(exc)
        except orjson.JSONDecodeError:
            rendered, why = None, "answered a body that is not JSON"
        self.metrics.renders.labels(RENDERED if rendered is not None else FAILED).inc()
        if rendered is None:
            # A 4xx is the request's (its consumer will refuse it too, or names a model the render
            # server lacks) but for a 403, vLLM's answer when the server has no render endpoints.
            # No other client's request may turn rendering off for everyone.
            if status is None or status >= 500 or status in (200, 403):
                target.resting_until = self.clock() + REST_S
                log.warning("render server %s %s; it is not asked for %.0f s", target.url, why, REST_S)
            else:
                log.debug("render server %s %s; the request is placed without it", target.url, why)
        return rendered

    async def _adapter(self, target: RenderTarget, model: Any) -> str | None:
        """`model` when the render server lists it as a LoRA adapter, else None."""
        if not isinstance(model, str):
            return None
        if model not in target.models and self.clock() >= target.models_asked + REST_S:
            target.models_asked = self.clock()
            target.models = await self._models(target) or target.models
        return model if target.models.get(model) else None

    async def _models(self, target: RenderTarget) -> dict[str, str | None] | None:
        """What the server's /v1/models lists: each id and its `parent`; None when it does not say."""
        try:
            answer = await self.upstream.call(
                target,
                "GET",
                "/v1/models",
                timeouts=Timeouts(connect=self.timeout_s, total=self.timeout_s),
                stage="render",
                what="Model list request",
                idempotent=True,
            )
            listed = orjson.loads(answer.body) if answer.status == 200 else None
        except (NoAnswer, ProxyError, orjson.JSONDecodeError):
            listed = None
        data = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(data, list):
            log.debug("render server %s did not list its models", target.url)
            return None
        return {
            card["id"]: card.get("parent") if isinstance(card.get("parent"), str) else None
            for card in data[:MAX_MODELS]
            if isinstance(card, dict) and isinstance(card.get("id"), str)
        }
