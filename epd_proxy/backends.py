"""Backend instances and the one HTTP client pool every stage shares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from epd_proxy.config import Config
from epd_proxy.errors import BackendUnreachable, describe

ENCODE, PREFILL, DECODE, PREFILL_DECODE = "encode", "prefill", "decode", "prefill_decode"
ROLES = (ENCODE, PREFILL, DECODE, PREFILL_DECODE)


@dataclass(eq=False, slots=True)
class Instance:
    """One vLLM server as the proxy sees it. Identity is the object, so two roles never alias."""

    url: str
    role: str
    # Mooncake EC consumer control addresses, one per data-parallel replica.
    zmq_addrs: tuple[str, ...] = ()
    dp_size: int = 1
    inflight: int = 0
    # In rotation; False once evicted by failed probes or failed live traffic.
    live: bool = True
    consecutive_failures: int = 0
    evicted_at: float | None = None
    # Unregistered: terminal, a late probe result must not revive it.
    removed: bool = False
    _dp_cursor: int = field(default=0, repr=False)
    # Parsed once: building a URL object per sub-request shows up in profiles.
    chat_url: URL = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.chat_url = URL(f"{self.url}/v1/chat/completions")

    def next_dp_rank(self) -> int:
        rank = self._dp_cursor % self.dp_size
        self._dp_cursor = rank + 1
        return rank

    @contextmanager
    def busy(self) -> Iterator[None]:
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1


def make_session(config: Config) -> aiohttp.ClientSession:
    """Pooled keep-alive client whose idle connections retire before vLLM's uvicorn closes them,
    so a reused connection is never one the server already dropped (ServerDisconnectedError)."""
    keep_alive = config.pool_keep_alive_s
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=config.max_connections_per_backend,
        keepalive_timeout=keep_alive if keep_alive is not None else 0,
        force_close=keep_alive is None,
        enable_cleanup_closed=False,
    )
    headers = {"Authorization": f"Bearer {config.backend_api_key}"} if config.backend_api_key else None
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
        headers=headers,
        # Relayed bytes must arrive as the backend wrote them: ask for no compression at all.
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


@contextmanager
def reaching(instance: Instance, stage: str, what: str, timeout_s: float | None) -> Iterator[None]:
    """No answer at all (refused, reset, timed out) becomes BackendUnreachable naming the stage;
    an answer, even an error, passes through untouched."""
    try:
        yield
    except TimeoutError:
        # With the stage limit off, only the connect timeout can fire.
        limit = f"after {timeout_s:g}s" if timeout_s is not None else "while connecting"
        raise BackendUnreachable(
            f"{what} timed out {limit}", stage=stage, backend=instance.url, timed_out=True
        ) from None
    except aiohttp.ClientError as exc:
        raise BackendUnreachable(f"{what} failed: {describe(exc)}", stage=stage, backend=instance.url) from None
