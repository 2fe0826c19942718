"""Our names of what engines hold (pure): a block by its prefix, a media item by its identifier
and the LoRA adapter whose blocks hold it.

A block's name digests its parent's name, its token ids and its extra keys as vLLM publishes them
(`generate_block_hash_extra_keys` in vLLM 0.32: the LoRA name, then `(identifier, offset)` per
media item overlapping the block, then the cache salt on the first block only): the same on every
engine whatever its hash seed, and standing for the whole prefix.

An image in an adapter's blocks is not held for the base model or another adapter: vLLM keys every
block of an adapter's prompt with the adapter's name, so a base-model prompt through the same
image reuses none of it. Such an item is named `<adapter>\\0<identifier>`, the adapter as the event's
`lora_name` says; a name or identifier holding a NUL is not vLLM's and names nothing. With
`--enable-tower-connector-lora` vLLM names an adapter's items `<adapter>:<hash>`, so the index never
finds them under the uuid the proxy sent: they are encoded again, which costs work, never an answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import Any

import msgspec

MAX_ITEMS_PER_BLOCK = 64
MAX_ID_CHARS = 256

_encode = msgspec.msgpack.Encoder().encode


def block_name(parent: bytes | None, tokens: Sequence[int], extra: Sequence[Any] | None) -> bytes:
    """Our name of a block: 16 bytes of blake2b over the parent's name, the tokens and the extra
    keys as the events carry them (tuples and lists read alike)."""
    return blake2b(_encode((parent, tokens, extra)), digest_size=16).digest()


def chain(blocks: Iterable[tuple[Sequence[int], Sequence[Any] | None]]) -> list[bytes]:
    """The names of a prompt's blocks, each `(token_ids, extra_keys)`, from the first on."""
    names: list[bytes] = []
    parent = None
    for tokens, extra in blocks:
        parent = block_name(parent, tokens, extra)
        names.append(parent)
    return names


def media_key(identifier: str, adapter: str | None) -> str:
    """The index's name of a media item in the blocks of `adapter` (None: the base model)."""
    return identifier if adapter is None else f"{adapter}\0{identifier}"


def media_in(extra: Sequence[Any] | None, adapter: str | None = None) -> tuple[str, ...]:
    """The media items among one block's extra keys (the `[identifier, offset]` pairs), named as
    in the blocks of `adapter`, the LoRA adapter the event says stored them (`lora_name`)."""
    if not isinstance(extra, list | tuple) or not valid_name(adapter):
        return ()
    # vLLM's identifiers are the proxy's uuids (64 hex digits) or its own hashes: a longer one, or
    # more than a block's worth of items, comes from a publisher that is not vLLM.
    ids = (
        key[0]
        for key in extra[:MAX_ITEMS_PER_BLOCK]
        if isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str) and valid_name(key[0])
    )
    return tuple(media_key(identifier, adapter) for identifier in ids)


def valid_name(name: str | None) -> bool:
    """An identifier or adapter name as vLLM's may be (None: none at all)."""
    return name is None or (isinstance(name, str) and len(name) <= MAX_ID_CHARS and "\0" not in name)
