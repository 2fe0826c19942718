"""Step 6 (E+P+D only): run prefill for one token and collect the KV handles decode needs."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from epd_proxy.backends import Instance, reaching
from epd_proxy.errors import ProxyError, UpstreamError
from epd_proxy.rewrite import prefill_request


async def run_prefill(
    session: aiohttp.ClientSession,
    prefill: Instance,
    prepared: dict[str, Any],
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
) -> dict[str, Any] | None:
    """The `kv_transfer_params` prefill returned, or None. Errors keep prefill's own status."""
    data = orjson.dumps(prefill_request(prepared))
    with prefill.busy(), reaching(prefill, "prefill", "Prefill request", timeout.total):
        async with session.post(prefill.chat_url, data=data, headers=headers, timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise UpstreamError(resp.status, raw, resp.content_type, stage="prefill", backend=prefill.url)
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ProxyError(
            502, "Prefill answered 200 with a body that is not JSON", stage="prefill", backend=prefill.url
        ) from None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) and params else None
