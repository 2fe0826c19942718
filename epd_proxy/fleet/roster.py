"""A dynamic roster shared by every proxy process (replicas and `--workers`), kept in Redis.

The store holds membership only: one key per instance, `<prefix>:instance:<url>`, whose value is
the registration record and whose TTL is `--evicted-ttl`. Each process renews the TTL of the
instances it currently has in rotation, so a record disappears once no process has seen its
instance healthy for that long, and at once when it is deleted. Health, cursors and in-flight
counts stay local to each process.

Writers publish on `<prefix>:changes` after every change; a message only says "something
changed", and the reader then reads the whole roster, so lost or reordered messages cannot leave a
process wrong for longer than the periodic resync (which also notices TTL expiry). Conflicting
registrations through two processes at once are serialised by an optimistic transaction on
`<prefix>:version`.

When the store is unreachable, every process keeps routing on the roster it last read, reports
the store as down, refuses changes with 503, and reads everything afresh once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson

from epd_proxy.config import ConfigError
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.registry import Record, Registry, check_fits

log = logging.getLogger("epd_proxy.roster")

SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PREFIX = "epd"
# Seconds between lease renewals and full reads; shorter when the TTL is short.
RESYNC_S = 5.0
# A store call that takes longer than this counts as the store being down.
STORE_TIMEOUT_S = 2.0
MAX_BACKOFF_S = 2.0


class RosterUnavailable(ProxyError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message, stage="registry", error_type="roster_unavailable")


class Roster(Protocol):
    """What the app needs from a shared roster; Redis is the one implementation. It feeds the
    registry through the `on_change` callback it is built with (Registry.sync)."""

    @property
    def up(self) -> bool: ...

    def seconds_since_sync(self) -> float | None: ...

    def status(self) -> dict: ...

    async def start(self) -> None: ...

    async def add(self, record: Record) -> bool: ...

    async def remove(self, url: str) -> bool: ...

    async def close(self) -> None: ...


def split_roster_url(url: str) -> tuple[str, str]:
    """(client URL, key prefix): the `prefix` query parameter is ours, the rest is redis-py's."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"--roster must be a redis://, rediss:// or unix:// URL, got {url!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = next((v for k, v in query if k == "prefix"), DEFAULT_PREFIX) or DEFAULT_PREFIX
    rest = urlencode([(k, v) for k, v in query if k != "prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


def store_client(client_url: str):
    """A client of the store with no retries of its own: a failure must surface at once (for the
    roster, as "store down" and as a 503)."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(
        client_url,
        socket_timeout=STORE_TIMEOUT_S,
        socket_connect_timeout=STORE_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )


async def drop_connections(client) -> None:
    """Pooled connections to a store that went away would fail once each after it is back
    (redis-py does not notice the server's close while they sit idle): drop them all."""
    try:
        await client.connection_pool.disconnect()
    except Exception:  # closing what is already broken may fail too
        log.debug("closing the store connections failed", exc_info=True)


def redacted(url: str) -> str:
    """The store URL without its password, for /health and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def encode_record(record: Record) -> bytes:
    fields = {"url": record.url, "role": record.role, "ec_zmq_addrs": record.zmq_addrs, "dp_size": record.dp_size}
    return orjson.dumps({**fields, "seq": record.seq, "gen": record.gen})


def decode_record(raw: bytes) -> Record | None:
    try:
        data = orjson.loads(raw)
        zmq_addrs, dp_size, seq, gen = (
            tuple(data["ec_zmq_addrs"]),
            int(data["dp_size"]),
            int(data["seq"]),
            int(data["gen"]),
        )
        return Record(data["url"], data["role"], zmq_addrs, dp_size, seq, gen)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        log.warning("roster: ignoring a malformed record %r", raw[:200])
        return None


class RedisRoster:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: float,
        on_change: Callable[[Mapping[str, Record]], None],
        in_rotation: Callable[[], Iterable[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        client_url, self.prefix = split_roster_url(url)
        self.url = redacted(url)
        self.ttl_ms = int(ttl_s * 1000) if ttl_s > 0 else None
        self.interval_s = min(RESYNC_S, ttl_s / 4) if ttl_s > 0 else RESYNC_S
        self._on_change = on_change
        self._in_rotation = in_rotation
        self._clock = clock
        self._client = store_client(client_url)
        self._channel = f"{self.prefix}:changes"
        self._version_key = f"{self.prefix}:version"
        self._key_prefix = f"{self.prefix}:instance:"
        self._up = False
        self._error = "not connected yet"
        self._last_sync: float | None = None
        self._last: dict[str, Record] = {}
        self._synced = asyncio.Event()
        self._resync_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._closed = False

    # -- state ---------------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self._up

    def seconds_since_sync(self) -> float | None:
        return None if self._last_sync is None else self._clock() - self._last_sync

    def status(self) -> dict[str, Any]:
        since = self.seconds_since_sync()
        out: dict[str, Any] = {"store": self.url, "status": "up" if self._up else "down"}
        out["seconds_since_sync"] = None if since is None else round(since, 3)
        if not self._up:
            out["error"] = self._error
        return out

    def _mark_down(self, exc: BaseException) -> None:
        self._error = f"{type(exc).__name__}: {exc}"
        if self._up:
            log.warning("roster store %s is down (%s); routing on the last roster read", self.url, self._error)
        self._up = False

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self, first_sync_timeout_s: float = STORE_TIMEOUT_S) -> None:
        """Follow the store in the background; wait briefly for a first read so a fresh process
        starts with the roster, but start anyway when the store is down."""
        self._task = asyncio.create_task(self._follow_forever(), name="roster")
        try:
            async with asyncio.timeout(first_sync_timeout_s):
                await self._synced.wait()
        except TimeoutError:
            log.warning("roster store %s not reachable at startup (%s); retrying", self.url, self._error)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            # redis-py can swallow a cancellation that lands on its read timeout's edge (its
            # issue #2551); the loops also stop on `_closed`, and the cancel is repeated until the
            # task has ended, so closing never hangs.
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            if not self._task.cancelled():
                self._task.exception()  # retrieved: a failure while closing is not news
        await self._client.aclose()

    # -- reading -------------------------------------------------------------------------------------
    async def _read(self, client) -> dict[str, Record]:
        keys = [key async for key in client.scan_iter(match=_glob_escape(self._key_prefix) + "*", count=1000)]
        values = await client.mget(keys) if keys else []
        records = (decode_record(raw) for raw in values if raw is not None)  # None: expired meanwhile
        return {r.url: r for r in records if r is not None}

    async def resync(self) -> None:
        # One read at a time, so an older read never lands after a newer one (a registration's own
        # read must not be undone by the follower's read that started before it).
        async with self._resync_lock:
            records = await self._read(self._client)
            if not records and self._last:
                await self._reseed_if_wiped()
                records = await self._read(self._client)  # ours, or what a faster process put back
            self._on_change(records)
            self._last = records
        self._last_sync = self._clock()
        if not self._up:
            log.info("roster store %s is up: %d instances", self.url, len(records))
        self._up = True
        self._synced.set()

    async def _renew_leases(self) -> None:
        """Keep alive the records of instances this process has in rotation. PEXPIRE never
        recreates a deleted key, so a renewal cannot resurrect an unregistered instance."""
        if self.ttl_ms is None:
            return
        urls = list(self._in_rotation())
        if not urls:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for url in urls:
                pipe.pexpire(self._key_prefix + url, self.ttl_ms)
            await pipe.execute()

    async def _follow_forever(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                await self._follow()
            except Exception as exc:  # any store failure: keep routing, retry
                was_up = self._up
                self._mark_down(exc)
                await drop_connections(self._client)
                delay = 0.05 if was_up else min(delay * 2, MAX_BACKOFF_S)
            await asyncio.sleep(delay)

    async def _follow(self) -> None:
        async with self._client.pubsub() as pubsub:
            # Subscribe before reading, so a change made in between is not missed.
            await pubsub.subscribe(self._channel)
            await self.resync()
            next_round = self._clock() + self.interval_s
            while not self._closed:
                wait = max(0.0, next_round - self._clock())
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                if message is not None:
                    # One read covers a burst of changes.
                    while await pubsub.get_message(ignore_subscribe_messages=True, timeout=0) is not None:
                        pass
                    await self.resync()
                if self._clock() >= next_round:
                    await self._renew_leases()
                    await self.resync()
                    next_round = self._clock() + self.interval_s

    async def _reseed_if_wiped(self) -> bool:
        """A store that lost its data (restarted without persistence, flushed) has no version key:
        writers create it and nothing deletes it. Put back the roster this process last read, so
        losing the store's data does not empty the fleet. A roster emptied by unregistering keeps
        its version key and stays empty. True if this process put it back."""
        from redis.exceptions import WatchError

        async with self._client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(self._version_key)
                if await pipe.exists(self._version_key):
                    return False
                pipe.multi()
                for record in self._last.values():
                    pipe.set(self._key_prefix + record.url, encode_record(record), px=self.ttl_ms, nx=True)
                pipe.incr(self._version_key)
                pipe.publish(self._channel, "reseed")
                await pipe.execute()
            except WatchError:
                return False  # another process put its roster back first
        log.warning("roster store %s had lost its data; restored the %d instances last read", self.url, len(self._last))
        return True

    # -- writing -------------------------------------------------------------------------------------
    def _refuse(self, exc: BaseException | None = None) -> RosterUnavailable:
        if exc is not None:
            self._mark_down(exc)
        return RosterUnavailable(
            f"the shared roster store ({self.url}) is unreachable ({self._error}); "
            "the fleet cannot change until it is back, traffic keeps flowing on the last roster"
        )

    async def add(self, record: Record) -> bool:
        """Store a registration; True if the URL is new. 409 as for a local registry."""
        from redis.exceptions import RedisError, WatchError

        if not self._up:
            raise self._refuse()
        key = self._key_prefix + record.url
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(self._version_key)
                        current = await self._read(pipe)
                        check_fits(record, current)
                        existing = current.get(record.url)
                        version = int(await pipe.get(self._version_key) or 0)
                        # The transaction makes version + 1 this write's own number.
                        seq = existing.seq if existing is not None else version + 1
                        pipe.multi()
                        stored = Record(record.url, record.role, record.zmq_addrs, record.dp_size, seq, version + 1)
                        # Re-registering renews the lease, as it did with a local registry.
                        pipe.set(key, encode_record(stored), px=self.ttl_ms)
                        pipe.incr(self._version_key)
                        pipe.publish(self._channel, record.url)
                        await pipe.execute()
                        break
                    except WatchError:
                        continue  # someone else changed the roster meanwhile: check again
            await self.resync()
        except (RedisError, OSError) as exc:
            await drop_connections(self._client)
            raise self._refuse(exc) from None
        log.info("roster: stored %s as %s", record.url, record.role)
        return existing is None

    async def remove(self, url: str) -> bool:
        from redis.exceptions import RedisError

        if not self._up:
            raise self._refuse()
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._key_prefix + url)
                pipe.incr(self._version_key)
                pipe.publish(self._channel, url)
                deleted, _, _ = await pipe.execute()
            await self.resync()
        except (RedisError, OSError) as exc:
            await drop_connections(self._client)
            raise self._refuse(exc) from None
        return bool(deleted)


def require_client() -> None:
    try:
        import redis.asyncio  # noqa: F401
    except ImportError:
        raise ConfigError("--roster needs the Redis client: pip install 'epd-proxy[roster]'") from None


def open_roster(
    roster_url: str, ttl_s: float, registry: Registry, in_rotation: Callable[[Instance], bool]
) -> Roster | None:
    """The shared roster at `roster_url` (--roster), feeding `registry`; None for an in-process
    one. `in_rotation` is this process's health verdict: only what it can route to gets renewed."""
    if not roster_url:
        return None
    require_client()
    return RedisRoster(
        roster_url,
        ttl_s=ttl_s,
        on_change=registry.sync,
        in_rotation=lambda: [inst.url for inst in registry.registered() if in_rotation(inst)],
    )
