"""--max-inflight: how many requests the proxy works on at once, and the fast 503 beyond that.

A request is counted from when its body is read and validated until its answer ends, so a client
still uploading holds no slot: admission bounds work, not waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from epd_proxy.errors import ProxyError


class _Counter(Protocol):
    def inc(self) -> None: ...


class Admission:
    def __init__(self, limit: int, rejected: _Counter) -> None:
        self.limit = limit
        self.inflight = 0
        self._rejected = rejected

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold a slot for the block; an overloaded ProxyError (503, stage `admission`) when none is free."""
        if self.limit and self.inflight >= self.limit:
            self._rejected.inc()
            raise ProxyError(
                503,
                f"the proxy is at its limit of {self.limit} requests in flight; retry shortly",
                stage="admission",
                error_type="overloaded",
            )
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
