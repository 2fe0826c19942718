"""What each language-model engine holds in its prefix cache, as its KV events say (pure).

An engine is one data-parallel rank of a prefill, decode or PD instance: `(url, rank)`. The feeds
(kv_events.py) apply each engine's event batches in order; routing asks the queries below.

**Our own block names** (kv_names.py): a block's name stands for its whole prefix, the same on
every engine whatever its hash seed; the engine's hash only maps to our name. A block whose parent
is not known (missed, or evicted here) is not indexed. A media item is named with the LoRA adapter
whose blocks hold it, as the events' `lora_name` says, and the adapters are learnt so (`adapter`).

**State.** An engine is `fresh` while its feed heard from it within `stale_after_s` with no
trouble since, `stale` otherwise, `none` when nothing feeds it. Queries about an engine that is
not fresh answer None: the caller falls back to its own guess.

**Bounded.** At most `max_blocks` entries over all engines; beyond it the oldest stored (or
reused) go first, in one sweep down to 15/16 of the cap (a dictionary scanned from its front once
per sweep). An evicted entry only makes the index say an engine holds less than it does.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from epd_proxy.fleet.kv_names import block_name, media_in, valid_name
from epd_proxy.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

log = logging.getLogger("epd_proxy.kv_index")

FRESH, STALE, NONE = "fresh", "stale", "none"
CHAINS_PER_MEDIA = 32
WHOLE_MEMO = 4096  # blocks an engine's `whole` memo keeps before it starts again
MAX_ADAPTERS = 4096
EngineId = tuple[str, int]  # (instance URL, data-parallel rank)
# (medium, KV cache group, the engine's block hash): what the engine's events name a block by.
_Key = tuple[str | None, int, int | bytes]


@dataclass(slots=True, eq=False)
class _Held:
    parent: bytes | None
    media: tuple[str, ...]
    # Its place on its chain, 1 for a prompt's first block: a name stands for its whole prefix.
    depth: int
    # Engine entries naming this block: one per KV cache group and medium that stores it.
    refs: int = 0
    # Media items known to end in this block: a stored child of it does not hold them.
    closes: tuple[str, ...] = ()


@dataclass(slots=True, eq=False)
class _Engine:
    engine: EngineId
    # Oldest first (a reuse moves an entry to the end): our name and the stamp of its store.
    entries: dict[_Key, tuple[bytes, int]] = field(default_factory=dict)
    held: dict[bytes, _Held] = field(default_factory=dict)
    # Per media id the blocks holding it, oldest first (a dict kept as an ordered set).
    media: dict[str, dict[bytes, None]] = field(default_factory=dict)
    heard_at: float | None = None
    trouble: str | None = None
    # Whether the view covers the engine's whole history: it was built from the engine's first
    # batch on (or from a clear), with nothing lost since.
    complete: bool = False
    # Tokens per block, as its last stored batch said (0: none stored yet).
    block_size: int = 0
    # `media_prefixes` answers since the engine last stored or removed a block: a popular image
    # is held by every engine, and each request would walk its chains on each.
    answers: dict[str, int] = field(default_factory=dict)
    # Blocks found held with every block above them, since the engine last dropped a block: most
    # prompts share their first blocks (a preamble), and every request asks every engine.
    whole: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class Applied:
    """What one call of `apply` did, for the feed's counters."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    # Blocks stored under a parent the index does not know: not indexed.
    orphans: int = 0
    evicted: int = 0


class KvIndex:
    def __init__(
        self, *, max_blocks: int = 250_000, stale_after_s: float = 15.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_blocks = max_blocks
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._engines: dict[EngineId, _Engine] = {}
        # Per media id the engines holding some block of it: most engines hold none of a
        # request's images, and a fleet of many must not be asked one by one (`holders`).
        self._holders: dict[str, dict[EngineId, None]] = {}
        # The LoRA adapters whose blocks were stored, oldest first: a request naming one asks for
        # its media in that adapter's blocks.
        self._adapters: dict[str, None] = {}
        self._stamps = itertools.count()
        self.blocks = 0  # entries over all engines
        self.evictions = 0

    # -- the feeds' side -------------------------------------------------------------------------------
    def watch(self, engine: EngineId) -> object:
        """A feed for `engine` begins: its view starts empty and stale until it is heard from.
        Returns the feed's token for `forget`."""
        self.forget(engine)
        record = self._engines[engine] = _Engine(engine)
        return record

    def forget(self, engine: EngineId, token: object | None = None) -> None:
        """The engine is followed no more; with a token, only if no newer feed took it over."""
        record = self._engines.get(engine)
        if record is not None and (token is None or token is record):
            del self._engines[engine]
            self.blocks -= len(record.entries)
            self._let_go(record)

    def reset(self, engine: EngineId, *, complete: bool) -> None:
        """The view starts empty: the engine restarted or cleared its cache (`complete`: what
        follows is its whole history), or batches were lost and what follows is only part of it."""
        record = self._engines.get(engine)
        if record is not None:
            self.blocks -= len(record.entries)
            self._let_go(record)
            record.entries, record.held, record.media, record.answers = {}, {}, {}, {}
            record.whole = set()
            record.complete = complete

    def _let_go(self, record: _Engine) -> None:
        """The engine holds none of its media any more."""
        for media_id in record.media:
            self._drop_holder(media_id, record.engine)

    def _drop_holder(self, media_id: str, engine: EngineId) -> None:
        engines = self._holders.get(media_id)
        if engines is not None:
            engines.pop(engine, None)
            if not engines:
                del self._holders[media_id]

    def heard(self, engine: EngineId) -> None:
        """Its feed is up to date with the engine now: a batch in order, or a replay that found
        nothing missing."""
        record = self._engines.get(engine)
        if record is None:
            return
        if record.trouble is not None:
            log.info("KV events of %s rank %d are fresh again (were stale: %s)", *engine, record.trouble)
            record.trouble = None
        record.heard_at = self._clock()

    def heard_at(self, engine: EngineId) -> float | None:
        """When its feed last caught up with the engine (this index's clock), None if never."""
        record = self._engines.get(engine)
        return record.heard_at if record is not None else None

    def stale(self, engine: EngineId, why: str) -> bool:
        """Its feed cannot vouch for the view until it is heard from again; True if it was fresh."""
        record = self._engines.get(engine)
        if record is None:
            return False
        was_fresh = record.trouble is None and not self._silent(record)
        if record.trouble is None:
            log.warning(
                "KV events of %s rank %d are stale (%s): routing falls back to its own guess for it", *engine, why
            )
        record.trouble = why
        return was_fresh

    def apply(self, engine: EngineId, events: Iterable[Event]) -> Applied:
        done = Applied()
        record = self._engines.get(engine)
        if record is None:
            return done
        for event in events:
            if type(event) is BlockStored:
                self._store(record, event, done)
            elif type(event) is BlockRemoved:
                group = event.group_idx or 0
                for block_hash in event.block_hashes:
                    entry = record.entries.pop((event.medium, group, block_hash), None)
                    if entry is not None:
                        self.blocks -= 1
                        self._release(record, entry[0])
                        done.removed += 1
            elif type(event) is AllBlocksCleared:
                self.reset(engine, complete=True)
                done.cleared += 1
        if self.blocks > self.max_blocks:
            done.evicted = self._evict(self.blocks - self.max_blocks + self.max_blocks // 16)
        return done

    def _store(self, record: _Engine, event: BlockStored, done: Applied) -> None:
        medium, group, size = event.medium, event.group_idx or 0, event.block_size
        entries, held = record.entries, record.held
        record.answers.clear()
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            entry = entries.get((medium, group, event.parent_block_hash))
            if entry is None:
                done.orphans += len(event.block_hashes)
                return
            parent = entry[0]
        tokens, extras = event.token_ids, event.extra_keys or ()
        if size <= 0 or len(tokens) < size * len(event.block_hashes):
            done.orphans += len(event.block_hashes)
            return
        record.block_size = size
        adapter = event.lora_name
        if adapter is not None and valid_name(adapter):
            # Newest last, the oldest forgotten past the cap: adapters come and go at runtime.
            self._adapters.pop(adapter, None)
            self._adapters[adapter] = None
            if len(self._adapters) > MAX_ADAPTERS:
                del self._adapters[next(iter(self._adapters))]
        for i, block_hash in enumerate(event.block_hashes):
            extra = extras[i] if i < len(extras) else None
            name = block_name(parent, tokens[i * size : (i + 1) * size], extra)
            key = (medium, group, block_hash)
            old = entries.pop(key, None)
            if old is None:
                self.blocks += 1
            elif old[0] != name:
                self._release(record, old[0])
            if old is None or old[0] != name:
                block = held.get(name)
                if block is None:
                    depth = held[parent].depth + 1 if parent is not None else 1
                    block = held[name] = _Held(parent, media_in(extra, adapter), depth)
                    for media_id in block.media:
                        blocks = record.media.get(media_id)
                        if blocks is None:
                            blocks = record.media[media_id] = {}
                            self._holders.setdefault(media_id, {})[record.engine] = None
                        blocks[name] = None
                block.refs += 1
            entries[key] = (name, next(self._stamps))
            if parent is not None and (above := held.get(parent)) is not None and above.media:
                ended = [m for m in above.media if m not in held[name].media and m not in above.closes]
                if ended:
                    above.closes += tuple(ended)
            parent = name
            done.stored += 1

    def _release(self, record: _Engine, name: bytes) -> None:
        record.answers.clear()
        block = record.held[name]
        block.refs -= 1
        if block.refs:
            return
        del record.held[name]
        record.whole.clear()
        for media_id in block.media:
            names = record.media[media_id]
            names.pop(name, None)
            if not names:
                del record.media[media_id]
                self._drop_holder(media_id, record.engine)

    def _evict(self, count: int) -> int:
        """The `count` oldest entries over all engines, in one pass over each engine's front."""

        def oldest(n: int, record: _Engine) -> Iterator[tuple[int, int, _Key, _Engine]]:
            for key, (_, stamp) in record.entries.items():
                yield stamp, n, key, record

        fronts = [oldest(n, record) for n, record in enumerate(self._engines.values())]
        victims = list(itertools.islice(heapq.merge(*fronts), count))
        for _, _, key, record in victims:
            name, _ = record.entries.pop(key)
            self._release(record, name)
        self.blocks -= len(victims)
        self.evictions += len(victims)
        return len(victims)

    # -- queries ---------------------------------------------------------------------------------------
    def _silent(self, record: _Engine) -> bool:
        return record.heard_at is None or self._clock() - record.heard_at > self.stale_after_s

    def _fresh(self, engine: EngineId) -> _Engine | None:
        record = self._engines.get(engine)
        if record is None or record.trouble is not None or self._silent(record):
            return None
        return record

    def state(self, engine: EngineId) -> str:
        record = self._engines.get(engine)
        if record is None:
            return NONE
        return STALE if record.trouble is not None or self._silent(record) else FRESH

    def why_stale(self, engine: EngineId) -> str | None:
        record = self._engines.get(engine)
        if record is None or self.state(engine) != STALE:
            return None
        return record.trouble or f"nothing heard for over {self.stale_after_s:g}s"

    def complete(self, engine: EngineId) -> bool:
        record = self._engines.get(engine)
        return record is not None and record.complete

    def engines(self) -> list[EngineId]:
        return list(self._engines)

    def size(self, engine: EngineId) -> int:
        record = self._engines.get(engine)
        return len(record.entries) if record is not None else 0

    def block_size(self, engine: EngineId) -> int:
        """Tokens per block on the engine, 0 before it stored one."""
        record = self._engines.get(engine)
        return record.block_size if record is not None else 0

    def prefix_blocks(self, engine: EngineId, names: Sequence[bytes]) -> int | None:
        """How many of a prompt's leading blocks (names from `chain`) the engine holds; None
        when its state is not fresh. A bisection finds a held block whose next is not; its depth
        is the answer when every block above it is held too, which `whole` remembers once a walk
        proved it (a name stands for its whole prefix, so that holds for every prompt through it):
        else every engine walked a shared preamble on every request."""
        record = self._fresh(engine)
        if record is None:
            return None
        held, whole = record.held, record.whole
        low = bisect.bisect_left(range(len(names)), True, key=lambda k: names[k] not in held)
        if low == 0 or names[low - 1] in whole:
            return low
        count = next((k for k, name in enumerate(names) if name not in held), len(names))
        if count:
            if len(whole) >= WHOLE_MEMO:
                whole.clear()
            whole.add(names[count - 1])
        return count

    def adapter(self, model: str | None) -> str | None:
        """`model` when it names a LoRA adapter some engine stored blocks of, else None (the base
        model, or an adapter none of whose blocks was heard of yet)."""
        return model if model is not None and model in self._adapters else None

    def media_holders(self, media_id: str) -> list[EngineId]:
        """The fresh engines holding some block of the media item (its uuid)."""
        return [engine for engine in self._holders.get(media_id, ()) if self._fresh(engine)]

    def holders(self, media_ids: Iterable[str]) -> set[EngineId]:
        """The engines, fresh or not, holding some block of any of the media items: the others
        hold no prefix through them (`media_prefixes` answers 0 there, or None when not fresh)."""
        out: set[EngineId] = set()
        for media_id in media_ids:
            out.update(self._holders.get(media_id, ()))
        return out

    def media_prefix(self, engine: EngineId, media_id: str) -> int | None:
        """The longest prefix (in blocks) the engine holds whole that holds every block of the
        media item: a prompt that starts so reuses the item's KV without encoding it. 0 when
        there is none, None when the engine's state is not fresh. An item's last block is known
        once a block after it was stored; until then no prefix counts for it."""
        answers = self.media_prefixes(engine, (media_id,))
        return None if answers is None else answers[0]

    def media_prefixes(self, engine: EngineId, media_ids: Sequence[str]) -> list[int] | None:
        """`media_prefix` of each item. A conversation's images lie on one chain, so each block's
        depth is found once for all of them: the cost follows the prompt's length, not its
        length times its images."""
        record = self._fresh(engine)
        if record is None:
            return None
        held, known = record.held, record.answers
        depths: dict[bytes, int] = {}
        answers = []
        for media_id in media_ids:
            answer = known.get(media_id)
            if answer is not None:
                answers.append(answer)
                continue
            # The newest blocks only: a tenant that sends one image after many texts builds many
            # chains through it, and no request should walk them all. The deepest whole chain is
            # the answer, so they are tried deepest first and the first whole one ends the search
            # (a popular image lies on a chain of every conversation it opened).
            chains = record.media.get(media_id)
            if not chains:
                # Most engines hold none of a request's images: a fleet of many costs a lookup each.
                answers.append(0)
                continue
            ends = [
                held[name]
                for name in itertools.islice(reversed(chains), CHAINS_PER_MEDIA)
                if media_id in held[name].closes
            ]
            ends.sort(key=_by_depth, reverse=True)
            best = 0
            for block in ends:
                if _whole_depth(held, block, depths):
                    best = block.depth
                    break
            known[media_id] = best
            answers.append(best)
        return answers


def _by_depth(block: _Held) -> int:
    return block.depth


def _whole_depth(held: dict[bytes, _Held], block: _Held, depths: dict[bytes, int]) -> int:
    """How many blocks the chain ending in `block` holds from the prompt's start, 0 when a block on
    it is missing; `depths` keeps each block's answer (-1 for a broken chain) for the next call."""
    path: list[bytes] = []
    current = block.parent
    base = 0
    while current is not None:
        known = depths.get(current)
        if known is not None:
            base = known
            break
        above = held.get(current)
        if above is None:
            base = -1
            break
        path.append(current)
        current = above.parent
    for name in reversed(path):
        base = base + 1 if base >= 0 else -1
        depths[name] = base
    return base + 1 if base >= 0 else 0
