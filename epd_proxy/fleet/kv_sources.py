"""Which engines publish KV events, and where: asked of each prefill / decode / PD instance as it
joins, a feed (kv_events.py) per data-parallel rank, all feeding one index (kv_index.py).

vLLM 0.32 answers `GET /kv_event_sources` on every `vllm serve` with its publishers' settings per
data-parallel rank, `{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
"topic": "", ...}}`, and `{}` when it publishes none (`entrypoints/serve/instrumentator/basic.py`).
The proxy connects to the named port on the instance's own host, whatever host the answer names
(`*` where the engine binds, or the address it bound to), so an engine can point the proxy at no
other machine. `--kv-events-endpoints` replaces the question with the operator's endpoints.

An instance is asked again when it registers again, and when one of its engines stays stale (it
may have restarted on other ports); one that publishes nothing, or has no such route, every
`RECHECK_S`; one that cannot be asked, sooner, backing off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
import zmq.asyncio

from epd_proxy.addresses import split_kv_endpoint, zmq_problem
from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream
from epd_proxy.config import Config
from epd_proxy.fleet.backends import DECODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.kv_events import Feed, FeedCounts, Source
from epd_proxy.fleet.kv_index import FRESH, NONE, STALE, KvIndex

log = logging.getLogger("epd_proxy.kv_sources")

SOURCES_PATH = "/kv_event_sources"
LM_ROLES = (PREFILL, DECODE, PREFILL_DECODE)
_LOOPBACK = {"127.0.0.1", "localhost", "[::1]"}
MAX_RANKS = 1024
RECHECK_S = 60.0
FIRST_RETRY_S = 1.0
ASK_TIMEOUT_S = 5.0


def engine_host(url: str) -> str:
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def on_host(endpoint: str, host: str) -> str | None:
    """Where to follow a publisher an engine names: its port on the engine's own host, whatever
    host it names (a wildcard where it binds, or the address it bound `*:0` to), so a backend
    can send the proxy nowhere else; a local socket only when the engine is on this machine.
    None for anything else."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        return endpoint if host in _LOOPBACK else None
    address, _, port = rest.rpartition(":")
    if scheme != "tcp" or not address or not port.isdigit():
        return None
    return f"tcp://{host}:{port}"


def at_rank(endpoint: str, rank: int) -> str:
    """vLLM's rule: data-parallel rank r publishes on the tcp port + r (a port 0 stays 0)."""
    scheme, _, rest = endpoint.partition("://")
    address, _, port = rest.rpartition(":")
    if rank == 0 or scheme != "tcp" or not port.isdigit() or port == "0":
        return endpoint
    return f"tcp://{address}:{int(port) + rank}"


def read_sources(url: str, body: bytes) -> dict[int, Source]:
    """`/kv_event_sources`'s answer as a Source per rank; ValueError when it is not that shape.
    Ranks whose publisher is not a ZMQ one (or whose endpoint is not one) are left out."""
    answer = orjson.loads(body)
    if not isinstance(answer, dict) or len(answer) > MAX_RANKS:
        raise ValueError("not an object of at most 1024 ranks")
    host, out = engine_host(url), {}
    for rank_text, settings in answer.items():
        if not (isinstance(rank_text, str) and rank_text.isdigit() and isinstance(settings, dict)):
            raise ValueError(f"rank {rank_text!r}: not a rank and its settings")
        endpoint, replay, topic = (settings.get(k) for k in ("endpoint", "replay_endpoint", "topic"))
        if settings.get("publisher", "zmq") != "zmq" or not isinstance(endpoint, str) or zmq_problem(endpoint):
            continue
        placed = on_host(endpoint, host)
        if placed is None:
            continue
        replay = on_host(replay, host) if isinstance(replay, str) and not zmq_problem(replay) else None
        out[int(rank_text)] = Source(placed, replay, topic if isinstance(topic, str) else "")
    return out


def given_sources(entry: str, url: str, dp_size: int) -> dict[int, Source]:
    """An entry of `--kv-events-endpoints` for one instance: `{host}` filled in, rank r on port + r."""
    host = engine_host(url)
    endpoint, replay = (part.replace("{host}", host) if part else None for part in split_kv_endpoint(entry))
    assert endpoint is not None
    return {rank: Source(at_rank(endpoint, rank), replay and at_rank(replay, rank)) for rank in range(dp_size)}


@dataclass
class _Follow:
    inst: Instance
    task: asyncio.Task | None = None
    # What the instance said about its publishers last: None until it answered.
    sources: dict[int, Source] | None = None
    note: str = "not asked yet"
    # Set when the instance registers again: its sources are asked again at once.
    again: asyncio.Event = field(default_factory=asyncio.Event)


class KvEvents:
    """A registry watcher: follows every prefill / decode / PD instance's engines into `index`."""

    def __init__(self, index: KvIndex, *, given: Mapping[str, str] | str | None = None) -> None:
        self.index = index
        # --kv-events-endpoints: a template for every instance, or an entry per listed URL.
        self._given = given
        self._follows: dict[str, _Follow] = {}
        self._pool: Upstream | None = None
        self._context: zmq.asyncio.Context | None = None
        self.counts = FeedCounts()

    @classmethod
    def from_config(cls, config: Config, index: KvIndex) -> KvEvents:
        given: Mapping[str, str] | str | None = None
        entries = config.kv_events_endpoints
        if len(entries) == 1 and "{host}" in entries[0]:
            given = entries[0]
        elif entries:
            given = dict(zip((*config.prefill_urls, *config.decode_urls), entries))
        return cls(index, given=given)

    # -- membership events -------------------------------------------------------------------------------
    def joined(self, inst: Instance) -> None:
        if inst.role in LM_ROLES:
            self._follows[inst.url] = follow = _Follow(inst)
            self._launch(follow)

    def rejoined(self, inst: Instance) -> None:
        """Registered again, perhaps restarted: its sources are asked again at once."""
        follow = self._follows.get(inst.url)
        if follow is None:
            self.joined(inst)
        else:
            follow.again.set()

    def left(self, inst: Instance) -> None:
        follow = self._follows.pop(inst.url, None)
        if follow is not None and follow.task is not None:
            follow.task.cancel()

    # -- life ------------------------------------------------------------------------------------------
    async def start(self, pool: Upstream) -> None:
        self._pool = pool
        self._context = zmq.asyncio.Context()
        for follow in self._follows.values():
            self._launch(follow)

    async def close(self) -> None:
        tasks = [follow.task for follow in self._follows.values() if follow.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)

    def _launch(self, follow: _Follow) -> None:
        if self._context is not None and follow.task is None:
            follow.task = asyncio.create_task(self._follow(follow), name=f"kv events {follow.inst.url}")

    # -- following one instance ------------------------------------------------------------------------
    async def _follow(self, follow: _Follow) -> None:
        url, wait = follow.inst.url, FIRST_RETRY_S
        while True:
            follow.again.clear()
            sources = await self._ask(follow)
            if not sources:
                await self._pause(follow, RECHECK_S if sources is not None else wait)
                wait = min(wait * 2, RECHECK_S) if sources is None else FIRST_RETRY_S
                continue
            wait = FIRST_RETRY_S
            assert self._context is not None
            feeds = [
                Feed((url, rank), source, self.index, self._context, self.counts) for rank, source in sources.items()
            ]
            tasks = [asyncio.create_task(feed.run(), name=f"kv events {url} rank {feed.engine[1]}") for feed in feeds]
            try:
                while True:
                    woken = await self._pause(follow, self.index.stale_after_s)
                    if failed := [task for task in tasks if task.done()]:
                        log.error("KV events of %s: a feed ended: %r; starting again", url, failed[0].exception())
                        break
                    if woken or any(self.index.state((url, r)) == STALE for r in sources):
                        follow.again.clear()
                        again = await self._ask(follow)
                        if again is not None and again != sources:
                            log.info("KV events of %s: the instance publishes elsewhere now: %s", url, again)
                            break
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _pause(follow: _Follow, seconds: float) -> bool:
        """Waits `seconds`, or less when the instance registers again (True)."""
        try:
            await asyncio.wait_for(follow.again.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _ask(self, follow: _Follow) -> dict[int, Source] | None:
        """Where the instance's engines publish; {} when they publish nothing, None when it
        could not be asked."""
        inst = follow.inst
        if self._given is not None:
            entry = self._given if isinstance(self._given, str) else self._given.get(inst.url)
            follow.sources = given_sources(entry, inst.url, inst.dp_size) if entry else {}
            follow.note = "given by --kv-events-endpoints" if entry else "no --kv-events-endpoints entry"
            return follow.sources
        assert self._pool is not None
        try:
            answer = await self._pool.call(
                inst,
                "GET",
                SOURCES_PATH,
                timeouts=Timeouts(connect=ASK_TIMEOUT_S, total=ASK_TIMEOUT_S),
                stage="kv_event_sources",
                what="KV event sources",
            )
        except NoAnswer as failure:
            follow.note = f"could not ask {SOURCES_PATH}: {failure.reason}"
            return None
        if answer.status == 404:
            follow.sources, follow.note = {}, f"no {SOURCES_PATH} route"
            return follow.sources
        if answer.status != 200:
            follow.note = f"{SOURCES_PATH} answered {answer.status}"
            return None
        try:
            sources = read_sources(inst.url, answer.body)
        except ValueError as exc:
            follow.sources, follow.note = {}, f"{SOURCES_PATH} answered what it cannot mean: {exc}"
            return follow.sources
        if sources != follow.sources:
            log.info("KV events of %s %s: %s", inst.role, inst.url, sources or "none published")
        follow.sources = sources
        follow.note = "" if sources else "publishes no KV events"
        return sources

    # -- reading -------------------------------------------------------------------------------------
    def view(self, url: str) -> dict[str, Any] | None:
        """One instance's engines as /status shows them; None for an instance not followed."""
        follow = self._follows.get(url)
        if follow is None:
            return None
        ranks = sorted(follow.sources or ())
        engines = [
            {
                "rank": rank,
                "state": self.index.state((url, rank)),
                "blocks": self.index.size((url, rank)),
                "complete": self.index.complete((url, rank)),
                "stale_because": self.index.why_stale((url, rank)),
            }
            for rank in ranks
        ]
        states = {engine["state"] for engine in engines}
        state = NONE if not engines or states == {NONE} else FRESH if states == {FRESH} else STALE
        return {"state": state, "blocks": sum(e["blocks"] for e in engines), "note": follow.note, "engines": engines}

    def ranks(self, url: str) -> tuple[int, ...]:
        """The data-parallel ranks of the instance whose events are followed."""
        follow = self._follows.get(url)
        return tuple(follow.sources) if follow is not None and follow.sources else ()

    def urls(self) -> list[str]:
        return list(self._follows)
