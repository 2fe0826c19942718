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
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from epd_proxy.fleet.roster import STORE_TIMEOUT_S, split_roster_url, store_client
from epd_proxy.fleet.siblings import names_in

log = logging.getLogger("epd_proxy.replicas")

# Names per message, and names waiting to be published at most (the oldest go first).
NAMES_PER_MESSAGE = 1024
PENDING_NAMES = 65536
MAX_BACKOFF_S = 2.0
# What `count` is told of (epd_replica_names_total{what}).
TOLD, HEARD, DROPPED = "told", "heard", "dropped"
# Seconds the channel may be quiet before the listener checks the store is still there.
QUIET_S = 5.0


def message(sender: bytes, names: list[str]) -> bytes:
    """One message on the channel: the sender's id, then its names, a line each."""
    return sender + b"\n" + "\n".join(names).encode()


def heard(data: object, me: bytes) -> list[str]:
    """The names in a message from another process; none from this one (`me`), and nothing but
    names of the proxy's own form from anyone."""
    if not isinstance(data, bytes):
        return []
    sender, _, body = data.partition(b"\n")
    return [] if sender == me else names_in(body)


class ReplicaRecord:
    """This process's voice and ear on the store's `<prefix>:encoded` channel."""

    def __init__(
        self,
        roster_url: str,
        on_heard: Callable[[list[str]], None],
        count: Callable[[str, int], None] = lambda what, n: None,
    ) -> None:
        """`on_heard`: handed each name another replica tells; `count(what, n)`: names `told`, `heard`
        and `dropped` (never sent: the store was down or far behind)."""
        client_url, prefix = split_roster_url(roster_url)
        self.channel = f"{prefix}:encoded"
        self.sender = os.urandom(8).hex().encode()
        self._heard = on_heard
        self._count = count
        self._client = store_client(client_url)
        self._pending: deque[str] = deque(maxlen=PENDING_NAMES)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        """Follow the channel in the background; wait briefly for the subscription, so a fresh
        process hears what the others encode from its first request on (it starts anyway when the
        store is down)."""
        self._tasks = [
            asyncio.create_task(self._forever(self._publish), name="replicas-tell"),
            asyncio.create_task(self._forever(self._listen), name="replicas-hear"),
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

    async def _forever(self, step: Callable[[], Awaitable[None]]) -> None:
        delay = 0.05
        while True:
            try:
                await step()
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store down or gone: retry, less often while it stays so
                log.debug("replicas: the store failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    async def _publish(self) -> None:
        await self._wake.wait()
        self._wake.clear()
        while self._pending:
            count = min(len(self._pending), NAMES_PER_MESSAGE)
            names = [self._pending.popleft() for _ in range(count)]
            try:
                await self._client.publish(self.channel, message(self.sender, names))
            except Exception:
                # The store is away, for how long nobody knows: drop what waits rather than hold it.
                self._count(DROPPED, count + len(self._pending))
                self._pending.clear()
                raise
            self._count(TOLD, count)

    async def _listen(self) -> None:
        async with self._client.pubsub() as pubsub:
            await pubsub.subscribe(self.channel)
            self._subscribed.set()
            while True:
                received = await pubsub.get_message(ignore_subscribe_messages=True, timeout=QUIET_S)
                if received is None:
                    await pubsub.ping()  # a store gone quiet for good fails here, and is joined again
                    continue
                names = heard(received.get("data"), self.sender)
                if names:
                    self._count(HEARD, len(names))
                    self._heard(names)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STORE_TIMEOUT_S)
        await self._client.aclose()
