"""Step 1: the client's request read once: `parse_request` is the entry, lifting large media out
of the body first where it can (splice.py), then one normalising pass over what is left.

Every content part gets exactly one kind, decided as the pinned vLLM's chat parser decides it
(`vllm/renderers/chat_utils.py`, `_parse_chat_message_content_mm_part` in vLLM 0.32): by `type`
when it names a known part type and the part has no `uuid`, otherwise by the first media key
present. The proxy adds its own `uuid` to the media it forwards, which switches vLLM to the
key-based reading, so a part that the two readings would classify differently is refused rather
than guessed. Later steps (plan, encoder bodies, rewrite) see only what this pass returns: the
cleaned body and its media items. An item's global index (message order, then content order) is
the key every later step uses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import blake3
import orjson

from epd_proxy.errors import BadRequest
from epd_proxy.fleet.cost import request_costs
from epd_proxy.journey.dataurl import canonical_media_url
from epd_proxy.journey.splice import LIFT_MIN_BYTES, Spliced, lift

# Media the proxy disaggregates, by the kind vLLM assigns; `input_image` (Responses-style) is read
# by vLLM as an image URL and is normalised to an `image_url` part.
EMBEDS_TYPE = {
    "image_url": "image_embeds",
    "audio_url": "audio_embeds",
    "input_audio": "audio_embeds",
    "video_url": "video_embeds",
}
AUDIO_TYPES = ("audio_url", "input_audio")
# The modality vLLM counts each media kind under (its `--limit-mm-per-prompt` keys).
MODALITY = {"image_url": "image", "audio_url": "audio", "input_audio": "audio", "video_url": "video"}
# vLLM's key-based reading tries these keys in this order (a part with no `type`, or with a uuid).
KEY_ORDER = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
# Parts that make the engine use data the proxy did not see: embeddings (a reference whose hash is
# not in the encoder cache kills a vLLM consumer engine) and in-process PIL images, which over
# HTTP can only be empty cache references.
REFERENCE_KINDS = frozenset({"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil"})
KNOWN_TYPES = TEXT_TYPES | frozenset(KEY_ORDER) | {"input_image"}
# Which kind a `type` stands for when deciding whether a part names more than one kind.
_SAME_KIND = {"input_image": "image_url", **{t: "text" for t in TEXT_TYPES}}
# Fields only an encoder or a trusted router may set: forged transfer params steer KV/EC pulls.
ENGINE_ONLY_FIELDS = ("ec_transfer_params", "kv_transfer_params")
# vLLM copies `vllm_xargs` into the sampling params' extra_args and the engine reads these names
# from there (vllm/v1/request.py), so they are engine-only inside it too; a string or list there
# crashes the EC connector's scheduler hooks.
ENGINE_ONLY_XARGS = (*ENGINE_ONLY_FIELDS, "kv_cache_report_mode")


@dataclass(frozen=True, slots=True)
class Place:
    """Where a content part lives: `entries[entry][field][part]`, the entries being a chat body's
    messages or a Responses body's input items (whose tool outputs keep their parts in `output`)."""

    entry: int
    field: str
    part: int

    def of(self, entries: list[Any]) -> Any:
        return entries[self.entry][self.field][self.part]


@dataclass(frozen=True, slots=True)
class MediaItem:
    index: int
    kind: str
    # The part as an encoder gets it: the client's part without its uuid, as a chat part
    # (`input_image` as `image_url`).
    part: dict[str, Any]
    uuid: str
    place: Place
    # Whether the consumer gets this item under the proxy's uuid. An Anthropic image block has no
    # field for one, so there the encoder must name the item by its content, as the consumer will.
    named: bool = True
    # What it costs an encoder, in image-equivalents (fleet/cost.py).
    cost: float = 1.0
    # The http(s) URL its media lie behind, until the proxy fetched them (journey/remote.py): then
    # the part holds the bytes as a `data:` URL and the item is named by them.
    fetch: str | None = None

    @property
    def is_image(self) -> bool:
        return self.kind == "image_url"

    @property
    def modality(self) -> str:
        return MODALITY[self.kind]


@dataclass(frozen=True, slots=True)
class NormalisedRequest:
    # The client's body with client uuids removed; untouched messages are the client's own objects.
    body: dict[str, Any]
    items: list[MediaItem]


# (media, kind tag) -> name.
Digest = Callable[[bytes | memoryview, bytes], str]
# The bytes of a URL still held in the client's buffer (see `splice`); None for any other URL.
Lifted = Callable[[str], bytes | memoryview | None]
# What an item's name is prefixed with, by its kind: vLLM uses a name as the cache key whatever
# the modality, so the same bytes as an image and as a video must get two. Images keep the
# reference proxy's name (no prefix); no media URL the proxy forwards begins like another kind's
# prefix (it begins with `data:` or `http`), so the kinds' names never meet.
KIND_TAG = {"image_url": b"", "video_url": b"video:", "audio_url": b"audio:", "input_audio": b"audio:"}


def _sha256_hex(data: bytes | memoryview, tag: bytes) -> str:
    hasher = hashlib.sha256(tag)
    hasher.update(data)
    return hasher.hexdigest()


def _blake3_hex(data: bytes | memoryview, tag: bytes) -> str:
    return blake3.blake3(tag).update(data).hexdigest()


# `--media-hash`: how the proxy names media for the encoder cache. sha256 is the reference proxy's
# formula, so both proxies give the same image sent inline the same cache key; blake3 is as
# collision-resistant and about three times cheaper here (the benchmark's floor line), for fleets
# that no reference proxy shares.
MEDIA_HASHES: dict[str, Digest] = {"sha256": _sha256_hex, "blake3": _blake3_hex}


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How every door reads a client's body (the serve flags of the same names); the server
    builds one for its life."""

    trust_client_fields: bool = False
    # 0: no limit.
    max_media_items: int = 0
    media_hash: str = "sha256"
    # Smaller media strings are parsed in place, not lifted out of the body (splice.py).
    lift_min_bytes: int = LIFT_MIN_BYTES
    # An isolated tenant's cache salt (tenants.py): its media are named by it and their bytes, so
    # no cache keyed by name matches another tenant's entry. Empty: the reference proxy's names.
    salt: str = ""

    @property
    def digest(self) -> Digest:
        named = MEDIA_HASHES[self.media_hash]
        # Ahead of the kind's tag: no unsalted name's input begins so (see KIND_TAG).
        salted = b"salt:%s:" % self.salt.encode()
        return (lambda data, tag: named(data, salted + tag)) if self.salt else named

    def salted(self, salt: str | None) -> ReadOptions:
        return replace(self, salt=salt) if salt else self

    def check_media_count(self, found: int) -> None:
        """Before one more media item joins the `found` ones: a 400 past the limit."""
        if self.max_media_items and found >= self.max_media_items:
            raise BadRequest(f"the request has more than {self.max_media_items} media items")


def media_url(part: dict[str, Any], kind: str) -> str | None:
    value = part.get(kind)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        url = value.get("url")
        if isinstance(url, str):
            return url
    return None


def content_uuid(
    part: dict[str, Any],
    kind: str,
    lifted: Lifted | None = None,
    digest: Digest = _sha256_hex,
) -> str:
    """An item's name: the hash of its kind's tag and its `data:` URL (the media's bytes and
    type), else of its sorted JSON (an `input_audio` holds its data). Never URL-derived: caches
    pair whatever they hold under a name with the media sent under it. `part` is as forwarded: its
    URL canonical (`_forwarded_media_part`), and a `data:` URL once fetched (journey/remote.py).
    An image's name is the reference proxy's, so mixed fleets share encoder cache keys. `lifted`
    gives the bytes of URLs still in the client's buffer (see `splice`), hashed in place."""
    tag = KIND_TAG[kind]
    # vLLM reads only `data` and `format` of an input_audio; any `url` beside them names nothing.
    url = media_url(part, kind) if kind != "input_audio" else None
    if url is None:
        try:
            text = json.dumps(part, sort_keys=True)
        except RecursionError:
            raise BadRequest(f"a {kind} part nests too deeply to be named") from None
        return digest(text.encode("utf-8"), tag)
    data = lifted(url) if lifted is not None else None
    return digest(data if data is not None else url.encode("utf-8"), tag)


def fetched_from(url: str, where: str) -> str | None:
    """The http(s) URL the proxy fetches the media from (journey/remote.py), None for a `data:`
    URL, or a 400: the proxy names only bytes it has seen (a `file:` URL is on an engine's disk)."""
    scheme = url[:8].lower()
    if scheme.startswith("data:"):
        return None
    if scheme.startswith(("http://", "https://")):
        return url
    raise BadRequest(f"{where} must be a data: URL or an http(s) URL")


def part_kind(part: dict[str, Any], where: str) -> str:
    """The one kind vLLM gives this part, or a 400 when readings could differ or none applies."""
    part_type = part.get("type")
    if part_type is not None and not isinstance(part_type, str):
        raise BadRequest(f"{where}.type must be a string")
    keys = [key for key in KEY_ORDER if key in part]
    named = {_SAME_KIND.get(key, key) for key in keys}
    if part_type is not None:
        if part_type not in KNOWN_TYPES:
            raise BadRequest(
                f"{where} has the unsupported type {part_type!r}; supported: {', '.join(sorted(KNOWN_TYPES))}"
            )
        named.add(_SAME_KIND.get(part_type, part_type))
    if len(named) > 1:
        raise BadRequest(
            f"{where} names more than one kind ({', '.join(sorted(named))}); "
            "send one kind per part, as vLLM may read it as any of them"
        )
    if part_type is not None:
        return part_type
    if not keys:
        raise BadRequest(f"{where} has no 'type' and no media field")
    return keys[0]


def _forwarded_media_part(part: dict[str, Any], kind: str, where: str) -> tuple[str, dict[str, Any]]:
    """(item kind, the part as the proxy forwards it); a media part without its data is a 400,
    since vLLM would read it as a data-less cache reference."""
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str) or not audio["data"]:
            raise BadRequest(f"{where} is 'input_audio' without 'input_audio.data'")
        return kind, part
    if kind == "input_image":
        url = media_url(part, "image_url")
        if not url:
            raise BadRequest(f"{where} is 'input_image' without an 'image_url'")
        return "image_url", {"type": "image_url", "image_url": {"url": canonical_media_url(url)}}
    url = media_url(part, kind)
    if not url:
        raise BadRequest(f"{where} is '{kind}' without a '{kind}.url'")
    canonical = canonical_media_url(url)
    if canonical is not url:
        # Forward the bytes the identity names, so E and PD decode exactly what was hashed.
        value = part[kind]
        part = {**part, kind: {**value, "url": canonical} if isinstance(value, dict) else canonical}
    return kind, part


def _check_top_level(body: Any, trust_client_fields: bool) -> list[Any]:
    check_body(body, trust_client_fields)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    return messages


def check_body(body: Any, trust_client_fields: bool) -> None:
    """What every API's body must be before the proxy reads it for media: an object, whose
    `stream` the proxy can tell, and which sets no field only the proxy may."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise BadRequest("'stream' must be a boolean")
    if not trust_client_fields:
        refuse_engine_fields(body)


def refuse_engine_fields(body: dict[str, Any]) -> None:
    """A 400 for a client body that sets what only the proxy (or a trusted router) may."""
    xargs = body.get("vllm_xargs")
    forged = [name for name in ENGINE_ONLY_FIELDS if body.get(name) is not None]
    if isinstance(xargs, dict):
        forged += [f"vllm_xargs.{name}" for name in ENGINE_ONLY_XARGS if name in xargs]
    if forged:
        raise BadRequest(
            f"'{forged[0]}' is set by the proxy, not by clients "
            "(start the proxy with --trust-client-fields if a trusted router sits in front)"
        )


def _without_uuid(part: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in part.items() if key != "uuid"}


@dataclass(slots=True)
class PartReader:
    """One rule set for every list of content parts vLLM parses, whichever door it came by.

    Untrusted (the default): embeddings and PIL parts are a 400 whatever their `type`, a media
    part without its data is a 400, and no client `uuid` survives, so everything the proxy
    forwards names only media it hashed itself. Trusted (`--trust-client-fields`, behind a router
    that sets them): such parts pass through untouched and a client uuid becomes the item's
    identity, as in the reference proxy. Collects the media items and the parts it changed."""

    options: ReadOptions
    lifted: Lifted | None = None
    # A Responses body keeps an `input_image` part in its own shape (its SDK types take no
    # `image_url` part); chat forwards it as the `image_url` part vLLM reads it as.
    keep_input_image: bool = False
    # The body whose options price its media (fleet/cost.py), read at its first media item.
    body: dict[str, Any] | None = None
    items: list[MediaItem] = field(default_factory=list)
    replaced: dict[Place, Any] = field(default_factory=dict)
    _costs: dict[str, float] | None = None

    def read(self, parts: list[Any], entry: int, name: str, where: str) -> None:
        """Read `parts`, the list at `entries[entry][name]`, called `where` in errors."""
        trusted = self.options.trust_client_fields
        for p, part in enumerate(parts):
            if isinstance(part, str):  # vLLM reads a bare string as a text part
                continue
            at = f"{where}[{p}]"
            if not isinstance(part, dict):
                raise BadRequest(f"{at} must be an object or a string")
            kind = part_kind(part, at)
            if kind in REFERENCE_KINDS:
                if not trusted:
                    raise BadRequest(
                        f"{at} is read by vLLM as '{kind}': embeddings and cache references are made by "
                        "the proxy, not sent by clients"
                    )
                continue
            place = Place(entry, name, p)
            forwarded = part if trusted or "uuid" not in part else _without_uuid(part)
            if kind not in TEXT_TYPES and kind != "tool_reference":
                forwarded = self._media(forwarded, kind, part.get("uuid"), place, at)
            if forwarded is not part:
                self.replaced[place] = forwarded

    def _media(self, part: dict[str, Any], kind: str, client_uuid: Any, place: Place, at: str) -> dict[str, Any]:
        """The media part as forwarded, its item added."""
        item_kind, media = _forwarded_media_part(part, kind, at)
        self.options.check_media_count(len(self.items))
        url = media_url(media, item_kind)
        fetch = fetched_from(url, at) if url is not None and item_kind != "input_audio" else None
        if self.options.trust_client_fields and isinstance(client_uuid, str) and client_uuid:
            uuid = client_uuid
        else:
            # Media behind a URL are named once fetched (journey/remote.py).
            uuid = "" if fetch else content_uuid(media, item_kind, self.lifted, self.options.digest)
            if "uuid" in media:  # trusted but unusable: the proxy's identity replaces it
                media = _without_uuid(media)
        if self._costs is None:
            self._costs = request_costs(self.body or {})
        cost = self._costs.get(item_kind, 1.0)
        self.items.append(MediaItem(len(self.items), item_kind, media, uuid, place, cost=cost, fetch=fetch))
        if not (self.keep_input_image and kind == "input_image"):
            return media
        if "uuid" in part and uuid != client_uuid:
            part = _without_uuid(part)
        url = media["image_url"]["url"]
        return (
            part if part["image_url"] is url or not isinstance(part["image_url"], str) else {**part, "image_url": url}
        )

    def normalised(self, body: dict[str, Any], key: str) -> NormalisedRequest:
        """`body` with the parts read from `body[key]` as forwarded, and the items."""
        cleaned = {**body, key: with_parts_replaced(body[key], self.replaced)} if self.replaced else body
        return NormalisedRequest(cleaned, self.items)


def normalise_request(
    body: Any, options: ReadOptions = ReadOptions(), lifted: Lifted | None = None
) -> NormalisedRequest:
    """Validate the chat body, read every message's content parts (`PartReader`: vLLM parses
    the content of every role, a tool message's too) and collect the media."""
    messages = _check_top_level(body, options.trust_client_fields)
    reader = PartReader(options, lifted, body=body)
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{m}] must be an object")
        content = message.get("content")
        if isinstance(content, list):
            reader.read(content, m, "content", f"messages[{m}].content")
    return reader.normalised(body, "messages")


def with_parts_replaced(entries: list[Any], replaced: dict[Place, Any]) -> list[Any]:
    """A copy of `entries` (chat messages, Responses input items) with the part at each place
    replaced; an entry without a replaced part stays the client's object."""
    copied = list(entries)
    fresh: set[tuple[int, str]] = set()
    for place, part in replaced.items():
        m, name = place.entry, place.field
        if (m, name) not in fresh:
            copied[m] = {**copied[m], name: list(entries[m][name])}
            fresh.add((m, name))
        copied[m][name][place.part] = part
    return copied


def with_url(part: dict[str, Any], key: str, url: str) -> dict[str, Any]:
    """`part` with the media URL of its `key` (a string, or an object's `url`) replaced."""
    value = part.get(key)
    return {**part, key: {**value, "url": url} if isinstance(value, dict) else url}


def with_urls(entries: list[Any], moved: Iterable[tuple[MediaItem, str]]) -> list[Any]:
    """`entries` with each item's media URL, in its part where the entries hold it, replaced."""
    return with_parts_replaced(entries, {i.place: with_url(i.place.of(entries), i.kind, url) for i, url in moved})


def parse_json_body(raw: bytes | bytearray) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def parse_request(
    raw: bytes | bytearray,
    options: ReadOptions = ReadOptions(),
    *,
    normalise: Callable[..., NormalisedRequest] = normalise_request,
) -> tuple[NormalisedRequest, Spliced | None]:
    """The normalised request and, when the fast path held, the buffer its tokens point into.
    `normalise` reads one API's body (this module's is the chat completion's)."""
    lifted = lift(raw, options.lift_min_bytes)
    if lifted is not None:
        skeleton, spliced = lifted
        try:
            normalised = normalise(orjson.loads(skeleton), options, lifted=spliced.bytes_of)
        except (orjson.JSONDecodeError, BadRequest):
            normalised = None  # the full parse gives the exact error
        if normalised is not None and spliced.accounts_for(media_url(i.part, i.kind) for i in normalised.items):
            return normalised, spliced
    return normalise(parse_json_body(raw), options), None
