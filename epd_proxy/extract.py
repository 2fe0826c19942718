"""Step 1: find the media items of a chat request and give each its content identity.

An item's global index (message order, then content order) is the key every later step uses.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from epd_proxy.errors import BadRequest

URL_MEDIA_TYPES = ("image_url", "audio_url", "video_url")
MEDIA_TYPES = (*URL_MEDIA_TYPES, "input_audio")
EMBEDS_TYPE = {
    "image_url": "image_embeds",
    "audio_url": "audio_embeds",
    "input_audio": "audio_embeds",
    "video_url": "video_embeds",
}
AUDIO_TYPES = ("audio_url", "input_audio")
EMBEDS_TYPES = frozenset(EMBEDS_TYPE.values())
# Fields only an encoder or a trusted router may set: a forged embeds reference whose hash is not
# in the encoder cache kills a vLLM consumer engine, and forged transfer params steer KV/EC pulls.
ENGINE_ONLY_FIELDS = ("ec_transfer_params", "kv_transfer_params")


@dataclass(frozen=True, slots=True)
class MediaItem:
    index: int
    kind: str
    part: dict[str, Any]
    uuid: str
    message_index: int
    part_index: int

    @property
    def is_image(self) -> bool:
        return self.kind == "image_url"


# Bodies above this hash their media off the event loop: sha256 runs at roughly 2 ms per MB here
# and releases the GIL, so other requests keep flowing while a large upload is identified.
OFFLOAD_HASH_BYTES = 256 * 1024
_WHITESPACE = " \t\r\n\f\v"
_DROP_WHITESPACE = str.maketrans("", "", _WHITESPACE)


def sha256_hex(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def canonical_media_url(url: str) -> str:
    """The same bytes written differently are the same item: a base64 `data:` URL loses the line
    breaks and spaces inside its payload and gets a lower-case scheme and media type. A URL that
    is already canonical comes back unchanged (the same object), so it hashes exactly as the
    reference proxy hashes it. Other URLs are kept as they are.
    """
    if url[:5].lower() != "data:":
        return url
    comma = url.find(",")
    if comma < 0:
        return url
    header = url[:comma]
    mediatype, semicolon, params = header[5:].partition(";")
    param_list = [p.strip() for p in params.split(";")] if semicolon else []
    is_base64 = any(p.lower() == "base64" for p in param_list)
    canonical_header = "data:" + mediatype.strip().lower()
    canonical_header += "".join(";base64" if p.lower() == "base64" else ";" + p for p in param_list)
    # str.find is a memchr-speed scan; slicing or rebuilding a megabyte payload is what costs.
    dirty = is_base64 and any(url.find(c, comma + 1) >= 0 for c in _WHITESPACE)
    if not dirty and canonical_header == header:
        return url
    payload = url[comma + 1 :]
    if dirty:
        payload = payload.translate(_DROP_WHITESPACE)
    return f"{canonical_header},{payload}"


def media_url(part: dict[str, Any], kind: str) -> str | None:
    value = part.get(kind)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        url = value.get("url")
        if isinstance(url, str):
            return url
    return None


def content_uuid(part: dict[str, Any], kind: str) -> str:
    """The reference proxy's identity: sha256 of the URL, else of the item's sorted JSON.

    Keeping the reference's formula means encoder caches keep their keys in fleets that mix both
    proxies. It must be content-derived, not request-derived, for cross-request cache reuse.
    """
    url = media_url(part, kind)
    if url is not None:
        return sha256_hex(canonical_media_url(url))
    return sha256_hex(json.dumps(part, sort_keys=True))


def part_kind(part: dict[str, Any]) -> Any:
    """The part's `type`; like vLLM, a part without one is typed by its single media key
    (`{"image_url": ...}`), so such media is disaggregated too."""
    if "type" in part:
        return part["type"]
    keys = [key for key in MEDIA_TYPES if key in part]
    return keys[0] if len(keys) == 1 else None


def validate_request(body: Any, *, trust_client_fields: bool, max_media_items: int = 0) -> dict[str, Any]:
    """Reject what vLLM would choke on later with a clear 400, before any backend is called."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise BadRequest("'stream' must be a boolean")
    if not trust_client_fields:
        for name in ENGINE_ONLY_FIELDS:
            if body.get(name) is not None:
                raise BadRequest(
                    f"'{name}' is set by the proxy, not by clients "
                    "(start the proxy with --trust-client-fields if a trusted router sits in front)"
                )
    media_items = 0
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{m}] must be an object")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"messages[{m}].content[{p}] must be an object")
            if "type" in part and not isinstance(part["type"], str):
                raise BadRequest(f"messages[{m}].content[{p}].type must be a string")
            kind = part_kind(part)
            if kind in EMBEDS_TYPE:
                media_items += 1
                if max_media_items and media_items > max_media_items:
                    raise BadRequest(f"the request has more than {max_media_items} media items")
            if kind in URL_MEDIA_TYPES:
                url = media_url(part, kind)
                if not url:
                    raise BadRequest(f"messages[{m}].content[{p}] is '{kind}' without a '{kind}.url'")
            elif kind == "input_audio":
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise BadRequest(f"messages[{m}].content[{p}] is 'input_audio' without 'input_audio.data'")
            elif kind in EMBEDS_TYPES and not trust_client_fields:
                raise BadRequest(
                    f"messages[{m}].content[{p}] is '{kind}': embeddings references are made by the proxy, "
                    "not sent by clients"
                )
    return body


def extract_media(body: dict[str, Any], *, honour_client_uuid: bool = False) -> list[MediaItem]:
    """All media items in global order. Assumes `validate_request` accepted the body."""
    items: list[MediaItem] = []
    for m, message in enumerate(body["messages"]):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            kind = part_kind(part)
            if kind not in EMBEDS_TYPE:
                continue
            client_uuid = part.get("uuid") if honour_client_uuid else None
            uuid = client_uuid if isinstance(client_uuid, str) and client_uuid else content_uuid(part, kind)
            items.append(MediaItem(len(items), kind, part, uuid, m, p))
    return items
