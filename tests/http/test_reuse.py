"""Conversations through the proxy against fake vLLM servers: every turn goes where its prefix is,
only each turn's new image is encoded, and the consumer still answers exactly when the EC store
or its own cache lost what it had, when it has no vision tower (known from the proxy's probe), and
when every encoder is gone."""

from __future__ import annotations

import logging
import os
import signal

import aiohttp
import orjson
import pytest

from epd_proxy.fleet.backends import PREFILL_DECODE
from epd_proxy.journey.extract import normalise_request
from epd_proxy_tools.testing.harness import Fakes, every_worker_listens, serve_process, workers_of
from epd_proxy_tools.testing.polling import eventually
from tests.media import conversation, image

TURNS = 4


def turn_parts(conv: int, n: int) -> list:
    return [image(f"c{conv}-t{n}")]


def turn_body(conv: int, n: int) -> dict:
    return conversation(*(turn_parts(conv, k) for k in range(n + 1)))


async def content_of(stack, body) -> str:
    async with await stack.chat(body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["message"]["content"]


async def direct(fake_url: str, stack, body) -> str:
    """What a single consumer answers when it gets the client's own request."""
    async with stack.client.post(fake_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["message"]["content"]


def total(fakes, counter: str) -> int:
    return sum(sum(getattr(fake.counts, counter).values()) for fake in fakes)


async def test_each_turn_goes_to_its_conversations_pd_and_only_the_new_image_is_encoded(make_stack):
    stack = await make_stack(encoders=2, decoders=2)
    reference = await make_stack(encoders=1, decoders=1, reuse=False, decode_policy="least_loaded")
    for conv in range(4):
        for n in range(TURNS):
            body = turn_body(conv, n)
            assert await content_of(stack, body) == await direct(reference.pd_url, reference, body)
    # One image per turn reaches an encoder, the floor; the history goes raw to the PD.
    assert total(stack.encoders, "images") == 4 * TURNS
    for pd in stack.consumers:
        # Every turn after a conversation's first found its history in that PD's prefix cache.
        assert pd.encoded_locally == 0
    assert total(stack.consumers, "prefix_items") == 4 * sum(range(TURNS))
    # A first turn's image arrives as a reference; every later turn's new one raw, from the store.
    assert total(stack.consumers, "images") == 4 and total(stack.consumers, "ec_loads") == 4 * (TURNS - 1)
    assert total(stack.consumers, "cached_tokens") > total(stack.consumers, "prompt_tokens") // 2
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        text = await resp.text()
    assert f"epd_items_reused_total {4.0 * sum(range(TURNS))}" in text


async def totals(stack) -> dict:
    async with stack.client.get(f"{stack.url}/status.json") as resp:
        return (await resp.json())["totals"]


async def test_items_reused_by_a_retried_attempt_count_once(make_stack, caplog):
    stack = await make_stack(encoders=1, decoders=1)
    await content_of(stack, turn_body(0, 0))
    stack.pd.faults.fail_next(1, status=500)  # turn 1's first attempt, its history sent raw
    with caplog.at_level(logging.INFO, logger="epd_proxy.request"):
        await content_of(stack, turn_body(0, 1))
    assert sum(stack.pd.counts.requests.values()) == 3, "the 500 was retried"
    assert (await totals(stack))["items_reused"] == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "epd_proxy.request"]
    assert " reused=1 " in line and " attempts=2 " in line


async def test_a_conversation_stays_on_one_pd(make_stack):
    stack = await make_stack(encoders=1, decoders=2)
    for n in range(TURNS):
        await content_of(stack, turn_body(0, n))
    assert sorted(sum(pd.counts.requests.values()) for pd in stack.consumers) == [0, TURNS]


async def test_a_turn_that_spilled_moves_its_conversation_once(make_stack):
    stack = await make_stack(encoders=1, decoders=3)
    instances = {pd.url: pd for pd in stack.state.fleet.members(PREFILL_DECODE)}
    fakes = dict(zip(stack.backend_urls["d"], stack.consumers))
    await content_of(stack, turn_body(0, 0))
    (home,) = [url for url, fake in fakes.items() if fake.requests]
    instances[home].prefill_queue = 1e6  # work queued at the home outweighs its prefix: turn 1 moves
    await content_of(stack, turn_body(0, 1))
    instances[home].prefill_queue = 0.0
    (moved,) = [url for url, fake in fakes.items() if url != home and fake.requests]
    for n in (2, 3):
        await content_of(stack, turn_body(0, n))
    # Turns 2 and 3 follow turn 1 to where its prefix is, not back to the idle home.
    assert [len(fakes[url].requests) for url in (home, moved)] == [1, 3]
    # There turns 2 and 3 find their history inside the prefix turn 1 left: 2 images, then 3.
    assert sum(fakes[moved].counts.prefix_items.values()) == 2 + 3


async def test_with_the_ec_store_emptied_and_the_prefix_lost_between_turns_the_answer_is_exact(make_stack):
    stack = await make_stack(encoders=1, decoders=1)
    reference = await make_stack(encoders=1, decoders=1, reuse=False)
    for n in range(2):
        await content_of(stack, turn_body(0, n))
    stack.store.entries.clear()
    body = turn_body(0, 2)
    assert await content_of(stack, body) == await direct(reference.pd_url, reference, body)
    assert stack.pd.encoded_locally == 0  # the prefix cache still held the history
    stack.store.entries.clear()
    stack.pd.prefix = type(stack.pd.prefix)()  # the PD restarted: nothing cached
    body = turn_body(0, 3)
    assert await content_of(stack, body) == await direct(reference.pd_url, reference, body)
    assert stack.pd.encoded_locally == 3  # the history, encoded by the PD itself


async def test_a_text_only_pd_is_known_from_its_probe_and_answered_through_references(make_stack):
    stack = await make_stack(encoders=1, decoders=1, consumer_options={"text_only": True})
    reference = await make_stack(encoders=1, decoders=1)
    pd = stack.state.fleet.members(PREFILL_DECODE)[0]
    await eventually(lambda: pd.raw_refused == {"image", "audio", "video"}, what="the PD's probe answered")
    for n in range(3):
        body = turn_body(0, n)
        assert await content_of(stack, body) == await direct(reference.pd_url, reference, body)
    raw = [
        p
        for seen in stack.pd.requests
        for m in seen.body["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
        if p.get("type") == "image_url"
    ]
    assert raw == []  # never refused: every turn's images, history included, went as references
    assert total(stack.encoders, "images") == 1 + 2 + 3
    assert (await totals(stack))["items_reused"] == 0


@pytest.mark.parametrize("allowed", [True, False])
async def test_with_every_encoder_stopped_the_pd_encodes_unless_told_not_to(make_stack, allowed):
    stack = await make_stack(encoders=2, decoders=1, consumer_encode=allowed)
    reference = await make_stack(encoders=1, decoders=1, reuse=False)
    for server in stack.servers[:2]:
        await server.close()
    for n in range(3):
        body = turn_body(0, n)
        async with await stack.chat(body) as resp:
            if not allowed:
                assert resp.status in (502, 503), await resp.text()
                continue
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["message"]["content"] == await direct(
                reference.pd_url, reference, body
            )
    if allowed:
        async with stack.client.get(f"{stack.url}/status.json") as resp:
            status = await resp.json()
        # Each turn's new image was encoded by the PD; the history it held stays counted as reused.
        assert (status["totals"]["items_consumer_encoded"], status["totals"]["items_reused"]) == (3, 0 + 1 + 2)
        assert stack.pd.encoded_locally == 1 + 1 + 1  # each turn's new image; the history was cached


async def test_in_epd_the_prefill_follows_the_conversation(make_stack):
    stack = await make_stack(encoders=1, prefills=2, decoders=2)
    reference = await make_stack(encoders=1, decoders=1, reuse=False)
    for n in range(TURNS):
        body = turn_body(0, n)
        assert await content_of(stack, body) == await direct(reference.pd_url, reference, body)
    assert sorted(sum(p.counts.requests.values()) for p in stack.prefills) == [0, TURNS]
    assert total(stack.prefills, "prefix_items") == sum(range(TURNS))
    assert total(stack.encoders, "images") == TURNS


async def test_with_two_workers_every_turn_still_finds_its_conversations_pd_and_its_history_held():
    fakes = Fakes()
    started = [await fakes.start("pd") for _ in range(2)]
    pds = [fake for fake, _ in started]
    try:
        # The fixture's single PD is replaced: the last --decode-servers-urls wins.
        async with serve_process(
            "--workers", "2", "--decode-servers-urls", ",".join(url for _, url in started)
        ) as served:
            for pd in pds:
                pd.store = served.encoder.store
            await every_worker_listens(served.proc, served.port, 2)
            # A connection per request, so the turns land on either worker.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
                for conv in range(4):
                    for n in range(TURNS):
                        async with client.post(f"{served.url}/v1/chat/completions", json=turn_body(conv, n)) as resp:
                            assert resp.status == 200, await resp.text()
            # Every turn's body carries the conversation's first image's uuid, raw or referenced.
            opening = [normalise_request(turn_body(conv, 0)).items[0].uuid for conv in range(4)]
            served_by = [
                [sum(1 for seen in pd.requests if uuid in orjson.dumps(seen.body).decode()) for pd in pds]
                for uuid in opening
            ]
            assert all(sorted(counts) == [0, TURNS] for counts in served_by), served_by
            # A worker tells the other what it saw encoded (fleet/siblings.py) before it answers,
            # so each turn's new image is the only one encoded, whichever worker the turn lands on.
            assert sum(served.encoder.counts.images.values()) == 4 * TURNS
    finally:
        await fakes.close()


async def test_a_worker_put_in_place_of_a_dead_one_starts_from_what_its_siblings_saw_encoded():
    async with serve_process("--workers", "2") as served:
        first = await every_worker_listens(served.proc, served.port, 2)
        # A connection per request, so the turns land on either worker.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:

            async def turns(of: range) -> None:
                for conv in range(4):
                    for n in of:
                        async with client.post(f"{served.url}/v1/chat/completions", json=turn_body(conv, n)) as resp:
                            assert resp.status == 200, await resp.text()

            await turns(range(2))
            victim = min(first)
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: victim not in workers_of(served.proc.pid), what="the dead worker reaped")
            now = await every_worker_listens(served.proc, served.port, 2)
            assert victim not in now
            # The new worker asked the other for what it saw encoded before it took a connection,
            # so a turn landing there sends only its own new image to the encoder.
            await turns(range(2, TURNS))
        assert sum(served.encoder.counts.images.values()) == 4 * TURNS
