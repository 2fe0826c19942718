"""Step 4: map an encoder's `ec_transfer_params` back to the items it was sent (pure).

Positions (`item_indices`) are the truth; hashes cannot be predicted by the proxy because the
engine derives them from the uuid plus processing options. Anything ambiguous is an error,
never a guess: a wrong guess would hand the consumer another image's embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from epd_proxy.errors import ProxyError
from epd_proxy.journey.extract import MediaItem

_POSITION_ONLY_KEYS = frozenset({"metadata", "item_indices"})


@dataclass(frozen=True, slots=True)
class ItemMatch:
    metadata: dict[str, Any]
    # The identifier the engine reported; consumers look handles up by it. None when the encoder
    # reported nothing usable for the item: then only its transfer id is known, and a Mooncake
    # consumer takes it by position.
    ec_mm_hash: str | None
    transfer_id: str


@dataclass(slots=True)
class Matches:
    items: dict[int, ItemMatch] = field(default_factory=dict)
    # Connector handles keyed by the engine-reported identifier, kept verbatim.
    handles: dict[str, dict[str, Any]] = field(default_factory=dict)


def _bad(message: str, backend: str | None) -> ProxyError:
    return ProxyError(502, message, stage="match", error_type="upstream_error", backend=backend)


def match_group(
    items: Sequence[MediaItem],
    transfer_ids: Sequence[str],
    params: dict[str, Any] | None,
    into: Matches,
    *,
    audio_in_video: bool = False,
    push_mode: bool = False,
    backend: str | None = None,
) -> None:
    """Record matches for one encoder group into `into`.

    `audio_in_video`: the client asked for `use_audio_in_video`, so a video item yields two
    features (video and audio) that cannot be mapped to one item; without transfer handles to
    honour, such a video may stay raw media.
    """
    # Values that are not per-hash dicts (an older encoder's bare `ec_items` list) carry nothing
    # the proxy can map; items without an entry stay raw media and the consumer encodes them.
    entries = {key: value for key, value in (params or {}).items() if isinstance(value, dict)}
    if not entries:
        _keep_positions(items, transfer_ids, into, push_mode)
        return
    by_position: dict[int, str] = {}
    key: str | None
    if len(items) > 1:
        for key, entry in entries.items():
            indices = entry.get("item_indices")
            if indices is None:
                continue
            if not isinstance(indices, list):
                raise _bad(f"Invalid encoder item index list for {key!r}: {indices!r}", backend)
            for index in indices:
                if type(index) is not int or not 0 <= index < len(items):
                    raise _bad(f"Invalid encoder item index {index!r} for {key!r} (group of {len(items)})", backend)
                if index in by_position:
                    raise _bad(f"Duplicate encoder item index {index} ({by_position[index]!r} and {key!r})", backend)
                by_position[index] = key

    for position, item in enumerate(items):
        key = by_position.get(position)
        if key is None:
            if item.uuid in entries:
                key = item.uuid
            elif len(items) == 1 and len(entries) == 1:
                key = next(iter(entries))
            elif (
                item.kind == "video_url"
                and audio_in_video
                and len(entries) == 2
                and not push_mode
                and all(entry.keys() <= _POSITION_ONLY_KEYS for entry in entries.values())
            ):
                continue
            else:
                raise _bad(
                    f"Encoder metadata cannot be matched to item {item.index} ({item.kind}); "
                    f"the encoder reported {len(entries)} entries without usable item_indices",
                    backend,
                )
        entry = entries[key]
        metadata = entry.get("metadata")
        into.items[item.index] = ItemMatch(metadata if isinstance(metadata, dict) else {}, key, transfer_ids[position])
        into.handles[key] = entry


class Answer(Protocol):
    """One group's answer as the encode step hands it back (subrequest.Encoded)."""

    @property
    def ec_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def transfer_ids(self) -> list[str]: ...
    @property
    def backend(self) -> str: ...


def match_groups(
    body: dict[str, Any],
    items: Sequence[MediaItem],
    groups: Sequence[Sequence[int]],
    answers: Sequence[Answer],
    *,
    push_mode: bool,
) -> Matches:
    """Every group's answer mapped to its items (`groups` holds each group's item indices)."""
    matches = Matches()
    kwargs = body.get("mm_processor_kwargs")
    audio_in_video = isinstance(kwargs, dict) and bool(kwargs.get("use_audio_in_video"))
    for indices, answer in zip(groups, answers):
        match_group(
            [items[i] for i in indices],
            answer.transfer_ids,
            answer.ec_transfer_params,
            matches,
            audio_in_video=audio_in_video,
            push_mode=push_mode,
            backend=answer.backend,
        )
    return matches


def _keep_positions(items: Sequence[MediaItem], transfer_ids: Sequence[str], into: Matches, push_mode: bool) -> None:
    """Items the encoder reported nothing for still hold their place in `ec_items` when a
    Mooncake consumer resolves entries by position: the producer pushed them under the ids it was
    given, and a missing entry would shift every later item onto a neighbour's transfer id."""
    if not push_mode:
        return
    for item, transfer_id in zip(items, transfer_ids):
        into.items.setdefault(item.index, ItemMatch({}, None, transfer_id))


def split_params(
    params: dict[str, Any] | None, sizes: Sequence[int], backend: str | None = None
) -> Sequence[dict[str, Any] | None]:
    """A coalesced sub-request's `ec_transfer_params` cut into each group's share, as the encoder
    would have answered each group alone: its entries, with `item_indices` counted from the
    group's first item. Several requests' media in one answer can only be told apart by position,
    so every entry needs valid `item_indices` and every item an entry; anything else is a 502
    (the caller then sends each group on its own, where the single-group rules apply)."""
    total = sum(sizes)
    owner: list[int] = []
    for group, size in enumerate(sizes):
        owner.extend([group] * size)
    starts = [0] * len(sizes)
    for group in range(1, len(sizes)):
        starts[group] = starts[group - 1] + sizes[group - 1]
    entries = {key: value for key, value in (params or {}).items() if isinstance(value, dict)}
    if not entries:
        return [None] * len(sizes)
    shares: list[dict[str, Any]] = [{} for _ in sizes]
    covered = [False] * total
    for key, entry in entries.items():
        indices = entry.get("item_indices")
        if not isinstance(indices, list) or not indices:
            raise _bad(f"Encoder entry {key!r} of a coalesced sub-request has no item_indices", backend)
        local: dict[int, list[int]] = {}
        for index in indices:
            if type(index) is not int or not 0 <= index < total:
                raise _bad(f"Invalid encoder item index {index!r} for {key!r} (group of {total})", backend)
            if covered[index]:
                raise _bad(f"Duplicate encoder item index {index} in the answer (at {key!r})", backend)
            covered[index] = True
            group = owner[index]
            local.setdefault(group, []).append(index - starts[group])
        for group, positions in local.items():
            shares[group][key] = {**entry, "item_indices": positions}
    if not all(covered):
        missing = covered.index(False)
        raise _bad(f"Encoder metadata of a coalesced sub-request names no entry for item {missing}", backend)
    return shares
