"""Ask a render server for a request's prompt before placing it (`--render-urls`).

The body rendered is the one a consumer would get with every item raw under the name the proxy
sends (its door's `consumer_body`, nothing encoded yet), so the items' identifiers are those the
consumer's blocks will carry. vLLM returns the token ids and each item's hash and placeholder
range (`mm_payload: "none"`: no tensors), which fleet/rendered.py turns into the prompt's block
chain. A render decodes and processes every image of the request again (vLLM renders with its
processor cache off): 10-22 ms for the benchmark's agent steps of 1-10 images on these machines,
on the render server's CPU (docs/benchmark.md).

Rendering only sharpens placement: a render that fails, is slow or answers what is not vLLM's
shape leaves the request placed as without it, and is counted (`epd_render_total`). A server that
failed so is left alone for a while, and one with many renders in flight is not asked, so that a
render server down or behind never holds placement up by more than one timeout.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.rendered import Rendered, parse_render
from epd_proxy.journey.doors import Door
from epd_proxy.journey.match import Matches
from epd_proxy.journey.route import ClientBody
from epd_proxy.ops.metrics import Metrics

log = logging.getLogger("epd_proxy.render")

# A render is worth waiting for only while it is cheaper than the placement it sharpens.
RENDER_TIMEOUT_S = 2.0
# How long a server that failed is left alone: each request would wait out its failure otherwise.
REST_S = 5.0
# Renders in flight on one server past which requests are placed without asking it.
MAX_INFLIGHT = 32
RENDERED, FAILED, SKIPPED = "rendered", "failed", "skipped"


@dataclass(slots=True)
class RenderTarget:
    """A render server, as the connection pool takes a backend."""

    url: str
    inflight: int = 0
    # Not asked before this time (the renderer's clock): it failed.
    resting_until: float = 0.0


@dataclass(slots=True)
class Renderer:
    """The render servers, asked in turn."""

    upstream: Upstream
    urls: Sequence[str]
    metrics: Metrics
    clock: Callable[[], float] = time.monotonic
    _turn: itertools.cycle[RenderTarget] = field(init=False)

    def __post_init__(self) -> None:
        self._turn = itertools.cycle([RenderTarget(url.rstrip("/")) for url in self.urls])

    async def render(self, job: ClientBody, door: Door) -> Rendered | None:
        """The request's prompt as vLLM renders it, or None."""
        if job.body is None:
            return None
        target = next(self._turn)
        if target.inflight >= MAX_INFLIGHT or self.clock() < target.resting_until:
            self.metrics.renders.labels(SKIPPED).inc()
            return None
        body = door.consumer_body(job.body, job.items, Matches(), rewrite=True, push_mode=False)
        body["mm_payload"] = "none"
        status = None
        try:
            answer = await self.upstream.call(
                target,
                "POST",
                door.path + "/render",
                body=job.dumps(body),
                headers={"Content-Type": "application/json"},
                timeouts=Timeouts(connect=RENDER_TIMEOUT_S, total=RENDER_TIMEOUT_S),
                stage="render",
                what="Render request",
            )
            status = answer.status
            rendered = parse_render(orjson.loads(answer.body)) if status == 200 else None
            why = f"answered {status}" if status != 200 else "answered what is not a rendered prompt"
        except (NoAnswer, ProxyError) as exc:
            rendered, why = None, str(exc)
        except orjson.JSONDecodeError:
            rendered, why = None, "answered a body that is not JSON"
        self.metrics.renders.labels(RENDERED if rendered is not None else FAILED).inc()
        if rendered is None:
            # A 400 is this request's (its consumer will refuse it too); anything else is the server's.
            if status != 400:
                target.resting_until = self.clock() + REST_S
            log.debug("render server %s %s; the request is placed without it", target.url, why)
        return rendered
