"""Step 2: turn per-item encoder choices into encoder sub-requests (pure).

Images bound for the same encoder travel together, because one multi-image sub-request costs an
encoder one scheduling round instead of several; audio and video stay single because their
processors do not batch across items.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from epd_proxy.journey.extract import MediaItem

E = TypeVar("E", bound=Hashable)


@dataclass(frozen=True, slots=True)
class EncoderGroup(Generic[E]):
    encoder: E
    indices: tuple[int, ...]


def plan_groups(items: Sequence[MediaItem], assignment: Sequence[E], max_batch: int) -> list[EncoderGroup[E]]:
    """Groups in creation order; `assignment[k]` is item k's encoder, `max_batch` 0 = unlimited.
    A group's indices are positions in `items`, which may be some of a request's items only."""
    if len(items) != len(assignment):
        raise ValueError("one encoder choice per item is required")
    groups: list[list[int]] = []
    encoders: list[E] = []
    open_image_group: dict[E, int] = {}
    for position, (item, encoder) in enumerate(zip(items, assignment)):
        if not item.is_image:
            groups.append([position])
            encoders.append(encoder)
            continue
        slot = open_image_group.get(encoder)
        if slot is None or (max_batch and len(groups[slot]) >= max_batch):
            slot = len(groups)
            open_image_group[encoder] = slot
            groups.append([])
            encoders.append(encoder)
        groups[slot].append(position)
    return [EncoderGroup(encoder, tuple(indices)) for encoder, indices in zip(encoders, groups)]
