"""Encoder answers for tests that need every media item matched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.match import Matches, match_group


def every_item_matched(items: Sequence[MediaItem], metadata: dict[str, Any]) -> Matches:
    """As if each item went alone to an encoder that reported `metadata` under the item's uuid."""
    matches = Matches()
    for item in items:
        match_group([item], [f"t{item.index}"], {item.uuid: {"metadata": metadata}}, matches)
    return matches
