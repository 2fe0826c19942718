from __future__ import annotations

import orjson
import pytest

from epd_proxy.fleet.backends import DECODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.fleet.prefill_cost import FIXED_TOKENS, Prompt, Turn
from epd_proxy.fleet.routing import LeastLoaded, PrefixAffinity
from epd_proxy.journey.extract import ReadOptions, normalise_request, parse_request
from epd_proxy.journey.route import DP_RANK_HEADER, ClientBody, Route, choose, text_chars

IMAGE = "data:image/png;base64," + "A" * 4096


def chat(*parts):
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def image(url=IMAGE):
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_pds_claim_is_queued_from_the_choice_to_its_first_token():
    pd = Instance("http://pd", PREFILL_DECODE)
    turn = Turn(pd.url, 1000.0)
    route = Route(pd, None, pd, None, None, claim=500.0, turn=turn)
    with route.held():
        assert (pd.inflight, pd.prefill_queue) == (1, 500.0)
        route.prefilled(10.0, 10.5)
        assert turn.prefilled_at == 10.5  # its conversation's next turn finds it there
        assert (pd.inflight, pd.prefill_queue) == (1, 0.0)
        route.prefilled(11.0, 12.0)  # a retry's first token measures nothing more
    assert (pd.inflight, pd.prefill_queue) == (0, 0.0)
    assert pd.prefill_speed.samples == 1 and pd.prefill_speed.item_s == pytest.approx(0.001)


def test_in_epd_the_claim_is_the_prefills_and_a_failed_request_gives_it_back():
    prefill, decode = Instance("http://p", PREFILL), Instance("http://d", DECODE)
    route = Route(decode, prefill, prefill, None, None, claim=300.0)
    with pytest.raises(RuntimeError), route.held():
        assert (prefill.prefill_queue, decode.prefill_queue) == (300.0, 0.0)
        raise RuntimeError("the encoders failed")
    assert prefill.prefill_queue == 0.0 and prefill.prefill_speed.samples == 0


def test_an_instance_passed_over_stays_so_when_the_route_moves_and_the_held_load_moves_with_it():
    prefills = [Instance(f"http://p{n}", PREFILL) for n in range(2)]
    decode = Instance("http://d", DECODE)
    route = Route(decode, prefills[0], prefills[0], None, None, claim=100.0)
    with route.held():
        assert route.pass_over("http://elsewhere") is None and route.passed_over == []
        assert route.pass_over("http://p0") is prefills[0]
        route.move(Route(decode, prefills[1], prefills[1], None, None, claim=100.0))
        assert route.passed_over == [prefills[0]]
        assert [p.prefill_queue for p in prefills] == [0.0, 100.0] and decode.inflight == 1
    assert [p.prefill_queue for p in prefills] == [0.0, 0.0] and decode.inflight == 0


def test_a_consumers_500_after_pushes_passes_their_encoders_over_and_only_in_push_mode():
    pd = Instance("http://pd", PREFILL_DECODE)
    e0, e1 = (Instance(f"http://e{n}", "encode") for n in range(2))
    pushed = Route(pd, None, pd, None, "tcp://pd:1")
    pushed.pushers = {e0}
    pushed.push_failed()
    assert pushed.unpushed == {e0} and pushed.pushers == set()
    pushed.pushers = {e1}
    pushed.push_failed()
    assert pushed.unpushed == {e0, e1}
    folder = Route(pd, None, pd, None, None)
    folder.pushers = {e0}
    folder.push_failed()
    assert folder.unpushed == set()


def test_only_the_pinned_instance_is_told_its_replica():
    prefill, decode = Instance("http://p", PREFILL), Instance("http://d", DECODE)
    plain = {"x-request-id": "r", "Content-Type": "application/json"}
    assert Route(decode, prefill, prefill, None, None).headers("r") == (plain, plain)
    pinned = {**plain, DP_RANK_HEADER: "1"}
    assert Route(decode, prefill, prefill, 1, None).headers("r") == (pinned, plain)
    assert Route(decode, prefill, decode, 1, None).headers("r") == (plain, pinned)


def test_the_text_of_a_body_leaves_its_media_out_spliced_or_not():
    audio = {"type": "input_audio", "input_audio": {"data": "B" * 900, "format": "wav"}}
    raw = orjson.dumps(chat({"type": "text", "text": "hello"}, image(), audio))
    whole, spliced = parse_request(raw, ReadOptions(lift_min_bytes=10**9))
    assert spliced is None
    assert text_chars(len(raw), whole.items, None) == len(raw) - len(IMAGE) - 900
    lifted, spliced = parse_request(raw)
    assert spliced is not None
    assert text_chars(len(raw), lifted.items, spliced) == len(raw) - len(IMAGE) - 900


def test_a_body_keeps_its_media_cost_when_its_items_are_let_go():
    body = chat(image(), image(IMAGE + "AAAA"))
    job = ClientBody(body, normalise_request(body).items, text_chars=100)
    job.release()
    assert job.media_cost == 2.0 and job.text_chars == 100


def test_a_prefix_policy_is_told_the_prompt_and_the_others_claim_it_whole():
    pds = [Instance(f"http://pd{i}", PREFILL_DECODE) for i in range(2)]
    chosen, work, turn = choose(PrefixAffinity(), pds, "conv", Prompt(1000.0))
    assert work == FIXED_TOKENS  # its home is taken to hold the conversation
    assert turn is not None and (turn.url, turn.tokens, turn.prefilled_at) == (chosen.url, 1000.0, None)
    assert choose(LeastLoaded(), pds, "r1", Prompt(1000.0))[1:] == (FIXED_TOKENS + 1000.0, None)
    assert choose(PrefixAffinity(), pds, None, Prompt(1000.0))[1:] == (FIXED_TOKENS + 1000.0, None)
    assert chosen in pds
