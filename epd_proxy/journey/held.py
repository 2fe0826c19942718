"""What this process saw the fleet hold: the record reuse decides from (reuse.plan_encode, pure).

The guess it replaces read the request's shape ("an image before the last assistant message was
sent before"), which a client writes: a first request continued from an assistant message of its
own, or a tenant faking a history on purpose, had every image sent raw and encoded by the shared
consumer instead of the encoders. Now an image counts as held only when this process saw it:

- **encoded**: an encoder answered for it, so the EC store holds it under its name, for every
  consumer (`HeldMedia.encoded`);
- **sent to a consumer**: that consumer (prefill in E+P+D, else the PD) processed it, loaded or
  encoded itself, so its prefix and encoder caches hold it; for that consumer only
  (`HeldMedia.sent`).

A name is the proxy's own (`media_names`): the item's content digest (extract.py drops every
client uuid and names the media itself), and with it what vLLM folds into the identifier it stores
an embedding under (the model, the processor and media kwargs) and whether the consumer names the
item by the proxy's uuid or by its content (an Anthropic image). No client value can make an
image count as held: only the proxy's own sight of that content under those options does.

Wrong either way costs work, never a failure: an image taken as held goes raw under its name,
and vLLM's scheduler (`_try_schedule_encoder_inputs`) skips it inside the cached prefix, loads it
where the EC connector has it (`has_cache_item`), and only otherwise encodes it itself. The EC
store's own evictions are invisible here, so an entry is forgotten `HELD_TTL_S` after the proxy
last saw it encoded or sent (and when `HELD_ITEMS` newer ones push it out): a popular image is
encoded again once per that period, which also writes it back to the store.

Each process keeps its own record, and tells the others what it saw encoded: the `--workers` of
its port (fleet/siblings.py) and, with `--roster`, the replicas sharing that store
(fleet/replicas.py). What it saw sent stays its own, since the consumers' KV events say the same
to every process. Replicas without a shared store share nothing of it: a turn that lands on a
replica which never saw its history has those images encoded again, once per replica per image.

**The engines' own state comes first** where the consumer's KV events are fresh (`decide_held`):
an image inside a prefix the consumer holds is held though this process never saw it (a fresh
proxy, another worker or replica), and an image the record knows only as sent there, which the
consumer no longer holds (evicted, restarted), is encoded again: the EC store may not have it.
An image seen encoded stays held, since the EC store has it whatever the consumer evicted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.fleet.kv_names import media_key
from epd_proxy.fleet.recall import Recall
from epd_proxy.journey.extract import MediaItem

# A name and its time are ~200 bytes: 65536 of each kind is ~25 MB per process at most.
HELD_ITEMS = 65536
HELD_TTL_S = 1800.0
# What vLLM folds into an item's identifier besides its name (ProcessorInputs.get_mm_hashes).
_IDENTIFIER_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


def media_names(body: dict[str, Any], items: Sequence[MediaItem]) -> dict[int, str] | None:
    """Each item's name, by its index: what the EC store and the consumers' caches hold it under,
    as the proxy names it. None when the options cannot be written (they nest too deeply: the
    request is refused further on)."""
    try:
        scope = orjson.dumps([body.get("model"), [body.get(name) for name in _IDENTIFIER_FIELDS]])
    except orjson.JSONEncodeError:
        return None
    return {
        item.index: hashlib.blake2b(b"%s\0%d\0%s" % (scope, item.named, item.uuid.encode()), digest_size=16).hexdigest()
        for item in items
    }


def index_uuids(
    body: dict[str, Any], items: Sequence[MediaItem], adapter_for: Callable[[object], str | None] | None = None
) -> dict[int, str]:
    """The images whose blocks the consumer's KV events name by the proxy's uuid, by index, as
    the KV index names them: in the blocks of the LoRA adapter the request's `model` names, if
    `adapter_for` (kv_holds.adapter) says it names one (kv_names.media_key). vLLM names an item by
    the uuid it was sent only when no processing option is folded in, and an item the consumer
    names by its content (an Anthropic image) has no uuid there."""
    if any(body.get(name) for name in _IDENTIFIER_FIELDS):
        return {}
    adapter = adapter_for(body.get("model")) if adapter_for is not None else None
    return {item.index: media_key(item.uuid, adapter) for item in items if item.is_image and item.named and item.uuid}


@dataclass(frozen=True, slots=True)
class Holding:
    """What the consumer holds of a request's images, and what decided it (for the metrics)."""

    held: frozenset[int]
    # Held as the KV index says (fresh), and as the record alone says.
    by_index: int = 0
    by_record: int = 0
    # Known to the record as sent to the consumer only, and gone from it as the index says.
    lost: int = 0


def decide_held(
    images: Iterable[int], encoded: Collection[int], sent: Collection[int], depth: Mapping[int, int | None]
) -> Holding:
    """Which images the consumer takes without an encoder (pure). `encoded` and `sent`: what the
    record saw; `depth`: the consumer's KV index per image (kv_holds: > 0 held, 0 not, None
    cannot say). Held: inside a prefix the consumer holds, or seen encoded (the EC store), or
    seen sent there while the index cannot say otherwise."""
    held: set[int] = set()
    by_index = by_record = lost = 0
    for i in images:
        known = depth.get(i)
        if known:
            held.add(i)
            by_index += 1
        elif i in encoded or (i in sent and known is None):
            held.add(i)
            by_record += 1
        elif i in sent:
            lost += 1
    return Holding(frozenset(held), by_index, by_record, lost)


@dataclass(frozen=True, slots=True)
class Known:
    """One request's media as this process knows them: their names (None: no names, nothing
    recorded or shared), and which of them the fleet held when the request began. Taken once per
    request: a retry after a consumer's 500 encodes again what its first attempt encoded, since
    that 500 may mean an embedding never reached the store."""

    names: Mapping[int, str] | None = None
    held: frozenset[int] = frozenset()


# How long after a send the KV index must have caught up with the consumer before its "not held"
# overrules the send: the consumer publishes a prompt's blocks about when it answers the first
# token, and a batch can reach the proxy later than one the engine published before it reached
# this one. Sooner, an eviction or restart costs the consumer an encode of its own, never a wrong
# answer.
INDEX_CATCH_UP_S = 2.0


class HeldMedia:
    """The names the fleet holds as far as this process saw: encoded (the EC store, every
    consumer) and sent (one consumer's own caches), each bounded and ageing (fleet/recall.py)."""

    def __init__(
        self, capacity: int = HELD_ITEMS, ttl_s: float = HELD_TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._encoded: Recall[str, bool] = Recall(capacity, ttl_s, clock)
        # When each was sent: the KV index may contradict a send only once it caught up since.
        self._sent: Recall[tuple[str, str], float] = Recall(capacity, ttl_s, clock)
        self._clock = clock
        # Told of each name seen encoded here: the sibling workers (fleet/siblings.py), the other
        # replicas (fleet/replicas.py).
        self.tell_encoded: list[Callable[[list[str]], None]] = []

    def encoded(self, names: Iterable[str]) -> None:
        seen = list(names)
        self._remember_encoded(seen)
        if seen:
            for tell in self.tell_encoded:
                tell(seen)

    def encoded_elsewhere(self, names: Iterable[str]) -> None:
        """Names another process saw encoded: the EC store holds them for this one too."""
        self._remember_encoded(names)

    def encoded_earlier(self, aged: Iterable[tuple[str, float]]) -> None:
        """Names another process saw encoded, each that many seconds ago (its record, replayed to
        a worker that started after it): they age here from when they were seen."""
        for name, age_s in aged:
            self._encoded.put(name, True, age_s)

    def encoded_record(self) -> list[tuple[str, float]]:
        """The names this process holds as encoded, and how long ago each was seen."""
        return self._encoded.ages()

    def _remember_encoded(self, names: Iterable[str]) -> None:
        for name in names:
            self._encoded.put(name, True)

    def sent(self, consumer: str, names: Iterable[str]) -> None:
        now = self._clock()
        for name in names:
            self._sent.put((consumer, name), now)

    def held(
        self,
        items: Sequence[MediaItem],
        names: Mapping[int, str],
        consumer: str,
        depth: Mapping[int, int | None] | None = None,
        heard_at: float | None = None,
    ) -> Holding:
        """What of `items` the consumer can take without an encoder (`decide_held`), `depth` the
        KV index's answers, up to date since `heard_at` (this record's clock): images only (audio
        and video are encoded again: their decode on the consumer costs what a repeat encode does)."""
        images = [item.index for item in items if item.is_image]
        encoded = {i for i in images if names[i] in self._encoded}
        sent_at = {i: self._sent.get((consumer, names[i])) for i in images}
        sent = {i for i, at in sent_at.items() if at is not None}
        depth = dict(depth or {})
        for i in sent:
            at = sent_at[i]
            if at is not None and not depth.get(i) and (heard_at is None or heard_at < at + INDEX_CATCH_UP_S):
                # The index has not caught up with the consumer since the send (the next turn
                # often comes before its events): its "not held" means "not heard yet".
                depth[i] = None
        return decide_held(images, encoded, sent, depth)
