"""Step 5: the body prefill/decode receive (pure; the client's body is never mutated).

Each matched item becomes a metadata-only `*_embeds` reference the consumer resolves through the
EC connector, so megabytes of media are not parsed and decoded a second time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd_proxy.journey.extract import AUDIO_TYPES, EMBEDS_TYPE, MediaItem, with_parts_replaced
from epd_proxy.journey.match import ItemMatch, Matches


def flatten_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """One item's metadata as a per-item vector: the encoder reports `[[1, 4, 6]]` for a batch of
    one, the consumer stacks `[1, 4, 6]`."""
    flat: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, list) and any(isinstance(v, list) for v in value):
            value = [x for v in value for x in (v if isinstance(v, list) else (v,))]
        flat[key] = value
    return flat


def _embeds_part(item: MediaItem, match: ItemMatch) -> dict[str, Any]:
    kind = EMBEDS_TYPE[item.kind]
    return {"type": kind, kind: flatten_metadata(match.metadata), "uuid": item.uuid}


def transfer_params(
    body: dict[str, Any], handles: dict[str, Any], ec_items: list[dict[str, str]]
) -> dict[str, Any] | None:
    client = body.get("ec_transfer_params")
    merged: dict[str, Any] = dict(client) if isinstance(client, dict) else {}
    merged.update(handles)
    if ec_items:
        merged["ec_items"] = ec_items
    return merged or None


def ec_item_list(items: Sequence[MediaItem], matches: Matches) -> list[dict[str, Any]]:
    """Every matched item's handle, in the items' order (a Mooncake consumer takes them by position)."""
    return [
        {"mm_hash": m.ec_mm_hash, "transfer_id": m.transfer_id}
        for m in (matches.items.get(item.index) for item in items)
        if m is not None
    ]


def referenced(items: Sequence[MediaItem], matches: Matches) -> list[bool]:
    """Which items the consumer gets as `*_embeds` references; the others stay raw media.

    An item is referable when its encoder reported metadata for it. vLLM 0.32 refuses a request
    that mixes raw media and embeddings of one modality with a 400 ("Mixing raw video and
    embedding inputs is not allowed", `renderers/chat_utils.py` `_resolve_items`), so one item
    without metadata keeps every item of its modality raw. With audio in the request it is all or
    nothing across modalities: audio processors may count placeholders of other modalities.
    """
    referable = [bool(matches.items.get(i.index) and matches.items[i.index].metadata) for i in items]
    if all(referable):
        return referable
    if any(item.kind in AUDIO_TYPES for item in items):
        return [False] * len(items)
    raw = {EMBEDS_TYPE[item.kind] for item, ok in zip(items, referable) if not ok}
    return [ok and EMBEDS_TYPE[item.kind] not in raw for item, ok in zip(items, referable)]


def rewrite_request(
    body: dict[str, Any],
    items: Sequence[MediaItem],
    matches: Matches,
    *,
    rewrite: bool = True,
    push_mode: bool = False,
) -> dict[str, Any]:
    """The consumer's body for one attempt.

    rewrite=True: matched items with metadata become `*_embeds` references; every other item
    stays raw media but carries the proxy uuid, so the consumer derives the identifier the encoder
    stored under and still loads the embedding instead of re-encoding. Which items are referenced
    is `referenced`'s rule (per modality, and all or nothing with audio); every item keeps its uuid.

    rewrite=False: media stays as the client sent it; only the handles are attached.
    """
    ec_items = ec_item_list(items, matches)
    out = dict(body)
    if rewrite:
        parts = [
            _embeds_part(item, matches.items[item.index]) if ok else {**item.part, "uuid": item.uuid}
            for item, ok in zip(items, referenced(items, matches))
        ]
        if parts:
            out["messages"] = with_parts_replaced(body["messages"], {i.place: p for i, p in zip(items, parts)})
    elif not push_mode:
        ec_items = []
    params = transfer_params(body, matches.handles, ec_items)
    if params is not None:
        out["ec_transfer_params"] = params
    return out
