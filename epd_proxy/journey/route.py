"""A request's route through the consumers, and the client's body it carries: the choice of
prefill / decode instance (pipeline.Pipeline.choose_route) and what that choice holds on them
until the request's first token and its end."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from epd_proxy.calls.upstream import Payload
from epd_proxy.errors import BadRequest
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.prefill_cost import Prompt, Turn, claim
from epd_proxy.fleet.rendered import Rendered
from epd_proxy.fleet.routing import PrefixAffinity, ServingPolicy
from epd_proxy.journey.extract import MediaItem, media_url
from epd_proxy.journey.splice import Spliced

DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(slots=True)
class Route:
    decoder: Instance
    prefill: Instance | None
    # The instance whose data-parallel replica is pinned; it alone gets X-data-parallel-rank.
    pinned: Instance
    dp_rank: int | None
    # Where the encoders push (Mooncake): an address of the EC consumer's pinned replica.
    consumer_zmq: str | None
    # The prefill work the request brings its consumer (fleet/prefill_cost.py), in tokens, and
    # its conversation's record of it (prefix_affinity), told of its first token.
    claim: float = 0.0
    turn: Turn | None = None
    # Whether this route counts in the prefill instance's load now (`held`), and whether its claim
    # is still queued on the consumer (until its first token).
    prefill_held: bool = False
    claimed: bool = False
    holding: bool = False
    # Instances that did not answer the request (refused it, had no room, aborted it): not chosen
    # for it again.
    passed_over: list[Instance] = field(default_factory=list)
    # Push mode: the encoders the attempt's pushes came from, and those a consumer's 500 after
    # them passed over (their push may never land: a producer that cannot reach the consumer
    # answers 200 all the same), which the next attempt's encode avoids while another is live.
    pushers: set[Instance] = field(default_factory=set)
    unpushed: set[Instance] = field(default_factory=set)

    @property
    def consumer(self) -> Instance:
        """The instance that reads the media and holds the prompt's prefix: prefill in E+P+D."""
        return self.prefill or self.decoder

    @contextmanager
    def held(self) -> Iterator[None]:
        """The chosen instances count as loaded (`Instance.inflight` and the consumer's
        `prefill_queue`, what the policies read) from the choice on, not from when their call
        starts: an E+P+D request's prefill is called only after its encode, and requests chosen
        meanwhile must see it taken. Decode is held to the end of the answer, prefill until its
        call ends (`pipeline.open` lets it go), the claim until the first token (`prefilled`)."""
        self._take()
        try:
            yield
        finally:
            self._leave()

    def headers(self, request_id: str) -> tuple[dict[str, str], dict[str, str]]:
        """Prefill's and decode's headers: the pinned instance alone is told its replica."""
        headers = {"x-request-id": request_id, "Content-Type": "application/json"}
        if self.dp_rank is None:
            return headers, headers
        pinned = {**headers, DP_RANK_HEADER: str(self.dp_rank)}
        return (pinned, headers) if self.pinned is self.prefill else (headers, pinned)

    def push_failed(self) -> None:
        """The consumer answered 500 after this attempt's pushes: their encoders are avoided next."""
        if self.consumer_zmq is not None:
            self.unpushed |= self.pushers
        self.pushers = set()

    def pass_over(self, url: str | None) -> Instance | None:
        """The route's instance at `url`, now passed over for this request (None: not one of them)."""
        gone = next((c for c in (self.prefill, self.decoder) if c is not None and c.url == url), None)
        if gone is not None:
            self.passed_over.append(gone)
        return gone

    def move(self, to: Route) -> None:
        """The request leaves its instances for `to`'s (held from now, if these were)."""
        holding = self.holding
        if holding:
            self._leave()
        self.decoder, self.prefill, self.pinned = to.decoder, to.prefill, to.pinned
        self.dp_rank, self.consumer_zmq, self.claim, self.turn = to.dp_rank, to.consumer_zmq, to.claim, to.turn
        if holding:
            self._take()

    def _take(self) -> None:
        self.decoder.inflight += 1
        self.hold_prefill()
        self.consumer.prefill_queue += self.claim
        self.claimed = self.holding = True

    def _leave(self) -> None:
        self.decoder.inflight -= 1
        self.release_prefill()
        self._unclaim()
        self.holding = False

    def hold_prefill(self) -> None:
        if self.prefill is not None and not self.prefill_held:
            self.prefill.inflight += 1
            self.prefill_held = True

    def release_prefill(self) -> None:
        if self.prefill is not None and self.prefill_held:
            self.prefill.inflight -= 1
            self.prefill_held = False

    def prefilled(self, sent: float, done: float) -> None:
        """The consumer, called at `sent`, gave the first token at `done`: its claim is worked off,
        and what it took measures the consumer's speed (once per request: a retry's first token
        came after another attempt's work)."""
        if self.claimed:
            self.consumer.prefill_speed.observe(self.claim, sent, done)
        if self.turn is not None and self.turn.prefilled_at is None:
            self.turn.prefilled_at = done
        self._unclaim()

    def _unclaim(self) -> None:
        if self.claimed:
            self.consumer.prefill_queue -= self.claim
            self.claimed = False


@dataclass(slots=True)
class ClientBody:
    """The client's parsed body and its media items, held only while a retry may still need them:
    a multi-image body is megabytes of base64 that a long stream must not keep alive."""

    body: dict[str, Any] | None
    items: Sequence[MediaItem] = ()
    # With splice, the client's buffer the body's media tokens point into (see splice.py).
    spliced: Spliced | None = None
    # The characters of the client's body that are not media (`text_chars`): its prompt's text.
    text_chars: int = 0
    # Its media's image-equivalents (fleet/cost.py), kept when the items are let go.
    media_cost: float = field(init=False)
    # Its prompt as a render server rendered it (journey/render.py), for placement.
    rendered: Rendered | None = None

    def __post_init__(self) -> None:
        self.media_cost = sum(item.cost for item in self.items)

    def release(self) -> None:
        self.body = None
        self.items = ()
        self.spliced = None
        self.rendered = None

    def dumps(self, obj: Any) -> Payload:
        """A body for a backend: media go out as the client's own bytes where they were spliced."""
        try:
            return self.spliced.dumps(obj) if self.spliced is not None else orjson.dumps(obj)
        except orjson.JSONEncodeError as exc:
            # Only the client's own values can be unwritable: JSON nested deeper than orjson
            # writes (254 levels), which orjson reads (1024) and vLLM might too.
            raise BadRequest(f"the request cannot be forwarded: it nests too deeply ({exc})") from None


def text_chars(size: int, items: Sequence[MediaItem], spliced: Spliced | None) -> int:
    """A body's characters less its media's URLs, as the client sent it (before the proxy fetched
    any http media): what its prompt's text tokens are estimated from."""
    media = 0
    for item in items:
        url = media_url(item.part, item.kind) or _audio_data(item.part.get(item.kind))
        lifted = spliced.bytes_of(url) if spliced is not None else None
        media += len(lifted) if lifted is not None else len(url)
    return max(0, size - media)


def _audio_data(value: Any) -> str:
    data = value.get("data") if isinstance(value, dict) else None
    return data if isinstance(data, str) else ""


def choose(
    policy: ServingPolicy, candidates: Sequence[Instance], key: str | None, prompt: Prompt
) -> tuple[Instance, float, Turn | None]:
    """One pick, the prefill work it brings there and its record; a policy that weighs prefill
    costs is told the request's prompt."""
    if key is not None and isinstance(policy, PrefixAffinity):
        placement = policy.place(candidates, key, prompt)
        return placement.instance, placement.claim, placement.turn
    return policy.choose(candidates, (key,))[0], claim(prompt.tokens, 0.0), None
