"""`--roster`: what one proxy replica saw encoded, told to every other replica through the store.

Each process keeps its own record of the media the fleet holds (journey/held.py), and `--workers`
of one port tell each other what they saw encoded (fleet/siblings.py). Replicas on other hosts
share no socket, so a turn that landed on a replica which never saw its history had those images
encoded again once the consumer's prefix was evicted, once per replica per image. The EC store
holds an image for every consumer once any encoder answered for it, whichever replica asked.

Replicas that share a roster share its Redis: each publishes the names it saw encoded on
`<prefix>:encoded` and follows that channel. A message is the sender's id and its names; a
process skips its own. Nothing waits on the store: names are published from a background task,
a store that is down drops them (counted), and a message lost costs at most an encode the record
would otherwise have spared, never an answer. Redis pub/sub delivers while connected only, so a
replica that starts or reconnects learns what is encoded from then on, as a new worker does.
With `--workers` too, a worker also hears its siblings through the store, which told it by
socket already: a name heard twice is remembered once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from epd_proxy.fleet.roster import MAX_BACKOFF_S, STORE_TIMEOUT_S, drop_connections, split_roster_url, store_client
from epd_proxy.fleet.siblings import names_in

log = logging.getLogger("epd_proxy.replicas")

# Names per message, and names waiting to be published at most (the oldest go first).
NAMES_PER_MESSAGE = 1024
PENDING_NAMES = 65536
FIRST_BACKOFF_S = 0.05
# What `count` is told of (epd_replica_names_total{what}).
TOLD, HEARD, DROPPED = "told", "heard", "dropped"
# Seconds the channel may be quiet before the listener pings the store; a second quiet spell
# without even the pong means the store is unreachable (a partition does not close the socket).
QUIET_S = 5.0


def encoded_message(sender: bytes, names: list[str]) -> bytes:
    """One message on the channel: the sender's id, then its names, a line each."""
    return sender + b"\n" + "\n".join(names).encode()


def names_from(data: object, me: bytes) -> list[str]:
    """The names in a message from another process; none from this one (`me`), and nothing but
    names of the proxy's own form from anyone."""
    if not isinstance(data, bytes):
        return []
    sender, _, body = data.partition(b"\n")
    return [] if sender == me else names_in(body)


class ReplicaChannel:
    """This process's voice and ear on the store's `<prefix>:encoded` channel."""

    def __init__(
        self,
        roster_url: str,
        on_heard: Callable[[list[str]], None],
        count: Callable[[str, int], None] = lambda what, n: None,
    ) -> None:
        """`on_heard`: handed each name another replica tells; `count(what, n)`: names `told`,
        `heard` and `dropped` (never sent: the store was unreachable, or too many waited)."""
        client_url, prefix = split_roster_url(roster_url)
        self.channel = f"{prefix}:encoded"
        self.sender = os.urandom(8).hex().encode()
        self._on_heard = on_heard
        self._count = count
        self._client = store_client(client_url)
        self._pending: deque[str] = deque(maxlen=PENDING_NAMES)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._subscribed = asyncio.Event()
        self._closed = False

    async def start(self) -> None:
        """Follow the channel in the background; wait briefly until the subscription is sent, so
        a fresh process hears what the others encode from its first request on (it starts anyway
        when the store is down)."""
        self._tasks = [
            asyncio.create_task(self._forever(self._publish, "tell"), name="replicas-tell"),
            asyncio.create_task(self._forever(self._listen, "hear"), name="replicas-hear"),
        ]
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                await self._subscribed.wait()
        except TimeoutError:
            log.warning(
                "replicas: the store is not reachable at startup; what other replicas encode is heard once it is"
            )

    def tell(self, names: Iterable[str]) -> None:
        """Queue `names` for the other replicas; never waits."""
        before = len(self._pending)
        batch = list(names)
        self._pending.extend(batch)
        if (overflow := before + len(batch) - PENDING_NAMES) > 0:
            self._count(DROPPED, overflow)
        self._wake.set()

    async def _forever(self, step: Callable[[], Awaitable[None]], what: str) -> None:
        """Run `step` again whenever it ends or fails, backing off while the store stays away: a
        step that ran for a while before failing was connected, so the next try is at once."""
        delay, failing = FIRST_BACKOFF_S, False
        while not self._closed:
            began = time.monotonic()
            try:
                await step()
            except Exception as exc:
                if time.monotonic() - began > QUIET_S:
                    delay = FIRST_BACKOFF_S
                if not failing:
                    log.warning(
                        "replicas: cannot %s through the store (%s: %s); retrying", what, type(exc).__name__, exc
                    )
                failing = True
                await drop_connections(self._client)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            if failing:
                log.info("replicas: the store is back to %s through", what)
            delay, failing = FIRST_BACKOFF_S, False

    async def _publish(self) -> None:
        await self._wake.wait()
        self._wake.clear()
        while self._pending:
            size = min(len(self._pending), NAMES_PER_MESSAGE)
            names = [self._pending.popleft() for _ in range(size)]
            try:
                await self._client.publish(self.channel, encoded_message(self.sender, names))
            except Exception:
                # The store is away, for how long nobody knows: drop what waits rather than hold it.
                self._count(DROPPED, size + len(self._pending))
                self._pending.clear()
                raise
            self._count(TOLD, size)

    async def _listen(self) -> None:
        async with self._client.pubsub() as pubsub:
            await pubsub.subscribe(self.channel)
            self._subscribed.set()
            pinged = False
            while True:
                received = await pubsub.get_message(ignore_subscribe_messages=True, timeout=QUIET_S)
                if received is None:
                    if pinged:
                        raise ConnectionError(f"no answer from the store for {2 * QUIET_S:g} s")
                    await pubsub.ping()
                    pinged = True
                    continue
                pinged = False  # anything heard, the pong included, proves the store is there
                names = names_from(received.get("data"), self.sender)
                if not names:
                    continue
                try:
                    self._on_heard(names)
                except Exception:
                    log.exception("replicas: taking the names another replica told failed")
                    continue
                self._count(HEARD, len(names))

    async def close(self) -> None:
        self._closed = True
        # Repeated until the tasks end: redis-py can swallow a cancellation (see roster.close).
        while any(not task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            await asyncio.wait(self._tasks, timeout=1.0)
        await self._client.aclose()
