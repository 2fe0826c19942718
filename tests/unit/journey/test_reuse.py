"""What the consumer can reuse (reuse.py), the prefix-aware placement of PD / prefill
(routing.PrefixAffinity) and the pipeline wired to both, against scripted backends."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from epd_proxy.calls.upstream import CONNECT_TIMEOUT, HEADERS_TIMEOUT, POOL_TIMEOUT, REFUSED, RESET, NoAnswer
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.routing import PrefixAffinity, RoundRobin
from epd_proxy.journey.doors import CHAT, chat_conversation
from epd_proxy.journey.extract import ReadOptions, normalise_request
from epd_proxy.journey.held import HeldMedia, media_names
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.pipeline import ClientBody, Trace
from epd_proxy.journey.responses_api import RESPONSES
from epd_proxy.journey.reuse import (
    consumer_may_encode,
    conversation_key,
    failed_holding_media,
    plan_encode,
    raw_modalities,
    swamped,
)
from tests.media import agent_messages, agent_responses, audio, chat, conversation, image, video
from tests.unit.journey.test_pipeline import E1, E2, KV, PD, STREAM, D, Journey, P, failed_with, json_reply
from tests.unit.scripted_upstream import Reply

PD2, D2 = "http://pd2", "http://d2"
TURNS = ([image("s0")], [image("s1")], [image("s2")])


def items_of(body):
    return normalise_request(body).items


def job_of(body) -> ClientBody:
    return ClientBody(body, items_of(body))


def key_of(body):
    return conversation_key(body.get("model"), chat_conversation(body), items_of(body))


def earlier_turns(body) -> frozenset[int]:
    """The items of the turns before the last: what the fleet holds once it has run them."""
    last = max((m for m, message in enumerate(body["messages"]) if message["role"] == "assistant"), default=0)
    return frozenset(item.index for item in items_of(body) if item.place.entry < last)


def encoded(body, *indices):
    """An encoder's answer for the body's items at `indices`, in that order, with metadata."""
    items = items_of(body)
    params = {
        items[i].uuid: {"metadata": {"image_grid_thw": [[1, 4, 4]]}, "item_indices": [n]} for n, i in enumerate(indices)
    }
    return json_reply({"ec_transfer_params": params})


def hold(journey: Journey, body, *indices: int) -> None:
    """The fleet encoded the body's items at `indices` before (an earlier turn)."""
    names = media_names(body, items_of(body))
    journey.pipeline.held.encoded(names[i] for i in indices)


def media_parts(sent):
    return [
        part
        for m in sent.body["messages"]
        if isinstance(m["content"], list)
        for part in m["content"]
        if part.get("type") != "text"
    ]


# -- the conversation key ---------------------------------------------------------------------------


def test_every_turn_of_a_conversation_has_the_key_of_its_opening():
    keys = {key_of(conversation(*TURNS[:n])) for n in (1, 2, 3)}
    assert len(keys) == 1 and None not in keys


def test_conversations_that_open_differently_have_different_keys():
    other_image = conversation([image("t0")], [image("s1")])
    other_text = conversation(*TURNS[:2])
    other_text["messages"][1]["content"][0]["text"] = "another task"
    assert len({key_of(conversation(*TURNS[:2])), key_of(other_image), key_of(other_text)}) == 3


def test_a_body_without_a_user_message_has_no_key():
    assert key_of({"messages": [{"role": "system", "content": "x"}]}) is None
    assert conversation_key("m", chat_conversation({"messages": "not a list"}), []) is None


# -- which items are encoded ------------------------------------------------------------------------


ALL = frozenset({"image", "audio", "video"})


def test_earlier_turns_images_go_raw_and_only_the_new_one_is_encoded():
    body = conversation(*TURNS)
    items = items_of(body)
    plan = plan_encode(items, held=earlier_turns(body), raw=ALL, last_resort=False)
    assert [item.index for item in plan.encode] == [2] and plan.reused == 2 and plan.consumer_encoded == 0


def test_audio_in_the_history_is_encoded_again():
    body = conversation([audio("a0")], [image("s1")])
    plan = plan_encode(items_of(body), held=earlier_turns(body), raw=ALL, last_resort=False)
    assert len(plan.encode) == 2 and plan.reused == 0


@pytest.mark.parametrize(("raw", "reuse"), [(frozenset(), True), (ALL, False), (frozenset({"video"}), True)])
def test_without_raw_images_or_reuse_every_image_is_encoded(raw, reuse):
    body = conversation(*TURNS)
    plan = plan_encode(items_of(body), held=earlier_turns(body) if reuse else frozenset(), raw=raw, last_resort=False)
    assert len(plan.encode) == 3 and plan.reused == plan.consumer_encoded == 0


def test_as_last_resort_nothing_is_encoded():
    body = conversation(*TURNS)
    plan = plan_encode(items_of(body), held=earlier_turns(body), raw=ALL, last_resort=True)
    assert list(plan.encode) == [] and plan.consumer_encoded == 3


def test_as_last_resort_a_modality_the_consumer_refuses_raw_still_needs_an_encoder():
    body = conversation([image("h0")], [image("h1"), video("v1")])
    items = items_of(body)
    raw = raw_modalities(items, frozenset({"video"}))
    assert raw == {"image"}
    plan = plan_encode(items, held=earlier_turns(body), raw=raw, last_resort=True)
    assert [item.modality for item in plan.encode] == ["video"] and plan.consumer_encoded == 2
    # Without the last resort only the history image is reused; the video is encoded with the new image.
    plan = plan_encode(items, held=earlier_turns(body), raw=raw, last_resort=False)
    assert [item.modality for item in plan.encode] == ["image", "video"] and plan.reused == 1


def test_what_goes_raw_is_per_modality_but_all_or_nothing_with_audio():
    body = conversation([image("h0")], [image("h1"), video("v1")])
    items = items_of(body)
    assert raw_modalities(items, frozenset()) == {"image", "video"}
    assert raw_modalities(items, frozenset({"video"})) == {"image"}
    assert raw_modalities(items, ALL) == frozenset()
    with_audio = items_of(conversation([image("h0")], [audio("a1"), video("v1")]))
    # The rewrite references every item or none when audio is present: one refusal keeps all encoded.
    assert raw_modalities(with_audio, frozenset({"video"})) == frozenset()
    assert raw_modalities(with_audio, frozenset({"image"})) == frozenset()
    assert raw_modalities(with_audio, frozenset()) == {"image", "audio", "video"}


def no_answer(kind: str, sent: bool | None = None) -> NoAnswer:
    return NoAnswer(kind, "x", what="Encoder request", stage="encode", backend=E1, sent=sent)


def test_only_media_no_encoder_received_go_to_the_consumer():
    body = chat(image("A"))
    plan = plan_encode(items_of(body), held=earlier_turns(body), raw=ALL, last_resort=False)
    assert consumer_may_encode(plan, no_answer(REFUSED), None)
    assert consumer_may_encode(plan, no_answer(CONNECT_TIMEOUT), None)
    assert consumer_may_encode(plan, no_answer(POOL_TIMEOUT), None)
    # Sent, then dropped or not answered in time: the encoder may have read what broke it.
    assert not consumer_may_encode(plan, no_answer(RESET), None)
    assert not consumer_may_encode(plan, no_answer(HEADERS_TIMEOUT), None)
    assert not consumer_may_encode(plan, no_answer(RESET, sent=False), E1) and consumer_may_encode(
        plan, no_answer(RESET, sent=False), None
    )
    # An earlier encoder that received them and failed: refused by the next one is not enough.
    assert not consumer_may_encode(plan, no_answer(REFUSED), E2)
    # An answered error is the request's answer.
    assert not consumer_may_encode(plan, ProxyError(500, "boom", stage="encode", answered=500), None)
    # A modality the consumer refuses raw cannot be handed to it.
    video_body = chat(video("v"))
    plan = plan_encode(
        items_of(video_body),
        held=frozenset(),
        raw=frozenset({"image"}),
        last_resort=False,
    )
    assert not consumer_may_encode(plan, no_answer(REFUSED), None)


def test_an_encoder_failed_holding_media_when_it_answered_5xx_or_lost_them_after_sending():
    assert failed_holding_media(no_answer(RESET)) and failed_holding_media(no_answer(HEADERS_TIMEOUT))
    assert failed_holding_media(ProxyError(503, "x", stage="encode", answered=503))
    assert not failed_holding_media(no_answer(REFUSED)) and not failed_holding_media(no_answer(RESET, sent=False))
    assert not failed_holding_media(ProxyError(400, "bad image", stage="encode", answered=400))
    assert not failed_holding_media(ProxyError(503, "no encoder is live", stage="route"))
    assert not failed_holding_media(None)


def measured(lanes: Lanes, url: str, item_s: float, items: int) -> Instance:
    encoder = Instance(url, ENCODE)
    lane = lanes.of(encoder)
    lane.speed.item_s, lane.speed.fixed_s = item_s, item_s * 0.35
    lane.work.subs, lane.work.load = 1, items
    return encoder


def test_an_encoder_is_swamped_when_its_backlog_passes_the_bound():
    lanes = Lanes()
    a, b, c = (measured(lanes, f"http://e{n}", 0.1, items) for n, items in enumerate((30, 40, 10)))
    assert swamped(lanes, [a, b], 2.0, 0.0)
    assert not swamped(lanes, [a, c], 2.0, 0.0)
    assert swamped(lanes, [], 2.0, 0.0)
    # One that never answered: behind by its silence once that outlasts what its work should take.
    hung = Instance("http://hung", ENCODE)
    assert not swamped(Lanes(), [hung], 2.0, 0.0)
    alone = Lanes()
    alone.of(hung).started(1, 0.0)
    assert not swamped(alone, [hung], 2.0, 1.0) and swamped(alone, [hung], 2.0, 2.5)


# -- prefix affinity --------------------------------------------------------------------------------


def pds(*urls: str) -> list[Instance]:
    return [Instance(url, PREFILL_DECODE) for url in urls]


def test_prefix_affinity_sends_a_key_to_one_home_whatever_the_order_or_the_process():
    members = pds(PD, PD2, "http://pd3")
    homes = {PrefixAffinity().choose(order, ["conv7"])[0].url for order in (members, members[::-1])}
    assert len(homes) == 1
    spread = {PrefixAffinity().choose(members, [f"conv{n}"])[0].url for n in range(40)}
    assert spread == {PD, PD2, "http://pd3"}


def test_prefix_affinity_spills_when_work_is_queued_on_its_home_and_goes_by_load_without_a_key():
    members = pds(PD, PD2)
    policy = PrefixAffinity()
    home = policy.choose(members, ["conv"])[0]
    other = next(m for m in members if m is not home)
    home.prefill_queue, home.inflight = 1000.0, 3
    assert policy.choose(members, ["conv"])[0] is other
    assert policy.choose(members, [None])[0] is other


# -- the pipeline ------------------------------------------------------------------------------------


def affine(**fields) -> Journey:
    policies = {ENCODE: RoundRobin(), PREFILL: PrefixAffinity(), DECODE: PrefixAffinity()}
    return Journey(policies=policies, **fields)


async def test_every_turn_goes_to_the_pd_that_ran_the_conversation_so_far():
    journey = affine(decode_urls=(PD, PD2))
    homes = set()
    for n in (1, 2, 3):
        homes.add(journey.pipeline.choose_route(f"r{n}", job_of(conversation(*TURNS[:n]))).decoder.url)
    assert len(homes) == 1


async def test_a_turn_goes_where_its_conversations_last_turn_ran_not_back_to_the_home():
    journey = affine(decode_urls=(PD, PD2, "http://pd3"))
    home = journey.pipeline.choose_route("r1", job_of(conversation(*TURNS[:1]))).decoder
    home.prefill_queue = 1e6  # busy: turn 2 spills to another PD
    moved = journey.pipeline.choose_route("r2", job_of(conversation(*TURNS[:2]))).decoder
    home.prefill_queue = 0.0
    assert moved is not home
    assert journey.pipeline.choose_route("r3", job_of(conversation(*TURNS))).decoder is moved


async def test_in_epd_the_prefill_follows_the_conversation_and_decode_goes_by_load():
    journey = affine(decode_urls=(D, D2), prefill_urls=(P, "http://p2"))
    routes = [journey.pipeline.choose_route(f"r{n}", job_of(conversation(*TURNS[:n]))) for n in (1, 2, 3)]
    assert len({route.prefill.url for route in routes}) == 1
    assert {route.decoder.url for route in routes} == {D, D2}


async def test_only_the_new_image_is_encoded_and_the_consumer_gets_all_raw_under_their_uuids():
    journey = affine(encode_urls=(E1,))
    body = conversation(*TURNS)
    hold(journey, body, 0, 1)
    journey.script(E1, encoded(body, 2))
    journey.script(PD, STREAM)
    await journey.run(body)
    (sub,) = journey.upstream.to(E1)
    assert len(media_parts(sub)) == 1 and media_parts(sub)[0]["uuid"] == items_of(body)[2].uuid
    (consumer,) = journey.upstream.to(PD)
    parts = media_parts(consumer)
    assert [part["type"] for part in parts] == ["image_url"] * 3
    assert [part["uuid"] for part in parts] == [item.uuid for item in items_of(body)]
    assert (journey.trace.reused, journey.trace.consumer_encoded) == (2, 0)
    assert journey.metric("epd_items_reused_total") == 2


async def test_with_no_reuse_every_turn_encodes_the_whole_history_as_before():
    journey = affine(encode_urls=(E1,), reuse=False)
    body = conversation(*TURNS)
    journey.script(E1, encoded(body, 0, 1, 2))
    journey.script(PD, STREAM)
    await journey.run(body)
    assert len(media_parts(journey.upstream.to(E1)[0])) == 3
    assert [part["type"] for part in media_parts(journey.upstream.to(PD)[0])] == ["image_embeds"] * 3


async def test_with_no_encoder_in_rotation_the_consumer_encodes_the_media_itself():
    journey = Journey(encode_urls=(E1,))
    journey.take_encoders_out()
    body = chat(image("A"))
    journey.script(PD, STREAM)
    await journey.run(body)
    (consumer,) = journey.upstream.sent
    assert consumer.url == PD and media_parts(consumer) == [{**image("A"), "uuid": items_of(body)[0].uuid}]
    assert journey.trace.consumer_encoded == 1 and journey.metric("epd_items_consumer_encoded_total") == 1


async def test_when_no_encoder_answers_the_consumer_encodes_but_an_answered_error_is_the_answer():
    journey = Journey(encode_urls=(E1, E2), encoder_failovers=1)
    journey.script(E1, Reply(fails=REFUSED))
    journey.script(E2, Reply(fails=REFUSED))
    journey.script(PD, STREAM)
    body = chat(image("A"))
    await journey.run(body)
    assert [sent.url for sent in journey.upstream.sent] == [E1, E2, PD]
    assert media_parts(journey.upstream.sent[-1]) == [{**image("A"), "uuid": items_of(body)[0].uuid}]
    assert journey.trace.consumer_encoded == 1
    for status in (400, 500):
        answered = Journey(encode_urls=(E1,))
        answered.script(E1, failed_with(status))
        with pytest.raises(ProxyError) as err:
            await answered.run(body)
        assert err.value.status == status and [sent.url for sent in answered.upstream.sent] == [E1]


async def test_with_every_encoder_swamped_the_consumer_encodes_and_a_flag_turns_that_off():
    for allowed in (True, False):
        journey = Journey(encode_urls=(E1, E2), consumer_encode=allowed, consumer_encode_after_s=1.0)
        for encoder in journey.fleet.members(ENCODE):
            lane = journey.pipeline.encode.lanes.of(encoder)
            lane.speed.item_s, lane.speed.fixed_s, lane.work.subs, lane.work.load = 0.1, 0.035, 2, 20
        journey.script(PD, STREAM)
        if not allowed:
            journey.script(E1, json_reply({"ec_transfer_params": {}}))
        await journey.run(chat(image("A")))
        assert [sent.url for sent in journey.upstream.sent] == ([PD] if allowed else [E1, PD])


async def test_a_consumers_refusal_is_the_answer_and_teaches_the_proxy_nothing():
    """A client can make a consumer echo any text in its 400, vLLM's own wording included."""
    journey = affine(encode_urls=(E1,))
    body = conversation(*TURNS[:2])
    hold(journey, body, 0)
    echoed = json_reply({"error": {"message": "Unknown part type: At most 0 image(s) may be provided"}}, 400)
    journey.script(E1, encoded(body, 1))
    journey.script(PD, echoed)
    with pytest.raises(ProxyError) as err:
        await journey.run(body)
    assert err.value.status == 400 and len(journey.upstream.to(PD)) == 1
    assert journey.fleet.members(PREFILL_DECODE)[0].raw_refused == frozenset()
    journey.script(E1, encoded(body, 1))
    journey.script(PD, STREAM)
    await journey.run(body, request_id="req-2")
    assert [p["type"] for p in media_parts(journey.upstream.to(PD)[-1])] == ["image_url"] * 2


async def test_a_consumer_probed_as_refusing_raw_images_gets_references_and_never_the_last_resort():
    journey = affine(encode_urls=(E1,))
    journey.fleet.members(PREFILL_DECODE)[0].raw_refused = frozenset({"image"})
    body = conversation(*TURNS[:2])
    journey.script(E1, encoded(body, 0, 1))
    journey.script(PD, STREAM)
    await journey.run(body)
    assert [p["type"] for p in media_parts(journey.upstream.to(PD)[0])] == ["image_embeds"] * 2
    journey.take_encoders_out()
    with pytest.raises(ProxyError) as err:
        await journey.run(body, request_id="req-2")
    assert err.value.status == 503 and len(journey.upstream.to(PD)) == 1


@pytest.mark.parametrize(
    "first", [Reply(fails=RESET), Reply(fails=HEADERS_TIMEOUT), failed_with(500)], ids=["reset", "timeout", "500"]
)
async def test_media_an_encoder_received_and_failed_never_reach_the_consumer(first):
    journey = Journey(encode_urls=(E1, E2), encoder_failovers=1)
    journey.script(E1, first)
    journey.script(E2, Reply(fails=REFUSED))
    with pytest.raises(ProxyError) as err:
        await journey.run(chat(image("A")))
    assert err.value.stage == "encode" and err.value.status in (502, 504)
    assert [sent.url for sent in journey.upstream.sent] == [E1, E2]
    assert journey.trace.media_failed_on == E1 and journey.trace.consumer_encoded == 0


async def test_text_only_consumers_never_get_raw_media_and_media_without_encoders_is_503():
    journey = Journey(encode_urls=(E1,), text_only_consumers=True)
    journey.take_encoders_out()
    with pytest.raises(ProxyError) as err:
        await journey.run(conversation(*TURNS[:2]))
    assert err.value.status == 503 and journey.upstream.sent == []


async def test_push_mode_consumers_get_every_item_by_a_push_of_this_attempt():
    journey = affine(encode_urls=(E1,), ec_consumer_zmq_addrs=("tcp://c:0",))
    body = conversation(*TURNS[:2])
    journey.script(E1, encoded(body, 0, 1))
    journey.script(PD, STREAM)
    await journey.run(body)
    assert len(media_parts(journey.upstream.to(E1)[0])) == 2 and journey.trace.reused == 0


async def test_in_epd_decode_gets_the_same_raw_body_as_prefill():
    journey = affine(encode_urls=(E1,), decode_urls=(D,), prefill_urls=(P,))
    body = conversation(*TURNS[:2])
    hold(journey, body, 0)
    journey.script(E1, encoded(body, 1))
    journey.script(P, json_reply({"kv_transfer_params": KV}))
    journey.script(D, STREAM)
    await journey.run(body)
    assert media_parts(journey.upstream.to(P)[0]) == media_parts(journey.upstream.to(D)[0])
    assert journey.trace.reused == 1


async def test_a_history_the_proxy_never_saw_is_encoded_and_referenced():
    """A first request may end in an assistant message (a prefill of the client's own, or a
    history faked to push the vision work onto the shared consumer): its images were never sent."""
    journey = affine(encode_urls=(E1,))
    body = conversation(*TURNS)
    body["messages"].append({"role": "assistant", "content": "It shows"})
    journey.script(E1, encoded(body, 0, 1, 2))
    journey.script(PD, STREAM)
    await journey.run(body)
    assert len(media_parts(journey.upstream.to(E1)[0])) == 3
    assert [p["type"] for p in media_parts(journey.upstream.to(PD)[0])] == ["image_embeds"] * 3
    assert journey.trace.reused == 0


async def test_an_encoded_image_is_held_for_every_consumer_and_a_sent_one_for_its_own():
    journey = affine(encode_urls=(E1,), decode_urls=(PD, PD2))
    first = chat(image("doc"), text="summarise")
    journey.script(E1, encoded(first, 0))
    journey.script(PD, STREAM, STREAM)
    journey.script(PD2, STREAM, STREAM)
    await journey.run(first)
    # Another conversation with the same image, wherever it goes: raw, nothing encoded.
    second = chat(image("doc"), text="translate")
    await journey.run(second, request_id="req-2")
    assert len(journey.upstream.to(E1)) == 1 and journey.trace.reused == 1
    # Only sent (the consumer encoded it itself): held by that consumer alone.
    names = media_names(chat(image("own")), items_of(chat(image("own"))))
    held = journey.pipeline.held
    held.sent(PD2, names.values())
    items = items_of(chat(image("own")))
    assert held.held(items, names, PD2).held == {0} and held.held(items, names, PD).held == frozenset()


def test_a_route_holds_its_instances_from_the_choice_and_lets_go_on_every_path():
    journey = affine(decode_urls=(D, D2), prefill_urls=(P, "http://p2"))
    body = conversation(*TURNS[:1])
    routes = [journey.pipeline.choose_route(f"r{n}", job_of(body)) for n in range(1)]
    with pytest.raises(RuntimeError), routes[0].held():
        assert routes[0].prefill.inflight == routes[0].decoder.inflight == 1
        raise RuntimeError
    with contextlib.ExitStack() as holding:
        for n in range(8):
            route = journey.pipeline.choose_route(f"r{n}", job_of(body))
            holding.enter_context(route.held())
            routes.append(route)
        # The same opening, sent at once: none has its first token, so none holds anything the
        # others could reuse, and they spread by load over both prefills.
        assert sorted(p.inflight for p in journey.fleet.members(PREFILL)) == [4, 4]
    assert all(m.inflight == 0 for role in (PREFILL, DECODE) for m in journey.fleet.members(role))


async def test_an_epd_prefill_is_held_during_its_call_and_let_go_when_it_fails():
    journey = affine(encode_urls=(E1,), decode_urls=(D,), prefill_urls=(P,))
    route = journey.pipeline.choose_route("r", job_of(chat()))
    journey.script(P, failed_with(503))
    with pytest.raises(ProxyError), route.held():
        await journey.pipeline.open(job_of(chat()), route, Trace("r"))
    (prefill,) = journey.fleet.members(PREFILL)
    assert prefill.inflight == 0 and journey.upstream.to(P)[0].options["count_inflight"] is False


# -- every door ----------------------------------------------------------------------------------------

AGENTS = {"chat": None, "responses": agent_responses, "messages": agent_messages}
DOORS = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}
BIG = "x" * 4000  # a screenshot's worth: its media are lifted out of the body (splice.py)


def agent_turn(door: str, n: int, tools: bool = True, tag: str = "", **fields) -> dict:
    shots = [f"{tag}{BIG}-s{k}" for k in range(n)]
    if door == "chat":
        return conversation(*([image(shot)] for shot in shots), **fields)
    return AGENTS[door](*shots, tools=tools, **fields)


def door_key(door: str, body: dict) -> str | None:
    normalised, spliced = DOORS[door].parse(orjson.dumps(body), ReadOptions())
    assert spliced is not None
    return conversation_key(body.get("model"), DOORS[door].conversation(normalised.body), normalised.items)


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("door", ["chat", "responses", "messages"])
def test_every_turn_through_a_door_has_the_key_of_its_opening(door, tools):
    keys = {door_key(door, agent_turn(door, n, tools)) for n in (1, 2, 3)}
    assert len(keys) == 1 and None not in keys
    assert door_key(door, agent_turn(door, 2, tools, tag="other")) not in keys


@pytest.mark.parametrize(("door", "preamble"), [("responses", "instructions"), ("messages", "system")])
def test_the_system_prompt_opens_the_conversation(door, preamble):
    keys = {door_key(door, agent_turn(door, 2, **{preamble: text})) for text in ("one", "two", None)}
    assert len(keys) == 3


def test_a_per_request_billing_header_leaves_an_anthropic_conversation_its_key():
    def turn(n: int) -> dict:
        billing = {"type": "text", "text": f"x-anthropic-billing-header: cch={n};"}
        return agent_turn("messages", n, system=[billing, {"type": "text", "text": "brief"}])

    assert len({door_key("messages", turn(n)) for n in (1, 2, 3)}) == 1


def door_turn(door: str, n: int, tools: bool, held: HeldMedia):
    """Turn `n` through `door` planned against what `held` saw, then its encodes recorded."""
    normalised, _ = DOORS[door].parse(orjson.dumps(agent_turn(door, n, tools)), ReadOptions())
    names = media_names(normalised.body, normalised.items)
    assert names is not None
    plan = plan_encode(normalised.items, held=held.held(normalised.items, names, PD).held, raw=ALL, last_resort=False)
    held.encoded(names[item.index] for item in plan.encode)
    return normalised, plan


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("door", ["chat", "responses", "messages"])
def test_only_a_turns_new_image_is_encoded_whichever_door(door, tools):
    held = HeldMedia()
    for n in (1, 2, 3):
        _, plan = door_turn(door, n, tools, held)
        assert [item.index for item in plan.encode] == [n - 1] and plan.reused == n - 1


def test_a_responses_turn_after_a_tool_call_sends_its_history_raw_under_the_proxys_uuids():
    held = HeldMedia()
    for n in (1, 2):
        door_turn("responses", n, True, held)
    normalised, plan = door_turn("responses", 3, True, held)
    items = normalised.items
    (new,) = plan.encode
    matches = Matches()
    matches.items[new.index] = ItemMatch({"image_grid_thw": [1, 4, 4]}, new.uuid, "t0")
    sent = RESPONSES.consumer_body(normalised.body, items, matches, rewrite=True, push_mode=False)
    parts = [item.place.of(sent["input"]) for item in items]
    assert [part["uuid"] for part in parts] == [item.uuid for item in items]
    assert all(part["type"] == "input_image" for part in parts)
