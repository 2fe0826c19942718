"""Step 7: send decode the prepared body and hand back the open response once it has answered.

The client's status is decided only after decode's headers arrive, so a failure anywhere in the
pipeline reaches a streaming client as a real HTTP error instead of a 200 stream that breaks off.
"""

from __future__ import annotations

from typing import Any

import orjson

from epd_proxy.backends import CHAT_PATH, Instance
from epd_proxy.upstream import Answer, Timeouts, Upstream, UpstreamFailure


async def open_decode(
    upstream: Upstream, decoder: Instance, body: dict[str, Any], headers: dict[str, str], timeouts: Timeouts
) -> Answer:
    """A 2xx answer whose body is still unread; the caller must release it. Only the wait for
    headers is bounded by the decode timeout: a long stream after them is legitimate."""
    answer = await upstream.open(
        decoder,
        "POST",
        CHAT_PATH,
        body=orjson.dumps(body),
        headers=headers,
        timeouts=timeouts,
        stage="decode",
        what="Decode request",
        # The request has held this decoder since routing chose it (least-loaded counts it).
        count_inflight=False,
    )
    if answer.status >= 400:
        async with answer:
            try:
                await answer.read()
            except UpstreamFailure:
                pass  # the status is the answer; a body cut short only loses the details
        raise answer.error()
    return answer
