"""Splice: a request's media stay slices of the client's bytes from reading to writing.

A multimodal request is mostly base64: parsing it into Python strings, hashing copies of them and
serialising them again into encoder bodies is most of what a proxy would spend per request, in
CPU and in memory. Here every large `data:...;base64,` string is lifted out of the body before
parsing and replaced by a short token, so the JSON parser sees only the skeleton; step 1's entry
(`extract.parse_request`) runs the normalising pass on that skeleton unchanged, hashing each lifted
URL in place; and bodies sent to backends are serialised with the tokens put back as slices of the
client's buffer, written with `writelines` and never joined.

The fast path only lifts what provably reads the same either way: a string that is an object
member's value, is already canonical (lower-case `data:` header ending in `;base64`) and holds
nothing but base64 characters (so no escapes, whitespace or control characters). Anything else
stays in the skeleton and is parsed as usual. If any lifted URL ends up anywhere but as the URL of
a media item, or the skeleton does not parse or validate, the whole request is parsed in full
instead, so the outcome (items, identities, bodies, errors) is exactly the full parse's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import orjson
import pybase64

from epd_proxy.journey.dataurl import canonical_media_url

# Shorter URLs are not worth a token: parsing them costs less than the bookkeeping.
LIFT_MIN_BYTES = 512
_WHITESPACE = b" \t\r\n"
_COLON = ord(":")
_QUOTE = ord('"')


class Spliced:
    """The client's buffer and the URLs lifted out of it, each named by a token."""

    __slots__ = ("raw", "prefix", "spans", "_marker", "_view")

    def __init__(self, raw: bytes | bytearray, prefix: str, spans: list[tuple[int, int]]) -> None:
        self.raw = raw
        self.prefix = prefix
        self.spans = spans
        self._marker = prefix.encode("ascii")
        self._view = memoryview(raw)

    def span(self, token: str) -> memoryview:
        start, end = self.spans[int(token[len(self.prefix) :])]
        return self._view[start:end]

    def bytes_of(self, url: str) -> memoryview | None:
        """The bytes of a lifted URL (a slice of the client's buffer, hashed in place, exactly as
        the full parse would hash the same string), or None for any other URL."""
        if not url.startswith(self.prefix):
            return None
        return self.span(url)

    def accounts_for(self, urls: Iterable[str | None]) -> bool:
        """Whether every lifted URL is exactly one of the media items' `urls`, which is the only
        place the normalising pass reads it through `bytes_of` instead of as a string."""
        used = 0
        for url in urls:
            if url is not None and url.startswith(self.prefix):
                used += 1
        return used == len(self.spans)

    def dumps(self, obj: Any) -> list[bytes | memoryview]:
        """`orjson.dumps(obj)` with every token replaced by its URL's bytes, as a list of buffers."""
        out = orjson.dumps(obj)
        marker = self._marker
        at = out.find(marker)
        if at < 0:
            return [out]
        pieces: list[bytes | memoryview] = []
        view, spans, skip = self._view, self.spans, len(marker)
        done = 0
        while at >= 0:
            end = out.index(b'"', at)
            start_span, end_span = spans[int(out[at + skip : end])]
            pieces.append(out[done:at])
            pieces.append(view[start_span:end_span])
            done = end
            at = out.find(marker, end)
        pieces.append(out[done:])
        return pieces


def lift(raw: bytes | bytearray, min_bytes: int = LIFT_MIN_BYTES) -> tuple[bytes, Spliced] | None:
    """(skeleton, spliced) with every liftable media URL replaced by a token, or None if none is."""
    spans: list[tuple[int, int]] = []
    pieces: list[bytes | bytearray] = []
    # Unguessable per request, so no client string can pass for a token.
    prefix = f"data:,epd-{os.urandom(8).hex()}-"
    done = 0
    at = raw.find(b'"data:')
    while at >= 0:
        start = at + 1
        end = raw.find(b'"', start)
        if end < 0:
            return None  # not valid JSON: the full parse says why
        if end - start >= min_bytes and _is_member_value(raw, at) and _is_canonical_base64(raw, start, end):
            pieces.append(raw[done:start])
            pieces.append(f"{prefix}{len(spans)}".encode("ascii"))
            spans.append((start, end))
            done = end
        at = raw.find(b'"data:', end + 1)
    if not spans:
        return None
    pieces.append(raw[done:])
    return b"".join(pieces), Spliced(raw, prefix, spans)


def lift_base64_members(
    raw: bytes | bytearray, key: bytes, min_bytes: int = LIFT_MIN_BYTES
) -> tuple[bytes, Spliced] | None:
    """`lift` for bare base64 strings that are the value of a member named `key` (an Anthropic
    image source's `data`): the same tokens, the same rule that only pure base64 is lifted."""
    spans: list[tuple[int, int]] = []
    pieces: list[bytes | bytearray] = []
    prefix = f"data:,epd-{os.urandom(8).hex()}-"
    needle = b'"' + key + b'"'
    done = 0
    at = raw.find(needle)
    while at >= 0:
        start = at + len(needle)
        while start < len(raw) and raw[start] in _WHITESPACE:
            start += 1
        if start < len(raw) and raw[start] == _COLON:
            start += 1
            while start < len(raw) and raw[start] in _WHITESPACE:
                start += 1
            if start < len(raw) and raw[start] == _QUOTE:
                start += 1
                end = raw.find(b'"', start)
                if end < 0:
                    return None  # not valid JSON: the full parse says why
                if end - start >= min_bytes and _is_base64(raw, start, end):
                    pieces.append(raw[done:start])
                    pieces.append(f"{prefix}{len(spans)}".encode("ascii"))
                    spans.append((start, end))
                    done = end
                start = end
        at = raw.find(needle, start)
    if not spans:
        return None
    pieces.append(raw[done:])
    return b"".join(pieces), Spliced(raw, prefix, spans)


def _is_base64(raw: bytes | bytearray, start: int, end: int) -> bool:
    try:
        pybase64.b64decode(memoryview(raw)[start:end], validate=True)
    except ValueError:
        return False
    return True


def _is_member_value(raw: bytes | bytearray, quote: int) -> bool:
    at = quote - 1
    while at >= 0 and raw[at] in _WHITESPACE:
        at -= 1
    return at >= 0 and raw[at] == _COLON


def _is_canonical_base64(raw: bytes | bytearray, start: int, end: int) -> bool:
    comma = raw.find(b",", start, min(end, start + 256))
    if comma < 0:
        return False
    try:
        header = raw[start : comma + 1].decode("ascii")
    except UnicodeDecodeError:
        return False
    if "\\" in header or not header.isprintable() or not header.endswith(";base64,"):
        return False  # an escape or a control character: the string differs from its JSON text
    if canonical_media_url(header) != header:
        return False
    # A strict decode accepts nothing but the base64 alphabet, so no escape, whitespace, quote or
    # control character: then the JSON text is the string's UTF-8 bytes exactly. pybase64's SIMD
    # decoder checks at memory speed, several times faster than any byte loop in the stdlib.
    return _is_base64(raw, comma + 1, end)
