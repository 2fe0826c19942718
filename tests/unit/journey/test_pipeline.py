"""One request's journey (pipeline.py) against scripted backends: routing, encoder failover, the
retry rules, and what the health of each instance learns from it."""

from __future__ import annotations

import pytest

from epd_proxy.calls.upstream import CONNECT_TIMEOUT, HEADERS_TIMEOUT, REFUSED, REFUSED_ANSWER, NoAnswer
from epd_proxy.config import Config
from epd_proxy.errors import BadRequest, ErrorAnswer, ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry
from epd_proxy.fleet.routing import LeastLoaded, RoundRobin
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.pipeline import ClientBody, Trace
from epd_proxy.journey.route import DP_RANK_HEADER
from epd_proxy.ops.metrics import Metrics
from epd_proxy.proxy import build_pipeline
from tests.media import chat, image
from tests.unit.scripted_upstream import Reply, ScriptedUpstream, json_reply, stream_reply

E1, E2, PD, P, D = "http://e1", "http://e2", "http://pd", "http://p", "http://d"
ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
VLLM_ERROR = b'data: {"error":{"message":"EC load failed","code":500}}\n\n'
ENCODED = json_reply({"ec_transfer_params": {}})
STREAM = stream_reply(ROLE, TOKEN, DONE)
KV = {"remote_engine_id": "e", "remote_block_ids": [7]}


def failed_with(status: int) -> Reply:
    return Reply(status, (b'{"error":{"message":"status %d"}}' % status,))


class RecordingHealth(Health):
    """Health as the pipeline feeds it, with every report the pipeline made kept."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.reports: list[tuple] = []
        self._answering = False

    def succeeded(self, inst) -> None:
        if not self._answering:  # Health takes a 4xx answer as a success itself
            self.reports.append(("ok", inst.url))
        super().succeeded(inst)

    def answered(self, inst, status: int, detail: str = "") -> None:
        self.reports.append(("answered", inst.url, status))
        self._answering = True
        try:
            super().answered(inst, status, detail)
        finally:
            self._answering = False

    def failed(self, inst, reason: str) -> None:
        self.reports.append(("failed", inst.url, reason.split(":")[0]))
        super().failed(inst, reason)


class Journey:
    """A pipeline over a static fleet whose backends answer from scripts."""

    def __init__(self, policies=None, **fields) -> None:
        fields.setdefault("encode_urls", (E1, E2))
        fields.setdefault("decode_urls", (PD,))
        self.config = Config(**fields)
        self.fleet = Registry.from_config(self.config)
        self.health = RecordingHealth()
        self.fleet.watch(self.health)
        self.upstream = ScriptedUpstream()
        self.metrics = Metrics(self.fleet, self.health)
        policies = policies or {ENCODE: RoundRobin(), PREFILL: LeastLoaded(), DECODE: LeastLoaded()}
        self.pipeline = build_pipeline(self.config, self.fleet, self.health, self.upstream, policies, self.metrics)

    def take_encoders_out(self) -> None:
        """Every encoder fails its health checks until it is out of rotation."""
        for encoder in self.fleet.members(ENCODE):
            for _ in range(self.health.fail_threshold):
                self.health.checked(encoder, "connection refused")

    def script(self, url: str, *replies: Reply) -> None:
        self.upstream.script(url, *replies)

    async def run(self, body: dict, request_id: str = "req-1"):
        job = ClientBody(body, normalise_request(body).items)
        route = self.pipeline.choose_route(request_id, job)
        trace = Trace(request_id)
        try:
            answer = await self.pipeline.open(job, route, trace)
        finally:
            self.trace, self.job = trace, job
        return answer

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


# -- routing ------------------------------------------------------------------------------------------


async def test_a_text_only_request_goes_straight_to_decode():
    journey = Journey()
    journey.script(PD, STREAM)
    answer = await journey.run(chat())
    assert [sent.url for sent in journey.upstream.sent] == [PD]
    assert answer.held == ROLE + TOKEN and journey.trace.attempts == 1
    assert journey.upstream.sent[0].headers == {"x-request-id": "req-1", "Content-Type": "application/json"}


async def test_media_without_a_live_encoder_is_503_when_the_consumer_may_not_encode():
    journey = Journey(encode_urls=(E1,), consumer_encode=False)
    journey.take_encoders_out()
    with pytest.raises(ProxyError) as err:
        await journey.run(chat(image("A")))
    assert (err.value.status, err.value.stage, err.value.error_type) == (503, "route", "service_unavailable")
    assert journey.upstream.sent == []


async def test_a_standalone_decoder_takes_a_prefill_instance():
    journey = Journey(decode_urls=(D,), prefill_urls=(P,))
    route = journey.pipeline.choose_route("r")
    assert (route.decoder.url, route.prefill.url, route.dp_rank, route.consumer_zmq) == (D, P, None, None)


async def test_a_combined_instance_is_preferred_and_needs_no_prefill():
    journey = Journey()
    route = journey.pipeline.choose_route("r")
    assert route.decoder.role == PREFILL_DECODE and route.prefill is None and route.pinned is route.decoder


async def test_data_parallel_ranks_rotate_and_pick_the_pushing_address():
    zmq = ("tcp://c:0", "tcp://c:1")
    journey = Journey(ec_consumer_zmq_addrs=zmq, ec_consumer_dp_size=2)
    for n in range(3):
        journey.script(E1 if n % 2 == 0 else E2, ENCODED)
        journey.script(PD, STREAM)
        await journey.run(chat(image(f"pic{n}")), request_id=f"r{n}")
    decodes = journey.upstream.to(PD)
    assert [sent.headers[DP_RANK_HEADER] for sent in decodes] == ["0", "1", "0"]
    encodes = [sent for sent in journey.upstream.sent if sent.stage == "encode"]
    assert [sent.body["ec_transfer_params"]["consumer_zmq"] for sent in encodes] == [zmq[0], zmq[1], zmq[0]]


# -- encoders -----------------------------------------------------------------------------------------


async def test_an_encoder_that_fails_with_5xx_or_no_answer_hands_its_items_to_another():
    for failure in (failed_with(500), Reply(fails=REFUSED)):
        journey = Journey()
        journey.script(E1, failure)
        journey.script(E2, ENCODED)
        journey.script(PD, STREAM)
        await journey.run(chat(image("A")))
        first, second = (sent.body for sent in journey.upstream.sent if sent.stage == "encode")
        assert first["messages"] == second["messages"]
        assert journey.trace.encoder_failovers == 1 and journey.trace.attempts == 1
        assert journey.metric("epd_encoder_failovers_total", from_encoder=E1) == 1


async def test_an_encoders_4xx_is_the_requests_fault_and_not_failed_over():
    journey = Journey()
    journey.script(E1, failed_with(400))
    with pytest.raises(ProxyError) as err:
        await journey.run(chat(image("A")))
    assert (err.value.status, err.value.stage, err.value.backend) == (400, "encode", E1)
    assert [sent.url for sent in journey.upstream.sent] == [E1]


async def test_failover_stops_after_encoder_failovers_others():
    journey = Journey(encode_urls=(E1, E2, "http://e3"), encoder_failovers=1, consumer_encode=False)
    journey.script(E1, failed_with(503))
    journey.script(E2, failed_with(503))
    with pytest.raises(ProxyError) as err:
        await journey.run(chat(image("A")))
    assert err.value.status == 503 and err.value.backend == E2
    assert [sent.url for sent in journey.upstream.sent] == [E1, E2]


async def test_one_failed_group_fails_the_request_as_itself():
    journey = Journey()
    journey.script(E1, failed_with(400))
    journey.script(E2, ENCODED)
    with pytest.raises(ProxyError) as err:
        await journey.run(chat(image("A"), image("B")))
    assert type(err.value) is ProxyError and err.value.status == 400


async def test_encoder_subrequests_are_idempotent_and_named_after_the_request():
    journey = Journey()
    journey.script(E1, ENCODED)
    journey.script(PD, STREAM)
    await journey.run(chat(image("A")), request_id="abc")
    sent = journey.upstream.to(E1)[0]
    assert sent.options["idempotent"] is True
    assert sent.headers["x-request-id"].startswith("abc:0:")


# -- the retry rules ----------------------------------------------------------------------------------


async def test_decodes_500_is_retried_up_to_decode_retries_with_fresh_transfer_ids():
    journey = Journey(decode_retries=2, ec_consumer_zmq_addrs=("tcp://c:0",))
    journey.script(E1, ENCODED, ENCODED)
    journey.script(E2, ENCODED)
    journey.script(PD, failed_with(500), failed_with(500), STREAM)
    answer = await journey.run(chat(image("A")))
    assert answer.status == 200 and journey.trace.attempts == 3
    ids = [
        sent.body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
        for sent in journey.upstream.sent
        if sent.stage == "encode"
    ]
    assert len(ids) == 3 and len(set(ids)) == 3  # every attempt encodes afresh
    assert journey.metric("epd_retries_total", stage="decode") == 2
    assert journey.job.body is None  # committed: the client's body is let go


async def test_the_last_500_is_the_clients_answer():
    journey = Journey(decode_retries=1)
    journey.script(PD, failed_with(500), failed_with(500))
    with pytest.raises(ErrorAnswer) as err:
        await journey.run(chat())
    assert err.value.status == 500 and err.value.stage == "decode"
    assert journey.trace.attempts == 2 and len(journey.upstream.to(PD)) == 2


async def test_zero_retries_means_one_attempt():
    journey = Journey(decode_retries=0)
    journey.script(PD, failed_with(500))
    with pytest.raises(ErrorAnswer):
        await journey.run(chat())
    assert journey.trace.attempts == 1


@pytest.mark.parametrize("status", [400, 404, 422, 429, 502, 503])
async def test_other_statuses_are_never_retried(status):
    journey = Journey(decode_retries=3)
    journey.script(PD, failed_with(status))
    with pytest.raises(ErrorAnswer) as err:
        await journey.run(chat())
    assert err.value.status == status and journey.trace.attempts == 1
    assert journey.metric("epd_retries_total", stage="decode") == 0


@pytest.mark.parametrize("kind", [REFUSED, HEADERS_TIMEOUT])
async def test_no_answer_from_decode_is_not_retried(kind):
    journey = Journey(decode_retries=3)
    journey.script(PD, Reply(fails=kind))
    with pytest.raises(NoAnswer):
        await journey.run(chat())
    assert journey.trace.attempts == 1


PD2, P2 = "http://pd2", "http://p2"


class FirstCandidate:
    """A policy that takes the first candidate it is offered: which instance a request tries
    first, and where it goes when that one is avoided, are known."""

    def choose(self, candidates, keys):
        return [candidates[0] for _ in keys]


def in_order(**fields) -> Journey:
    return Journey(policies={ENCODE: RoundRobin(), PREFILL: FirstCandidate(), DECODE: FirstCandidate()}, **fields)


async def run_held(journey, body, request_id="req-1"):
    """As `serve` runs a request: its route held from the choice to the end."""
    job = ClientBody(body, normalise_request(body).items)
    route = journey.pipeline.choose_route(request_id, job)
    journey.trace = Trace(request_id)
    with route.held():
        answer = await journey.pipeline.open(job, route, journey.trace)
        loads = {
            m.url: (m.inflight, m.prefill_queue)
            for role in (PREFILL, DECODE, PREFILL_DECODE)
            for m in journey.fleet.members(role)
        }
    return route, answer, loads


@pytest.mark.parametrize("kind", [REFUSED, CONNECT_TIMEOUT])
async def test_a_pd_that_took_none_of_the_request_hands_it_to_another(kind):
    journey = in_order(decode_urls=(PD, PD2), decode_retries=0)
    first, other = PD, PD2
    journey.script(first, Reply(fails=kind))
    journey.script(other, STREAM)
    route, answer, loads = await run_held(journey, chat())
    assert answer.status == 200 and route.decoder.url == other
    assert len(journey.upstream.to(first)) == len(journey.upstream.to(other)) == 1
    # While it was answered the request counted on the PD it moved to, and on that one alone.
    assert loads[first] == (0, 0.0) and loads[other][0] == 1
    assert all(m.inflight == 0 and m.prefill_queue == 0 for m in journey.fleet.members(PREFILL_DECODE))
    assert journey.metric("epd_retries_total", stage="decode") == 1


async def test_a_pd_that_may_have_read_the_request_is_not_handed_another_copy():
    journey = in_order(decode_urls=(PD, PD2), decode_retries=3)
    journey.script(PD, Reply(fails=HEADERS_TIMEOUT))
    with pytest.raises(NoAnswer):
        await run_held(journey, chat())
    assert len(journey.upstream.sent) == 1


async def test_every_pd_refusing_ends_with_the_first_refusal_each_tried_once():
    journey = Journey(decode_urls=(PD, PD2))
    journey.script(PD, Reply(fails=REFUSED))
    journey.script(PD2, Reply(fails=REFUSED))
    with pytest.raises(NoAnswer) as failed:
        await run_held(journey, chat())
    assert failed.value.kind == REFUSED
    assert sorted(sent.url for sent in journey.upstream.sent) == [PD, PD2]


async def test_in_epd_a_prefill_that_took_none_of_the_request_hands_it_to_another():
    journey = in_order(decode_urls=(D,), prefill_urls=(P, P2))
    first, other = P, P2
    journey.script(first, Reply(fails=REFUSED))
    journey.script(other, json_reply({"kv_transfer_params": KV}))
    journey.script(D, STREAM)
    route, answer, _ = await run_held(journey, chat())
    assert answer.status == 200 and route.prefill.url == other
    assert journey.upstream.to(D)[0].body["kv_transfer_params"] == KV


async def test_an_in_band_error_before_anything_generated_is_retried_and_the_first_stream_let_go():
    journey = Journey(decode_retries=1)
    journey.script(PD, stream_reply(ROLE, VLLM_ERROR, DONE), STREAM)
    answer = await journey.run(chat())
    assert journey.trace.attempts == 2 and answer.held == ROLE + TOKEN
    first, second = journey.upstream.answers
    assert first.released and not second.released
    assert journey.metric("epd_retries_total", stage="decode") == 1


async def test_an_in_band_error_on_the_last_attempt_is_relayed_as_vllm_sent_it():
    journey = Journey(decode_retries=0)
    journey.script(PD, stream_reply(ROLE, VLLM_ERROR, DONE))
    answer = await journey.run(chat())
    assert answer.held == ROLE + VLLM_ERROR and journey.trace.attempts == 1


async def test_an_error_after_generated_text_is_never_retried():
    journey = Journey(decode_retries=3)
    journey.script(PD, stream_reply(ROLE, TOKEN, VLLM_ERROR, DONE))
    answer = await journey.run(chat())
    assert journey.trace.attempts == 1 and answer.held == ROLE + TOKEN


async def test_a_stream_that_breaks_while_its_head_is_held_is_released_and_raised():
    journey = Journey(decode_retries=3)
    journey.script(PD, stream_reply(ROLE, breaks="broken"))
    with pytest.raises(NoAnswer):
        await journey.run(chat())
    assert journey.upstream.answers[0].released and journey.trace.attempts == 1


# -- E+P+D --------------------------------------------------------------------------------------------


async def test_prefills_kv_handles_go_to_decode():
    journey = Journey(decode_urls=(D,), prefill_urls=(P,))
    journey.script(P, json_reply({"kv_transfer_params": KV}))
    journey.script(D, STREAM)
    await journey.run(chat(max_tokens=40))
    (prefill,) = journey.upstream.to(P)
    (decode,) = journey.upstream.to(D)
    assert prefill.body["max_tokens"] == 1 and decode.body["max_tokens"] == 40
    assert decode.body["kv_transfer_params"] == KV
    assert journey.trace.prefill_s > 0


async def test_prefills_500_is_retried_under_decode_retries_too():
    journey = Journey(decode_urls=(D,), prefill_urls=(P,), decode_retries=1)
    journey.script(P, failed_with(500), json_reply({"kv_transfer_params": KV}))
    journey.script(D, STREAM)
    await journey.run(chat())
    assert journey.trace.attempts == 2
    assert journey.metric("epd_retries_total", stage="prefill") == 1


async def test_prefills_4xx_ends_the_request_before_decode():
    journey = Journey(decode_urls=(D,), prefill_urls=(P,), decode_retries=3)
    journey.script(P, failed_with(400))
    with pytest.raises(ErrorAnswer) as err:
        await journey.run(chat())
    assert (err.value.status, err.value.stage) == (400, "prefill")
    assert journey.upstream.to(D) == []


async def test_without_kv_handles_decode_gets_the_prepared_body_as_is():
    journey = Journey(decode_urls=(D,), prefill_urls=(P,))
    journey.script(P, json_reply({"choices": []}))
    journey.script(D, STREAM)
    await journey.run(chat())
    assert "kv_transfer_params" not in journey.upstream.to(D)[0].body


# -- what health learns -------------------------------------------------------------------------------


async def test_an_instance_is_charged_one_5xx_per_request_however_often_it_is_retried():
    journey = Journey(decode_retries=2)
    journey.script(PD, failed_with(500), failed_with(500), failed_with(500))
    with pytest.raises(ErrorAnswer):
        await journey.run(chat())
    assert journey.health.reports == [("answered", PD, 500)]


async def test_answers_and_transport_failures_reach_health_but_timeouts_after_connecting_do_not():
    journey = Journey()
    journey.script(PD, failed_with(400), Reply(fails=CONNECT_TIMEOUT), Reply(fails=HEADERS_TIMEOUT), STREAM)
    for _ in range(3):
        with pytest.raises(ProxyError):
            await journey.run(chat())
    await journey.run(chat())
    assert journey.health.reports == [("answered", PD, 400), ("failed", PD, CONNECT_TIMEOUT), ("ok", PD), ("ok", PD)]


async def test_a_refused_answer_counts_as_that_instance_answering_502():
    journey = Journey()
    journey.script(PD, Reply(fails=REFUSED_ANSWER))
    with pytest.raises(NoAnswer):
        await journey.run(chat())
    assert journey.health.reports == [("answered", PD, 502)]


# -- the client's body --------------------------------------------------------------------------------


def test_a_body_nested_deeper_than_can_be_written_is_a_bad_request():
    deep: list = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(BadRequest, match="nests too deeply"):
        ClientBody({"x": deep}).dumps({"x": deep})


async def test_a_failed_request_keeps_the_body_a_later_retry_would_need():
    journey = Journey(decode_retries=0)
    journey.script(PD, failed_with(500))
    with pytest.raises(ErrorAnswer):
        await journey.run(chat())
    assert journey.job.body is not None
