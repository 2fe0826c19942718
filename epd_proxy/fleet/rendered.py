"""A request's prompt as vLLM's render endpoint renders it, and its block chain (pure).

vLLM 0.32 answers `POST /v1/chat/completions/render` (also `/v1/messages/render` and
`/v1/responses/render`; a `vllm launch render` server, or `vllm serve --enable-scale-out`) with the
prompt's token ids and, per modality, each item's hash and placeholder range. With those the
proxy names the prompt's blocks as the KV index names what engines store (kv_names.block_name),
so "how much of this prompt does the engine hold" is answered block by block, whatever the images,
text or preamble, instead of through the request's images alone.

vLLM keys a block (`v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`, published by
`to_event_extra_keys`) by its tokens, its parent, and its extra keys in this order: the LoRA name,
then `(identifier, item offset - block start)` for each item overlapping the block, then the cache
salt on the first block only. The identifier is the item's hash as render reports it (the uuid the
proxy sent, or vLLM's own hash of the item). Only full blocks are cached. A LoRA adapter's name
leads every block's extra keys (seen on vLLM 0.32: `("ada",)`, `("ada", ["img", 17])`); render
only echoes `model`, so whether it names an adapter is the render server's `/v1/models` to say
(journey/render.py), and `lora_name` is set from that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd_proxy.fleet.kv_names import MAX_ID_CHARS, chain

# A render answer past these is not vLLM's (a model context of a few million tokens at most).
MAX_TOKENS = 4_000_000
MAX_ITEMS = 4096


@dataclass(frozen=True, slots=True)
class Item:
    """One multimodal item in the prompt: its identifier and its placeholder tokens."""

    identifier: str
    offset: int
    length: int


@dataclass(slots=True, eq=False)
class Rendered:
    """A prompt's token ids and multimodal items, in token order."""

    tokens: Sequence[int]
    items: Sequence[Item] = ()
    cache_salt: str | None = None
    # The LoRA adapter the request names (its `model`), None for the base model.
    lora_name: str | None = None
    # Its block names per block size, made once per request however many candidates ask.
    _names: dict[int, list[bytes]] = field(default_factory=dict)

    def names(self, block_size: int) -> list[bytes]:
        """The names of the prompt's full blocks of `block_size` tokens (kv_names.chain)."""
        names = self._names.get(block_size)
        if names is None:
            names = self._names[block_size] = chain(self.blocks(block_size)) if block_size > 0 else []
        return names

    def blocks(self, block_size: int) -> Iterator[tuple[Sequence[int], tuple[Any, ...] | None]]:
        """Each full block's tokens and its extra keys, as vLLM's events carry them."""
        items = self.items
        first = 0
        for start in range(0, len(self.tokens) - block_size + 1, block_size):
            end = start + block_size
            keys: list[Any] = [self.lora_name] if self.lora_name else []
            index = first
            while index < len(items):
                item = items[index]
                if item.offset >= end:
                    break
                if item.offset + item.length <= start:
                    index += 1
                    first = index
                    continue
                keys.append((item.identifier, item.offset - start))
                if item.offset + item.length > end:
                    break
                index += 1
            if start == 0 and self.cache_salt:
                keys.append(self.cache_salt)
            yield self.tokens[start:end], (tuple(keys) if keys else None)


def parse_render(answer: Any) -> Rendered | None:
    """The prompt in a render endpoint's JSON answer (vLLM's `GenerateRequest`), None when the
    answer is not one: a backend's answer is checked as a client's body would be."""
    if not isinstance(answer, dict):
        return None
    tokens = answer.get("token_ids")
    if not isinstance(tokens, list) or not 0 < len(tokens) <= MAX_TOKENS:
        return None
    if not all(type(t) is int and t >= 0 for t in tokens):
        return None
    items: list[Item] = []
    features = answer.get("features")
    if features is not None:
        if not isinstance(features, dict):
            return None
        hashes, places = features.get("mm_hashes") or {}, features.get("mm_placeholders") or {}
        if not isinstance(hashes, dict) or not isinstance(places, dict) or set(hashes) != set(places):
            return None
        for modality, names in hashes.items():
            ranges = places[modality]
            if not isinstance(names, list) or not isinstance(ranges, list) or len(names) != len(ranges):
                return None
            for name, where in zip(names, ranges):
                item = _item(name, where, len(tokens))
                if item is None:
                    return None
                items.append(item)
        if len(items) > MAX_ITEMS:
            return None
        # vLLM keys blocks with the items sorted by where they start, whatever their modality.
        items.sort(key=lambda item: item.offset)
    salt = answer.get("cache_salt")
    return Rendered(tokens, items, salt if isinstance(salt, str) and salt else None)


def _item(name: Any, where: Any, prompt_len: int) -> Item | None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_ID_CHARS or not isinstance(where, dict):
        return None
    offset, length = where.get("offset"), where.get("length")
    if type(offset) is not int or type(length) is not int or offset < 0 or length <= 0:
        return None
    if offset + length > prompt_len:
        return None
    return Item(name, offset, length)
