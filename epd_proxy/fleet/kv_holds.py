"""What the KV index says an instance holds of a request: the questions placement
(routing.PrefixAffinity) and reuse (held.decide_held) ask of it. Of a rendered prompt
(fleet/rendered.py) it says how many of its tokens the instance holds, block by block; of any
request, how deep a prefix through each of its media items.

An instance is one or more data-parallel ranks, each an engine of the index (kv_index.py). Per
media item the answer is the deepest prefix through it that any fresh rank holds (in blocks), 0
when every rank is fresh and none holds one, and None when the index cannot say: no rank is
fresh, or the fresh ones hold nothing while another is stale. The callers fall back to what this
process saw for a None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from epd_proxy.fleet.kv_index import KvIndex
from epd_proxy.fleet.rendered import Rendered


class MediaDepths(Protocol):
    """(instance URL, media uuids, the ranks to ask or None for all it publishes) -> an answer per
    uuid; and since when the answers are up to date."""

    def __call__(self, url: str, media_ids: Sequence[str], ranks: Sequence[int] | None = None) -> list[int | None]: ...

    def heard_at(self, url: str, ranks: Sequence[int] | None = None) -> float | None:
        """When every asked rank's feed last caught up with its engine (None: one never did)."""
        ...

    def block_size(self, url: str) -> int:
        """Tokens per block on the instance (0: not known yet)."""
        ...

    def holding(self, media_ids: Sequence[str]) -> set[str]:
        """The instances any of whose ranks holds some block of any of the media: every other
        instance answers 0 or None for each of them."""
        ...

    def prefix_tokens(self, url: str, prompt: Rendered) -> int | None:
        """The leading tokens of the rendered prompt the instance holds (whole blocks), None when
        the index cannot say."""
        ...

    def adapter(self, model: object) -> str | None:
        """The LoRA adapter a request's `model` names, as the engines' blocks have shown it; None
        for the base model. Media are asked for under it (kv_names.media_key)."""
        ...


def over_ranks(per_rank: Sequence[Sequence[int] | None], count: int) -> list[int | None]:
    """Each item's answer for the instance from its ranks' answers (None: a rank not fresh)."""
    if len(per_rank) == 1:  # one engine, as most instances are: its answers are the instance's
        only = per_rank[0]
        return [None] * count if only is None else list(only)
    fresh = [answers for answers in per_rank if answers is not None]
    if not fresh:
        return [None] * count
    whole = len(fresh) == len(per_rank)
    out: list[int | None] = []
    for i in range(count):
        best = max(answers[i] for answers in fresh)
        out.append(best if best or whole else None)
    return out


class KvHolds:
    """`MediaDepths` over one index; `ranks` says which ranks of an instance are followed."""

    def __init__(self, index: KvIndex, ranks: Callable[[str], Sequence[int]]) -> None:
        self.index = index
        self._ranks = ranks

    def __call__(self, url: str, media_ids: Sequence[str], ranks: Sequence[int] | None = None) -> list[int | None]:
        followed = self._ranks(url) if ranks is None else ranks
        if not followed or not media_ids:
            return [None] * len(media_ids)
        return over_ranks([self.index.media_prefixes((url, rank), media_ids) for rank in followed], len(media_ids))

    def heard_at(self, url: str, ranks: Sequence[int] | None = None) -> float | None:
        times = [self.index.heard_at((url, rank)) for rank in (self._ranks(url) if ranks is None else ranks)]
        known = [at for at in times if at is not None]
        return min(known) if known and len(known) == len(times) else None

    def block_size(self, url: str) -> int:
        return max((self.index.block_size((url, rank)) for rank in self._ranks(url)), default=0)

    def holding(self, media_ids: Sequence[str]) -> set[str]:
        return {url for url, _ in self.index.holders(media_ids)}

    def adapter(self, model: object) -> str | None:
        return self.index.adapter(model) if isinstance(model, str) else None

    def prefix_tokens(self, url: str, prompt: Rendered) -> int | None:
        per_rank: list[Sequence[int] | None] = []
        for rank in self._ranks(url):
            size = self.index.block_size((url, rank))
            blocks = self.index.prefix_blocks((url, rank), prompt.names(size))
            per_rank.append(None if blocks is None else (blocks * size,))
        return over_ranks(per_rank, 1)[0] if per_rank else None
