"""Identical images in flight at once are encoded once.

An image whose name (held.media_names) another request of this process is encoding right now is
not sent again: its request waits for that encode and takes its answer for the item (metadata,
the engine's identifier and its connector handle) under a transfer id of its own, as if its own
encoder had answered. Coalescing (coalesce.py) puts several requests' images in one sub-request
but sends each of them; this sends an image once.

A request waiting for another's encode lends that request its tenant's standing in the encoder
queue (Trace.riders): the group is sent when the least served of the tenants waiting for it is
due, not at its owner's later turn. A queued group sent so is charged to its owner and, for the
items each waits for, to the tenants it was lifted for: a tenant cannot lift another's work
ahead for free.

Another request's failure never fails this one: when the encode it waited for fails, is
cancelled (its client went away) or reports nothing for the item, the item is encoded by this
request itself. If that encoder had received the media and failed them, the media are not handed
to this request's consumer either (trace.media_failed_on), as if it had failed here.

Not used in Mooncake push mode, where each consumer needs a push of its own under its own
transfer ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.reuse import failed_holding_media
from epd_proxy.journey.trace import Trace

Encode = Callable[[Sequence[MediaItem]], Awaitable[Matches]]


@dataclass(frozen=True, slots=True)
class Share:
    """What one item's encode gives a request that waited for it."""

    metadata: dict[str, Any]
    ec_mm_hash: str
    handle: dict[str, Any] | None


# What a waiting request learns: the share, or why there is none (a failure, or None: the
# encoder reported nothing the proxy could match to the item).
Outcome = Share | BaseException | None


class InFlight:
    """The names this process's requests are encoding now, each with the future its outcome lands in."""

    def __init__(self) -> None:
        # Per name: the future its outcome lands in, and the trace of the request encoding it.
        self._pending: dict[str, tuple[asyncio.Future[Outcome], Trace]] = {}
        # Requests waiting now for another's encode of one of their items.
        self.waiting = 0

    def __len__(self) -> int:
        return len(self._pending)

    async def encode(
        self,
        items: Sequence[MediaItem],
        names: Mapping[int, str],
        encode: Encode,
        transfer_id: Callable[[], str],
        trace: Trace,
    ) -> Matches:
        """The matches of `items`: those in flight elsewhere taken from there, the rest `encode`d."""
        own: list[MediaItem] = []
        joined: list[tuple[MediaItem, asyncio.Future[Outcome]]] = []
        claimed: dict[str, asyncio.Future[Outcome]] = {}
        loop = asyncio.get_running_loop()
        for item in items:
            name = names.get(item.index)
            pending = self._pending.get(name) if name is not None else None
            if pending is not None and name not in claimed:
                future, owner = pending
                joined.append((item, future))
                if trace.tenant is not None and trace.tenant != owner.tenant:
                    owner.riders[trace.tenant] = owner.riders.get(trace.tenant, 0.0) + item.cost
                continue
            own.append(item)  # a repeat within the request goes in its own sub-request
            if name is not None and pending is None:
                claimed[name] = loop.create_future()
                self._pending[name] = (claimed[name], trace)
        self.waiting += bool(joined)
        try:
            try:
                matches = await encode(own) if own else Matches()
            except BaseException as exc:
                self._settle(claimed, dict.fromkeys(claimed, exc))
                raise
            by_name = {names[item.index]: matches.items.get(item.index) for item in own if item.index in names}
            self._settle(claimed, {name: _share(by_name.get(name), matches) for name in claimed})
            again: list[MediaItem] = []
            for item, waited_for in joined:
                # Shielded: this request going away must not cancel the future others wait on too.
                outcome = await asyncio.shield(waited_for)
                if isinstance(outcome, Share):
                    matches.items[item.index] = ItemMatch(outcome.metadata, outcome.ec_mm_hash, transfer_id())
                    if outcome.handle is not None:
                        matches.handles.setdefault(outcome.ec_mm_hash, outcome.handle)
                    continue
                if failed_holding_media(outcome) and trace.media_failed_on is None:
                    trace.media_failed_on = getattr(outcome, "backend", None) or "another request's encoder"
                again.append(item)
            if again:
                alone = await encode(again)
                matches.items.update(alone.items)
                matches.handles.update(alone.handles)
            return matches
        finally:
            self.waiting -= bool(joined)

    def _settle(self, claimed: dict[str, asyncio.Future[Outcome]], outcomes: Mapping[str, Outcome]) -> None:
        for name, future in claimed.items():
            pending = self._pending.get(name)
            if pending is not None and pending[0] is future:
                del self._pending[name]
            if not future.done():
                future.set_result(outcomes[name])


def _share(match: ItemMatch | None, matches: Matches) -> Share | None:
    if match is None or match.ec_mm_hash is None:
        return None
    return Share(match.metadata, match.ec_mm_hash, matches.handles.get(match.ec_mm_hash))
