"""Cross-request coalescing against fake encoders that record every sub-request: which requests
share one, what each request gets back, and that a failure or a client leaving stays its own.

The proxy shares a sub-request only while an encoder is busy (two of its sub-requests in
flight), so each test first occupies the encoder with two slow "blocker" requests, then sends
the requests that must queue behind them.
"""

from __future__ import annotations

import asyncio
import copy
import itertools

import aiohttp
import orjson
import pytest

from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

SLOW_S = 0.6
# How long the blockers of a one-encoder stack hold its slots: longer than a loaded machine takes
# to queue what a test sends next (0.6 s was not, once), under the 10 s before a sub-request
# counts as overdue (fleet/stalls.py). A stack of several encoders keeps SLOW_S: an encoder silent
# that long beside one that answers is lagging, and gets no new work.
HOLD_S = 3.0


async def answer_of(stack, body):
    async with await stack.chat(body) as resp:
        text = await resp.text()
        return resp.status, orjson.loads(text)


async def direct_answer(stack, body):
    """What the consumer answers for the raw request itself (no disaggregation)."""
    async with stack.client.post(stack.pd_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["message"]["content"]


def lanes(stack):
    return stack.state.lanes


BUSY_CALLS = itertools.count()


async def busy_encoder(stack, encoder=0, hold_s=SLOW_S, gate: asyncio.Event | None = None):
    """Warm the encoder's speed estimate, then hold both of its slots with sub-requests of
    `hold_s` each (after `gate` opens, if given); what follows them takes SLOW_S."""
    fake = stack.encoders[encoder]
    fake.faults.delay_s = SLOW_S
    # Images of their own each time: one the proxy saw encoded would go to the consumer instead.
    call = next(BUSY_CALLS)
    status, _ = await answer_of(stack, chat(image(f"warm-up{call}")))
    assert status == 200
    seen = len(fake.requests)
    fake.faults.delay_s = hold_s
    if gate is not None:
        fake.faults.gate = gate
    blockers = [asyncio.create_task(answer_of(stack, chat(image(f"blocker{call}-{i}")))) for i in range(2)]
    # The fake reads its delay as it records a request: both blockers have theirs.
    await eventually(lambda: len(fake.requests) == seen + 2, what="both slots busy")
    fake.faults.delay_s = SLOW_S
    return blockers


async def queue_behind(stack, bodies, encoder=0, already=0):
    """Send `bodies` concurrently and wait until they all wait in the encoder's lane (with
    `already` groups queued before them)."""
    tasks = [asyncio.create_task(answer_of(stack, body)) for body in bodies]
    lane = lanes(stack).all()[encoder]
    want = already + len(bodies)
    await eventually(lambda: len(lane.work.waiting) == want, what=f"{want} groups queued")
    return tasks


def shared_subrequests(fake):
    return [seen for seen in fake.requests if seen.headers["x-request-id"].startswith("shared-")]


def uuids_of(sub):
    return [part["uuid"] for part in sub.body["messages"][0]["content"]]


async def test_requests_queued_for_a_busy_encoder_share_one_sub_request_and_get_exact_answers(make_stack):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    bodies = [
        chat(image("A")),
        chat(image("B"), image("A")),  # A again, in another request: encoded once, for both (inflight.py)
        chat(image("C"), image("C")),  # a repeat within one request
        chat(image("D"), text="Another question"),
    ]
    originals = copy.deepcopy(bodies)
    tasks = await queue_behind(stack, bodies)
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results), results
    assert bodies == originals
    # Every embedding PD was handed came from the encoders; none was computed again.
    assert stack.pd.encoded_locally == 0 and stack.pd.generation_failures == []
    for body, (_, answer) in zip(bodies, results):
        assert answer["choices"][0]["message"]["content"] == await direct_answer(stack, body)
    (shared,) = shared_subrequests(fake)
    assert len(fake.requests) == 1 + 2 + 1, "warm-up, blockers, then one sub-request for all four"
    assert len(uuids_of(shared)) == 5
    async with stack.client.get(stack.url + "/status.json") as resp:
        snap = await resp.json()
    assert snap["totals"]["coalesced_subrequests"] == 1 and snap["totals"]["split_retries"] == 0
    assert snap["window"]["coalesced_share"] == round(4 / 7, 3)
    # 7 requests in 4 sub-requests: each of the four counts a quarter of the shared one.
    assert snap["window"]["subrequests_per_request"] == round(4 / 7, 2)
    (view,) = snap["scheduler"]["encoders"]
    assert view["ms_per_item"] > 0 and view["queued"] == 0 and view["inflight"] == 0
    async with stack.client.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    url = stack.backend_urls["e"][0]
    assert f'epd_encoder_coalesced_subrequests_total{{encoder="{url}"}} 1.0' in text
    assert f'epd_encoder_estimated_seconds_per_item{{encoder="{url}"}}' in text


async def test_only_requests_the_encoder_would_see_alike_share(make_stack):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    size = {"size": {"shortest_edge": 3136, "longest_edge": 1000000}}
    bodies = {
        "plain": chat(image("P1")),
        "plain-too": chat(image("P2"), max_tokens=3, temperature=0.5),  # only decode reads these
        "sized": chat(image("S"), mm_processor_kwargs=size),
        "priority": chat(image("Q"), priority=3),
        "session": chat(image("X"), session_id="s-1"),
        "model": chat(image("M"), model="other-model"),
        "background": chat(image("G"), media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}}),
    }
    tasks = await queue_behind(stack, list(bodies.values()))
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results), results
    for body, (_, answer) in zip(bodies.values(), results):
        assert answer["choices"][0]["message"]["content"] == await direct_answer(stack, body)
    (shared,) = shared_subrequests(fake)
    assert len(uuids_of(shared)) == 2 and "temperature" not in shared.body and "max_tokens" not in shared.body
    # Everything else went alone, each with its own fields.
    alone = fake.requests[3:]
    assert len(alone) == 1 + 5 and sorted(len(uuids_of(sub)) for sub in alone) == [1, 1, 1, 1, 1, 2]
    fields = {k: v for sub in alone for k, v in sub.body.items() if k not in ("messages", "stream", "model")}
    assert fields == {
        "mm_processor_kwargs": size,
        "priority": 3,
        "session_id": "s-1",
        "media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}},
    }
    assert {sub.body["model"] for sub in alone} == {"tiny-vlm", "other-model"}


@pytest.mark.parametrize("status", [400, 500])
async def test_one_clients_bad_image_fails_only_its_own_request(make_stack, status):
    stack = await make_stack(encoders=1, encoder_failovers=1)
    fake = stack.encoders[0]
    bad = image("undecodable")
    fake.faults.bad_media, fake.faults.bad_media_status = bad["image_url"]["url"], status
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    bodies = [chat(image("good1")), chat(image("ok"), bad), chat(image("good2"), image("good3"))]
    tasks = await queue_behind(stack, bodies)
    (good1, failed, good2), _ = await asyncio.gather(asyncio.gather(*tasks), asyncio.gather(*blockers))
    assert good1[0] == good2[0] == 200
    assert failed[0] == status and "cannot identify image file" in failed[1]["error"]["message"]
    for body, (_, answer) in ((bodies[0], good1), (bodies[2], good2)):
        assert answer["choices"][0]["message"]["content"] == await direct_answer(stack, body)
    (shared,) = shared_subrequests(fake)
    assert len(uuids_of(shared)) == 5
    # Then each request's items alone: the good ones once, the bad one once (no failover: there
    # is no other encoder).
    assert sorted(len(uuids_of(sub)) for sub in fake.requests[4:]) == [1, 2, 2]
    async with stack.client.get(stack.url + "/status.json") as resp:
        snap = await resp.json()
    assert snap["totals"]["split_retries"] == 1
    (view,) = snap["scheduler"]["encoders"]
    if status == 400:
        # The split retry found the culprit: its request is charged, the encoder shares as before.
        assert (view["merge_limit"], view["refusals_charged_to_requests"], view["backoffs"]) == (8, 1, 0)
    roster = {row["url"]: row for row in snap["roster"]}
    assert roster[stack.backend_urls["e"][0]]["state"] == "in rotation"


async def test_a_client_leaving_never_cancels_the_items_of_others(make_stack):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    leaving = aiohttp.ClientSession()
    lane = lanes(stack).all()[0]
    gone = asyncio.create_task(leaving.post(stack.url + "/v1/chat/completions", json=chat(image("leaves"))))
    await eventually(lambda: len(lane.work.waiting) == 1, what="the leaving request queued")
    staying = await queue_behind(stack, [chat(image("stays"))], already=1)
    # The two share a sub-request once a slot frees; the first client leaves while it runs.
    await eventually(lambda: shared_subrequests(fake), what="the shared sub-request sent")
    gone.cancel()
    await leaving.close()
    (status, _), *_ = await asyncio.gather(*staying, *blockers)
    assert status == 200
    assert fake.cancelled == 0, "the shared sub-request ran to its end"
    assert stack.pd.requests[-1].body["messages"][0]["content"][-1]["type"] == "image_embeds"


async def test_a_client_leaving_while_queued_sends_nothing_and_alone_cancels_its_sub_request(make_stack):
    stack = await make_stack(encoders=1)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    lane = lanes(stack).all()[0]
    leaving = aiohttp.ClientSession()
    gone = asyncio.create_task(leaving.post(stack.url + "/v1/chat/completions", json=chat(image("never-sent"))))
    await eventually(lambda: len(lane.work.waiting) == 1, what="queued")
    gone.cancel()
    await leaving.close()
    await eventually(lambda: not lane.work.waiting, what="it left the queue")
    await asyncio.gather(*blockers)
    never = image("never-sent")["image_url"]["url"]
    assert all(never not in orjson.dumps(seen.body).decode() for seen in fake.requests)
    # A lone group sent from the queue is cancelled with its request, as one sent at once is.
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    leaving = aiohttp.ClientSession()
    gone = asyncio.create_task(leaving.post(stack.url + "/v1/chat/completions", json=chat(image("alone"))))
    await eventually(lambda: len(lane.work.waiting) == 1, what="queued")
    sent = len(fake.requests)
    await eventually(lambda: len(fake.requests) == sent + 1, timeout=5, what="sent from the queue")
    gone.cancel()
    await leaving.close()
    await eventually(lambda: fake.cancelled == 1, what="its sub-request cancelled")
    await asyncio.gather(*blockers)
    await eventually(
        lambda: (lane.work.inflight, lane.work.subs, lane.work.load) == (0, 0, 0), what="nothing left counted"
    )


async def test_the_batch_cap_bounds_shared_sub_requests(make_stack):
    stack = await make_stack(encoders=1, encoder_max_batch_size=2)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    bodies = [chat(image(f"c{i}")) for i in range(5)] + [chat(image("pair1"), image("pair2"))]
    tasks = await queue_behind(stack, bodies)
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results)
    assert all(len(uuids_of(sub)) <= 2 for sub in fake.requests)
    assert len(shared_subrequests(fake)) >= 2


async def test_with_spare_capacity_nothing_waits(make_stack):
    stack = await make_stack(encoders=2)
    for fake in stack.encoders:
        fake.faults.delay_s = 0.2
    status, _ = await answer_of(stack, chat(image("warm")))
    # Three requests at once: one sub-request each in flight per encoder at most, nothing held.
    results = await asyncio.gather(*(answer_of(stack, chat(image(f"n{i}"))) for i in range(3)))
    assert status == 200 and all(s == 200 for s, _ in results)
    assert all(not shared_subrequests(fake) for fake in stack.encoders)
    assert sum(len(fake.requests) for fake in stack.encoders) == 4


async def test_no_coalescing_sends_every_group_at_once(make_stack):
    stack = await make_stack(encoders=1, coalesce=False)
    fake = stack.encoders[0]
    fake.faults.delay_s = 0.3
    results = await asyncio.gather(*(answer_of(stack, chat(image(f"q{i}"))) for i in range(5)))
    assert all(s == 200 for s, _ in results)
    assert len(fake.requests) == 5 and not shared_subrequests(fake) and fake.max_active == 5


async def test_mooncake_pushes_share_only_with_the_same_consumer_replica(make_stack):
    addrs = ("tcp://pd:100", "tcp://pd:101")
    stack = await make_stack(encoders=1, ec_consumer_zmq_addrs=addrs, ec_consumer_dp_size=2)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    tasks = await queue_behind(stack, [chat(image(f"m{i}"), image("shared")) for i in range(4)])
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results), results
    assert stack.pd.generation_failures == []
    shared = shared_subrequests(fake)
    assert len(shared) == 2
    for sub in fake.requests:
        params = sub.body["ec_transfer_params"]
        assert len(params["ec_items"]) == len(uuids_of(sub))
    assert {sub.body["ec_transfer_params"]["consumer_zmq"] for sub in shared} == set(addrs)
    # Each request's decode names exactly the transfer ids its own items were pushed under.
    pushed = {item["transfer_id"] for sub in fake.requests for item in sub.body["ec_transfer_params"]["ec_items"]}
    for seen in stack.pd.requests[-4:]:
        ids = [item["transfer_id"] for item in seen.body["ec_transfer_params"]["ec_items"]]
        assert len(ids) == 2 and set(ids) <= pushed


async def test_an_encoder_that_reports_no_positions_is_split_and_then_shares_less(make_stack):
    stack = await make_stack(encoders=1, encoder_options={"report_indices": False})
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    size = {"size": {"shortest_edge": 3136, "longest_edge": 1000000}}  # derived hashes: uuids do not help
    bodies = [chat(image(f"z{i}"), mm_processor_kwargs=size) for i in range(3)]
    tasks = await queue_behind(stack, bodies)
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results), results
    for body, (_, answer) in zip(bodies, results):
        assert answer["choices"][0]["message"]["content"] == await direct_answer(stack, body)
    assert len(shared_subrequests(fake)) == 1
    (lane,) = lanes(stack).all()
    assert lane.share.backoffs == 1 and lane.share.merge_limit < 8


async def test_without_rewrite_a_shared_answer_still_hands_each_request_its_own_handles(make_stack):
    stack = await make_stack(encoders=1, rewrite=False)
    fake = stack.encoders[0]
    blockers = await busy_encoder(stack, hold_s=HOLD_S)
    size = {"size": {"shortest_edge": 3136, "longest_edge": 1000000}}
    bodies = [chat(image("R1"), mm_processor_kwargs=size), chat(image("R2"), image("R1"), mm_processor_kwargs=size)]
    tasks = await queue_behind(stack, bodies)
    results = await asyncio.gather(*tasks, *blockers)
    assert all(status == 200 for status, _ in results), results
    (shared,) = shared_subrequests(fake)
    assert all("uuid" not in part for part in shared.body["messages"][0]["content"])
    handles = [seen.body["ec_transfer_params"] for seen in stack.pd.requests[-2:]]
    assert all(set(h) <= set(stack.store.entries) for h in handles)
    # Each request gets the handles of its own images only: one, and two.
    assert sorted(len(h) for h in handles) == [1, 2]
    assert stack.pd.encoded_locally == 0 and stack.pd.loaded_from_cache >= 3
