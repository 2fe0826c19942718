"""Ask a render server for a request's prompt before placing it (`--render-urls`).

The body rendered is the one a consumer would get with every item raw under the name the proxy
sends (its door's `consumer_body`, nothing encoded yet), so the items' identifiers are those the
consumer's blocks will carry. vLLM returns the token ids and each item's hash and placeholder
range (`mm_payload: "none"`: no tensors), which fleet/rendered.py turns into the prompt's block
chain. A render decodes and processes every image of the request again (vLLM renders with its
processor cache off): 10-22 ms for the benchmark's agent steps of 1-10 images on these machines,
on the render server's CPU (docs/benchmark.md).

Rendering only sharpens placement: a render that fails, is slow or answers what is not vLLM's
shape leaves the request placed as without it, and is counted (`epd_render_total`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
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
RENDERED, FAILED = "rendered", "failed"


@dataclass(slots=True)
class RenderTarget:
    """A render server, as the connection pool takes a backend."""

    url: str
    inflight: int = 0


@dataclass(slots=True)
class Renderer:
    """The render servers, asked in turn."""

    upstream: Upstream
    urls: Sequence[str]
    metrics: Metrics
    _turn: itertools.cycle[RenderTarget] = field(init=False)

    def __post_init__(self) -> None:
        self._turn = itertools.cycle([RenderTarget(url.rstrip("/")) for url in self.urls])

    async def render(self, job: ClientBody, door: Door) -> Rendered | None:
        """The request's prompt as vLLM renders it, or None."""
        if job.body is None:
            return None
        body = door.consumer_body(job.body, job.items, Matches(), rewrite=True, push_mode=False)
        body["mm_payload"] = "none"
        target = next(self._turn)
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
            rendered = parse_render(orjson.loads(answer.body)) if answer.status == 200 else None
            why = f"answered {answer.status}" if answer.status != 200 else "answered what is not a rendered prompt"
        except (NoAnswer, ProxyError) as exc:
            rendered, why = None, str(exc)
        except orjson.JSONDecodeError:
            rendered, why = None, "answered a body that is not JSON"
        self.metrics.renders.labels(RENDERED if rendered is not None else FAILED).inc()
        if rendered is None:
            log.debug("render server %s %s; the request is placed without it", target.url, why)
        return rendered
