"""Step 6 (E+P+D only): run prefill for one token and collect the KV handles decode needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from epd_proxy.backends import CHAT_PATH, Instance
from epd_proxy.errors import ProxyError
from epd_proxy.rewrite import prefill_request
from epd_proxy.upstream import Payload, Timeouts, Upstream


async def run_prefill(
    upstream: Upstream,
    prefill: Instance,
    prepared: dict[str, Any],
    headers: dict[str, str],
    timeouts: Timeouts,
    dumps: Callable[[Any], Payload] = orjson.dumps,
) -> dict[str, Any] | None:
    """The `kv_transfer_params` prefill returned, or None. Errors keep prefill's own status."""
    answer = await upstream.call(
        prefill,
        "POST",
        CHAT_PATH,
        body=dumps(prefill_request(prepared)),
        headers=headers,
        timeouts=timeouts,
        stage="prefill",
        what="Prefill request",
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
            backend=prefill.url,
            answered=answer.status,
        ) from None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) and params else None
