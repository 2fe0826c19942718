"""What the consumer can reuse, so the fleet does not do it again (pure).

Three decisions per attempt, from the request, the fleet's counters and what this process saw
the fleet hold (held.py, handed in as a set of items). Where a conversation opens is its door's to
say (doors.Conversation, over chat messages, Responses input items or Anthropic messages).

- **The conversation key** (`conversation_key`): the conversation's opening (the system prompt,
  and every entry up to and including the first user entry, media as their uuids), identical on
  every turn. The `prefix_affinity` policy hashes it and remembers where its last turn ran, so
  every turn goes where its prefix KV already is.
- **Reuse** (`plan_encode`): an image the fleet holds (held.py: this process saw it encoded, so
  the EC store has it under its name, or sent to this very consumer) goes to the consumer raw
  under that name instead of to an encoder again, whatever its place in the conversation (a
  history the client wrote counts for nothing). vLLM's scheduler
  (v1/core/sched/scheduler.py `_try_schedule_encoder_inputs`) then needs no encoder output for it
  when it lies inside the prefix-cached tokens, loads it when the EC connector has it
  (`has_cache_item`, keyed by that name), and only otherwise encodes it locally: raw media under
  a known name can cost the consumer work, never a failure, where a `*_embeds` reference nobody
  backed in this attempt can kill the engine. vLLM refuses raw and embedded items of one
  modality in one request, so the request's other images go raw too; they are still encoded
  first, and the consumer loads them from the EC store by name.
- **The consumer as encoder of last resort**: when no encoder is in rotation, or every one is
  queued beyond a bound (its backlog, lanes.Lane.backlog_s: an encoder that never answered is
  behind by at least its silence), every item goes raw
  and the consumer encodes what it has not seen. When the encoders fail an attempt, the consumer
  takes over only media no encoder has received (`consumer_may_encode`): input that broke one
  encoder must not reach the consumer next.

What a consumer takes raw is per modality (`raw_modalities`): vLLM refuses raw items of a modality
whose limit per prompt is 0 with a 400 (`multimodal/processing/context.py` `validate_num_items`),
which `--language-model-only` sets for all. Those modalities are the operator's flags or the
fleet's probe (fleet/capabilities.py), never a consumer's answer to a client's request. Nothing
goes raw in Mooncake push mode, where every item the consumer reads must arrive by a push of this
attempt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.calls.upstream import NoAnswer
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.journey.doors import Conversation
from epd_proxy.journey.extract import MediaItem, with_parts_replaced


def conversation_key(model: Any, conversation: Conversation, items: Sequence[MediaItem]) -> str | None:
    """A digest of the conversation's opening (its door's `Conversation`), its media as their
    uuids, or None when it has no user entry."""
    n = conversation.opening
    if not n:
        return None
    # Media by name: the same on every turn, however a body's media were lifted out (splice.py).
    named = {item.place: item.uuid for item in items if item.place.entry < n}
    opening = with_parts_replaced(list(conversation.entries[:n]), named)
    try:
        text = orjson.dumps([model, conversation.preamble, opening])
    except orjson.JSONEncodeError:
        return None
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def swamped(lanes: Lanes, encoders: Sequence[Instance], bound_s: float, now: float) -> bool:
    """No encoder, or every one's backlog (`Lane.backlog_s`, what /metrics shows) beyond `bound_s`."""
    return all(backlog > bound_s for backlog in lanes.backlogs([lanes.of(e) for e in encoders], now))


def raw_modalities(items: Sequence[MediaItem], refused: Collection[str]) -> frozenset[str]:
    """The modalities of `items` the consumer may get raw, given those it `refused`. With audio in
    the request the rewrite references every item or none (rewrite.referenced), so there one
    refused modality keeps every item encoded."""
    present = {item.modality for item in items}
    if "audio" in present and not present.isdisjoint(refused):
        return frozenset()
    return frozenset(present.difference(refused))


def failed_holding_media(failure: BaseException | None) -> bool:
    """Whether an encoder received a sub-request's media and failed them: it answered a 5xx, or the
    exchange broke or timed out after the request was written. A connection refused, a wait for
    one, or an answered 4xx (the input refused cleanly) says nothing against the media."""
    if isinstance(failure, NoAnswer):
        return failure.sent
    return isinstance(failure, ProxyError) and failure.answered is not None and failure.answered >= 500


@dataclass(frozen=True, slots=True)
class EncodePlan:
    """What one attempt sends to encoders; the rest goes raw to the consumer under its uuid."""

    encode: Sequence[MediaItem]
    # The modalities the consumer may be sent raw.
    raw: frozenset[str] = frozenset()
    # Items the consumer gets raw because the fleet holds them, and because no encoder can take
    # them in time (last resort).
    reused: int = 0
    consumer_encoded: int = 0


def consumer_may_encode(plan: EncodePlan, failure: ProxyError, failed_on: str | None) -> bool:
    """Whether the items the encoders failed go raw to the consumer instead: only when it takes
    raw media of each of their modalities, and no encoder has received them. A refused connection
    hands nothing on; an answered error, a reset or a timeout after the media were sent (now, or
    earlier in the request: `failed_on`) is the request's answer."""
    return (
        failed_on is None
        and isinstance(failure, NoAnswer)
        and not failure.sent
        and all(item.modality in plan.raw for item in plan.encode)
    )


def plan_encode(
    items: Sequence[MediaItem],
    *,
    held: Collection[int],
    raw: frozenset[str],
    last_resort: bool,
) -> EncodePlan:
    """`held`: the indices of items the consumer can take without an encoder (HeldMedia.held;
    empty with --no-reuse); `raw`: the modalities the consumer may be sent raw
    (`raw_modalities`; none in push mode); `last_resort`: no encoder can take the items (see
    `swamped`) and the consumer encodes those it may get raw."""
    if not items or not raw:
        return EncodePlan(items)
    if last_resort:
        encode = [item for item in items if item.modality not in raw]
        return EncodePlan(encode, raw=raw, consumer_encoded=len(items) - len(encode))
    if "image" not in raw:
        return EncodePlan(items, raw=raw)
    fresh = [item for item in items if not (item.is_image and item.index in held)]
    return EncodePlan(fresh, raw=raw, reused=len(items) - len(fresh))
