"""Step 6 (E+P+D only): prefill's body (pure), and running it for one token to collect the KV
handles decode needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from epd_proxy.calls.upstream import Upstream
from epd_proxy.errors import ProxyError
from epd_proxy.journey.decode import EngineCall

# Sampling fields that contradict a single non-streamed token: vLLM rejects min_tokens > max_tokens
# with a 400, and extra sequences (n, best_of, beam search) would only multiply prefill's work.
_PREFILL_DROPPED = ("min_tokens", "best_of", "use_beam_search", "stream_options")


# What prefill is sent in place of any `kv_transfer_params`, whichever API the request uses.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_request(prepared: dict[str, Any]) -> dict[str, Any]:
    """Prefill runs one token and hands its KV cache to decode; decode samples with the client's
    own options."""
    body = {
        **prepared,
        "kv_transfer_params": dict(REMOTE_DECODE),
        "stream": False,
        "max_tokens": 1,
    }
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if "n" in body:
        body["n"] = 1
    for name in _PREFILL_DROPPED:
        body.pop(name, None)
    return body


async def run_prefill(
    upstream: Upstream, call: EngineCall, build: Callable[[dict[str, Any]], dict[str, Any]] = prefill_request
) -> dict[str, Any] | None:
    """The `kv_transfer_params` prefill returned, or None. Errors keep prefill's own status.
    `call.body` is the prepared body `build` turns into prefill's; `call.path` and `build` are
    the client's API's (every API vLLM serves returns them)."""
    answer = await upstream.call(
        call.instance,
        "POST",
        call.path,
        body=call.dumps(build(call.body)),
        headers=call.headers,
        timeouts=call.timeouts,
        stage="prefill",
        what="Prefill request",
        # The request holds this instance from routing's choice on (pipeline.Route.held).
        count_inflight=False,
    )
    if not 200 <= answer.status < 300:
        raise answer.error()
    try:
        parsed = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        raise ProxyError(
            502,
            f"Prefill answered {answer.status} with a body that is not JSON",
            stage="prefill",
            backend=call.instance.url,
            answered=answer.status,
        ) from None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) and params else None
