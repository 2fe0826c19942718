"""One request's journey: route → plan → encode → match → rewrite → prefill → decode, with retries.

What the consumer can reuse is not encoded (reuse.py): routing sends a conversation where its
earlier turns ran, and their images go to it raw under their uuids.

Every attempt starts again from the client's untouched body, so a retry never inherits the
previous attempt's transfer ids, EC handles or KV block ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeVar

from epd_proxy.calls.sse import Verdict
from epd_proxy.calls.upstream import REFUSED_ANSWER, NoAnswer, Timeouts, Upstream
from epd_proxy.errors import ErrorAnswer, ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.health import Health, counts_against_instance
from epd_proxy.fleet.kv_holds import MediaDepths
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.prefill_cost import Prompt, PromptSize
from epd_proxy.fleet.registry import Registry
from epd_proxy.fleet.routing import INDEX, RECORD, Policies, PrefixAffinity
from epd_proxy.fleet.windows import Windows
from epd_proxy.journey.decode import DecodeAnswer, EngineCall, hold_head, open_decode
from epd_proxy.journey.doors import CHAT, Door
from epd_proxy.journey.encode import EncodeStep, request_priority
from epd_proxy.journey.extract import MediaItem
from epd_proxy.journey.held import HeldMedia, Known, index_uuids, media_names
from epd_proxy.journey.inflight import InFlight
from epd_proxy.journey.match import Matches, match_groups
from epd_proxy.journey.plan import plan_groups
from epd_proxy.journey.prefill import run_prefill
from epd_proxy.journey.relay import Listener, Usage
from epd_proxy.journey.render import Renderer
from epd_proxy.journey.reuse import (
    EncodePlan,
    consumer_may_encode,
    conversation_key,
    plan_encode,
    raw_modalities,
    swamped,
)
from epd_proxy.journey.route import ClientBody, Route, choose
from epd_proxy.journey.subrequest import EncodeOptions
from epd_proxy.journey.trace import Trace
from epd_proxy.ops.metrics import Metrics

log = logging.getLogger("epd_proxy.pipeline")
T = TypeVar("T")


def _unavailable(message: str) -> ProxyError:
    return ProxyError(503, message, stage="route", error_type="service_unavailable")


@dataclass(eq=False)
class Pipeline:
    fleet: Registry
    health: Health
    upstream: Upstream
    policies: Policies
    metrics: Metrics
    _: KW_ONLY
    encoding: EncodeOptions
    prefill_timeouts: Timeouts
    decode_timeouts: Timeouts
    decode_retries: int
    rewrite: bool
    lanes: Lanes | None = None
    reuse: bool = True
    consumer_encode: bool = True
    consumer_encode_after_s: float = 10.0
    # Modalities no consumer is sent raw (--no-raw-media, --text-only-consumers); a consumer's own
    # probe adds its own (Instance.raw_refused).
    no_raw_media: frozenset[str] = frozenset()
    # What this process saw the fleet hold, and the names it is encoding now.
    held: HeldMedia = field(default_factory=HeldMedia)
    in_flight: InFlight = field(default_factory=InFlight)
    # What each consumer's KV events say it holds (kv_holds.py); None without KV events.
    kv_holds: MediaDepths | None = None
    # With --tenants: how many requests each consumer prefills at once while tenants compete.
    windows: Windows | None = None
    # How many tokens a prompt takes, learnt from the usage answers report.
    prompt_size: PromptSize = field(default_factory=PromptSize)
    # With --render-urls: where prompts are rendered before placement.
    renderer: Renderer | None = None

    def __post_init__(self) -> None:
        self.encode = EncodeStep(
            self.upstream,
            self.metrics,
            self.policies[ENCODE],
            lambda: self.candidates(ENCODE),
            self._call,
            options=self.encoding,
            lanes=self.lanes,
            stalled=lambda encoder: self.health.answered(encoder, 504, "a sub-request far past its expected time"),
        )
        # Whether routing reads the conversation key, which costs a digest of the opening messages.
        self._keyed = any(isinstance(policy, PrefixAffinity) for policy in self.policies.values())
        for policy in self.policies.values():
            if isinstance(policy, PrefixAffinity):
                policy.holds = self.kv_holds
                policy.decided = lambda source: self.metrics.decided("placement", source)

    def candidates(self, role: str) -> Sequence[Instance]:
        """The registry's members of a role that health lets take traffic now."""
        return self.health.available(self.fleet.members(role))

    def decoders(self) -> Sequence[Instance]:
        """Where a request's answer comes from: combined PD instances first, else split decoders."""
        return self.candidates(PREFILL_DECODE) or self.candidates(DECODE)

    async def place(self, job: ClientBody, trace: Trace, door: Door = CHAT) -> Route:
        """`choose_route`, the prompt rendered first where a render server says what the KV index
        is asked (--render-urls with prefix_affinity and KV events)."""
        renderer = self.renderer
        if renderer is not None and self._keyed and self.kv_holds is not None and job.rendered is None:
            # With one instance to choose there is nothing to sharpen.
            if len(self.candidates(PREFILL) or self.decoders()) > 1:
                with trace.stage("render"):
                    job.rendered = await renderer.render(job, door)
        return self.choose_route(trace.request_id, job, door)

    def choose_route(
        self, request_id: str, job: ClientBody | None = None, door: Door = CHAT, avoid: Sequence[Instance] = ()
    ) -> Route:
        """The consumer where the request's first token comes soonest (prefix_affinity: what it
        holds of the prompt, and the work queued on it), or by load; in E+P+D the prefix is
        prefill's, and a split decode instance goes by load. Where the conversation lies in the
        body is the `door`'s to say. Instances in `avoid` are not chosen."""
        key: str | None = request_id
        prompt = Prompt(0.0)
        # Only prefix_affinity weighs a prompt; the other policies go by load alone.
        if self._keyed and job is not None and job.body is not None:
            rendered = job.rendered
            tokens = len(rendered.tokens) if rendered else self.prompt_size.tokens(job.text_chars, job.media_cost)
            media = list(index_uuids(job.body, job.items, self.kv_holds.adapter).values()) if self.kv_holds else []
            prompt = Prompt(tokens, media, rendered)
            key = conversation_key(job.body.get("model"), door.conversation(job.body), job.items)
        candidates = [c for c in self.decoders() if c not in avoid]
        if not candidates:
            raise _unavailable("no live decode instance")
        combined = candidates[0].role == PREFILL_DECODE
        decoder, work, turn = choose(self.policies[DECODE], candidates, key if combined else None, prompt)
        prefill = None
        if decoder.role == DECODE:
            prefills = [c for c in self.candidates(PREFILL) if c not in avoid]
            if not prefills:
                raise _unavailable("no live prefill instance for the standalone decode instance")
            prefill, work, turn = choose(self.policies[PREFILL], prefills, key, prompt)
        # Dynamic mode pins the EC consumer (prefill in E+P+D, else the decoder) as registered;
        # static mode's replica flags describe the decode servers, as in the reference.
        pinned = (prefill or decoder) if self.fleet.dynamic else decoder
        dp_rank = pinned.next_dp_rank() if pinned.dp_size > 1 else None
        consumer_zmq = pinned.zmq_addrs[dp_rank or 0] if pinned.zmq_addrs else None
        return Route(decoder, prefill, pinned, dp_rank, consumer_zmq, claim=work, turn=turn)

    def usage(self, job: ClientBody, tenant: str | None, door: Door = CHAT) -> Listener | None:
        """What hears the tokens an answer reports: its tenant's charge (with --tenants, `tenant`
        counted in the ledger), and the prompt sizes placement estimates (prefix_affinity). Where
        someone listens, the consumer is asked to report them (`door.ask_usage`, on the body)."""
        fairness = self.lanes.fairness if self.lanes is not None and tenant is not None else None
        sized = self._keyed and job.media_cost > 0
        if (fairness is None and not sized) or job.body is None:
            return None
        chars, cost = job.text_chars, job.media_cost

        def heard(used: Usage) -> None:
            if fairness is not None and tenant is not None:
                fairness.charge_tokens(tenant, used.prompt, used.output)
            if sized:
                self.prompt_size.observe(chars, cost, used.prompt + used.cached)

        return Listener(heard, door.ask_usage(job.body))

    async def _call(self, instance: Instance, call: Awaitable[T], trace: Trace) -> T:
        """Await a backend call, feeding its outcome to passive outlier detection: a transport
        failure, or the status the instance answered. Errors the proxy found on its own (an
        unwritable body, a timeout after connecting) say nothing about the instance."""
        try:
            result = await call
        except NoAnswer as exc:
            if counts_against_instance(exc.kind):
                self.health.failed(instance, exc.reason)
            elif exc.kind == REFUSED_ANSWER:
                # What it sent is refused as a 502 would be: a gateway failure of that instance.
                self._answered(instance, 502, exc.reason, trace)
            raise
        except ProxyError as exc:
            # A refusal for load (ErrorAnswer.busy) says nothing about the instance's health.
            if exc.answered is not None and not (isinstance(exc, ErrorAnswer) and exc.busy):
                self._answered(instance, exc.answered, exc.message, trace)
            raise
        self.health.succeeded(instance)
        return result

    def _turn(
        self, consumer: Instance | None, trace: Trace, body: dict[str, Any]
    ) -> AbstractAsyncContextManager[object]:
        """A place in `consumer`'s prefill window (fleet/windows.py), while tenants compete."""
        if self.windows is None or consumer is None:
            return nullcontext()
        return self.windows.turn(consumer.url, trace.tenant, request_priority(body))

    def _answered(self, instance: Instance, status: int, message: str, trace: Trace) -> None:
        if status >= 500:
            if instance.url in trace.charged_5xx:
                return
            trace.charged_5xx.add(instance.url)
        self.health.answered(instance, status, message)

    async def open(self, job: ClientBody, route: Route, trace: Trace, door: Door = CHAT) -> DecodeAnswer:
        """Run attempts until decode commits (`decode.hold_head`), then let go of the client's body.
        Another attempt (fresh encode, fresh transfer ids) follows a consumer's 500, or a stream
        that reports an error in-band before generating anything, as vLLM reports the same failure
        once it has answered 200."""
        known = self._known(job, route)
        attempts = self.decode_retries + 1
        attempt, cut_before = 1, False
        while True:
            trace.attempts = attempt
            prefill_headers, decode_headers = route.headers(trace.request_id)
            push_mode = route.consumer_zmq is not None
            matches = await self._encode(job, route, trace, known)
            with trace.stage("rewrite"):
                prepared = door.consumer_body(job.body, job.items, matches, rewrite=self.rewrite, push_mode=push_mode)
            try:
                decode_body = prepared
                if route.prefill is not None:
                    to_prefill = EngineCall(
                        route.prefill, prepared, prefill_headers, self.prefill_timeouts, job.dumps, door.path
                    )
                    with trace.stage("prefill", route.prefill, attempt=attempt):
                        route.hold_prefill()  # again on a retry
                        try:
                            async with self._turn(route.prefill, trace, prepared):
                                sent = time.monotonic()
                                kv = await self._call(
                                    route.prefill, run_prefill(self.upstream, to_prefill, door.prefill_body), trace
                                )
                                route.prefilled(sent, time.monotonic())
                        finally:
                            route.release_prefill()
                    if kv:
                        decode_body = {**prepared, "kv_transfer_params": kv}
                to_decode = EngineCall(
                    route.decoder, decode_body, decode_headers, self.decode_timeouts, job.dumps, door.path
                )
                with trace.stage("decode", route.decoder, attempt=attempt) as decoding:
                    # A PD prefills too: its window holds the request until the first token.
                    async with self._turn(None if route.prefill else route.decoder, trace, prepared):
                        sent = time.monotonic()
                        answer = await self._call(route.decoder, open_decode(self.upstream, to_decode), trace)
                        if answer.streaming:
                            # vLLM answers a stream's headers before its engine runs: the first token
                            # is a later moment of its own.
                            decoding.event("headers")
                        try:
                            verdict, in_band = await self._call(route.decoder, hold_head(answer, door.judge), trace)
                        except BaseException:
                            answer.release()
                            raise
                        if verdict is Verdict.COMMIT:
                            if answer.streaming:
                                decoding.event("first_token")
                            route.prefilled(sent, time.monotonic())
                # vLLM aborted the answer (a pause, a shutdown): the client has none of it, and
                # another instance may answer it whole. Cut partway, it moves once: under vLLM's
                # fault tolerance an engine failure aborts what it runs, and this may be the cause.
                movable = verdict is Verdict.NOTHING or (verdict is Verdict.CUT and not cut_before)
                if movable and self._elsewhere(job, door, route, trace, answer.backend, verdict.value):
                    cut_before = cut_before or verdict is Verdict.CUT
                    answer.release()
                    known = self._known(job, route)
                    continue
                if in_band is not None and attempt < attempts:
                    answer.release()
                    self._note_retry(route, trace, "decode", "reported an error in its stream", in_band.get("message"))
                    attempt += 1
                    continue
                if known.names:
                    names = known.names
                    self.held.sent(route.consumer.url, (names[item.index] for item in job.items if item.is_image))
                job.release()
                # A refused or retried attempt's raw media reached no answer: only this one counts.
                self.metrics.reused.inc(trace.reused)
                self.metrics.consumer_encoded.inc(trace.consumer_encoded)
                return answer
            except ErrorAnswer as exc:
                if exc.busy and self._elsewhere(job, door, route, trace, exc.backend, "busy, answered 503"):
                    known = self._known(job, route)
                    continue
                # A consumer answers 500 when an embedding it was promised never arrived:
                # re-encoding republishes it, so 500 (and only 500) is worth another attempt.
                if exc.status != 500 or attempt == attempts:
                    raise
                self._note_retry(route, trace, exc.stage, "answered 500", exc.message)
                attempt += 1
            except NoAnswer as exc:
                # A consumer that read none of the request (stopped, restarting, its connection
                # slots full) cannot have been broken by it: the request goes to another, as
                # aiohttp and httpcore resend only what was never sent. One that may have read it
                # is not tried again anywhere: the request may be what broke it.
                if exc.sent or not self._elsewhere(job, door, route, trace, exc.backend, exc.reason):
                    raise
                known = self._known(job, route)  # a move is not one of the retries above

    def _elsewhere(
        self, job: ClientBody, door: Door, route: Route, trace: Trace, backend: str | None, why: str
    ) -> bool:
        """Move `route` off `backend`, an instance that did not answer the request (`why`), to
        where placement puts it among those not passed over yet; False when there is none."""
        gone = route.pass_over(backend)
        if gone is None:
            return False
        try:
            elsewhere = self.choose_route(trace.request_id, job, door, avoid=route.passed_over)
        except ProxyError:
            return False
        stage = "prefill" if gone is route.prefill else "decode"
        self.metrics.retries.labels(stage).inc()
        moved = f"{stage} {gone.url} did not answer it ({why}); it goes to {elsewhere.consumer.url} instead"
        log.warning("request %s: %s", trace.request_id, moved)
        route.move(elsewhere)
        return True

    async def _encode(self, job: ClientBody, route: Route, trace: Trace, known: Known) -> Matches:
        """Encode what the consumer cannot reuse. When the encoders fail (after failover), the
        consumer that may take the media raw encodes them instead, but only media no encoder
        received: a request is not lost to a stopped encoder tier, and input that broke an
        encoder (an answered 5xx, a drop or a timeout after it was sent) never reaches the
        consumer, which it could take down as well."""
        plan = self._plan_encode(job, route, trace, known.held)
        try:
            matches = await self._encode_items(job, plan.encode, route, trace, known.names)
        except ProxyError as exc:
            if not (self.consumer_encode and plan.raw):
                raise
            if not consumer_may_encode(plan, exc, trace.media_failed_on):
                if trace.media_failed_on is not None:
                    log.warning(
                        "request %s: encoder %s received its media and failed them; they are not handed to the "
                        "consumer (%s)",
                        trace.request_id,
                        trace.media_failed_on,
                        exc.message[:200],
                    )
                raise
            log.warning(
                "request %s: no encoder took its media (%s); the consumer encodes", trace.request_id, exc.message[:200]
            )
            # What was planned for the encoders goes raw too; what the consumer holds stays reused.
            fallback = plan.consumer_encoded + len(plan.encode)
            plan, matches = EncodePlan((), plan.raw, reused=plan.reused, consumer_encoded=fallback), Matches()
        # The attempt's own figures: counted in /metrics only if its answer goes to the client.
        trace.reused = plan.reused
        trace.consumer_encoded = plan.consumer_encoded
        return matches

    def _known(self, job: ClientBody, route: Route) -> Known:
        """Names only where the consumer may get media raw under them: rewritten, and not pushed."""
        if not (self.rewrite and route.consumer_zmq is None and job.items):
            return Known()
        assert job.body is not None  # released only once decode commits
        names = media_names(job.body, job.items)
        if not (names and self.reuse):
            return Known(names)
        depth: dict[int, int | None] = {}
        heard_at = None
        if self.kv_holds is not None and (uuids := index_uuids(job.body, job.items, self.kv_holds.adapter)):
            # A pinned replica alone holds what this request finds there.
            ranks = (route.dp_rank,) if route.dp_rank is not None and route.pinned is route.consumer else None
            depth = dict(zip(uuids, self.kv_holds(route.consumer.url, list(uuids.values()), ranks)))
            heard_at = self.kv_holds.heard_at(route.consumer.url, ranks)
        holding = self.held.held(job.items, names, route.consumer.url, depth, heard_at)
        self.metrics.decided("reuse", INDEX, holding.by_index)
        self.metrics.decided("reuse", RECORD, holding.by_record)
        self.metrics.decided("encode_again", INDEX, holding.lost)
        return Known(names, holding.held)

    def _plan_encode(self, job: ClientBody, route: Route, trace: Trace, held: frozenset[int]) -> EncodePlan:
        raw: frozenset[str] = frozenset()
        if self.rewrite and route.consumer_zmq is None:
            consumers = (route.decoder,) if route.prefill is None else (route.prefill, route.decoder)
            refused = self.no_raw_media.union(*(consumer.raw_refused for consumer in consumers))
            raw = raw_modalities(job.items, refused)
        last_resort = False
        # Media an encoder failed on an earlier attempt never go raw.
        if raw and self.consumer_encode and job.items and trace.media_failed_on is None:
            encoders = self.candidates(ENCODE)
            last_resort = swamped(self.encode.lanes, encoders, self.consumer_encode_after_s, self.encode.clock())
        return plan_encode(job.items, held=held, raw=raw, last_resort=last_resort)

    async def _encode_items(
        self,
        job: ClientBody,
        items: Sequence[MediaItem],
        route: Route,
        trace: Trace,
        names: Mapping[int, str] | None,
    ) -> Matches:
        """The embeddings of `items`: those another request is encoding now taken from it, the rest
        placed, grouped, encoded and matched. What was encoded is held from then on."""
        if not items:
            return Matches()
        # Timed however it ends: a failure after 5 s logs its 5 s.
        with trace.stage("encode", attempt=trace.attempts, items=len(items)):
            if names is None:
                return await self._encode_own(job, items, route, trace)
            matches = await self.in_flight.encode(
                items,
                names,
                lambda own: self._encode_own(job, own, route, trace),
                self.encode.ids.transfer_id,
                trace,
            )
            self.held.encoded(names[i] for i, match in matches.items.items() if match.ec_mm_hash is not None)
            return matches

    async def _encode_own(self, job: ClientBody, items: Sequence[MediaItem], route: Route, trace: Trace) -> Matches:
        """Plan (placement, then groups), encode, match."""
        assert job.body is not None  # released only once decode commits
        assignment = self.encode.place(items, trace, request_priority(job.body), avoid=route.unpushed)
        cap = self.encode.lanes.group_cap(self.encoding.max_batch_size, self.encode.clock())
        groups = plan_groups(items, assignment, cap)
        route.pushers.update(group.encoder for group in groups)  # read in push mode only
        answers = await self.encode.run(job.body, items, groups, route.consumer_zmq, trace, job.dumps)
        return match_groups(
            job.body, items, [group.indices for group in groups], answers, push_mode=route.consumer_zmq is not None
        )

    def _note_retry(self, route: Route, trace: Trace, stage: str, what: str, message: Any) -> None:
        route.push_failed()
        self.metrics.retries.labels(stage).inc()
        log.warning(
            "request %s: %s %s (%s); re-encoding, attempt %d of %d",
            trace.request_id,
            stage,
            what,
            str(message)[:200],
            trace.attempts + 1,
            self.decode_retries + 1,
        )
