"""An item slow on every encoder, and an encoder that accepts work and never answers: moves off
an overdue encoder spend the group's failovers, being merely slow ejects no one, and a staller
stops getting work within about a second while the other encoder answers."""

from __future__ import annotations

import asyncio

import pytest

from epd_proxy.fleet import stalls
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_coalescing import answer_of
from tests.http.test_sharing_bounds import first_encoder_warmed
from tests.media import chat, image


def sent(stack):
    return sum(len(fake.requests) for fake in stack.encoders)


def encoder_health(proxy):
    return proxy.health.snapshot(proxy.fleet.members("encode"))


async def landed(stack, staller, body) -> asyncio.Task:
    """The request's task once it was answered or its sub-request reached the staller."""
    before = len(staller.requests)
    task = asyncio.create_task(answer_of(stack, body))
    await eventually(lambda: task.done() or len(staller.requests) > before, what="answered or stuck")
    return task


async def test_an_item_slow_on_every_encoder_moves_at_most_its_failovers_and_ejects_no_one(make_stack, monkeypatch):
    # The mechanism at a 1 s floor (as the stall tests run it): the item takes 1.5 s anywhere.
    monkeypatch.setattr(stalls, "OVERDUE_FLOOR_S", 1.0)
    stack = await make_stack(encoders=2, encoder_failovers=1, consecutive_gateway_failure=2)
    proxy = stack.state
    await first_encoder_warmed(stack, proxy, delay_s=0.05, rounds=3)
    for fake in stack.encoders:
        fake.faults.delay_s = 1.5
    before = sent(stack)
    status, _ = await answer_of(stack, chat(image("heavy")))
    assert status == 200
    # The first send and one move (--encoder-failovers 1); the move doubled its overdue time, so
    # the second encoder had the time it needed.
    assert sent(stack) - before <= 2
    for view in encoder_health(proxy):
        assert view["ejections"] == 0 and view["consecutive_gateway_failures"] == 0, view


@pytest.mark.parametrize("consumer_encode", [False, True])
async def test_once_its_failovers_are_spent_an_overdue_item_fails_with_a_504_of_the_encode_stage(
    make_stack, monkeypatch, consumer_encode
):
    # With the consumer's last resort on too: an encoder had the media, so the PD never gets them.
    monkeypatch.setattr(stalls, "OVERDUE_FLOOR_S", 1.0)
    stack = await make_stack(encoders=2, encoder_failovers=0, consumer_encode=consumer_encode)
    proxy = stack.state
    await first_encoder_warmed(stack, proxy, delay_s=0.05, rounds=3)
    for fake in stack.encoders:
        fake.faults.delay_s = 3.0
    before, pd_before = sent(stack), len(stack.pd.requests)
    status, answer = await answer_of(stack, chat(image("heavy")))
    assert status == 504, answer
    assert len(stack.pd.requests) == pd_before
    assert answer["error"]["stage"] == "encode"
    assert "expected time" in answer["error"]["message"]
    assert sent(stack) - before == 1, "no move: --encoder-failovers 0"
    assert all(view["ejections"] == 0 for view in encoder_health(proxy))


async def test_an_encoder_that_accepts_but_never_answers_stops_getting_work_within_about_a_second(make_stack):
    # The real 10 s overdue floor: the staller's stuck calls are not moved within the test; it
    # must stop getting new work long before that. Without coalescing every placement reaches
    # its encoder at once (none waits in a lane).
    stack = await make_stack(encoders=2, coalesce=False)
    staller, healthy = stack.encoders
    # The staller was the faster of the two: placement by expected finish favours it.
    staller.faults.delay_s, healthy.faults.delay_s = 0.02, 0.05
    for i in range(4):
        answers = await asyncio.gather(*(answer_of(stack, chat(image(f"w{i}{j}"))) for j in "ab"))
        assert [status for status, _ in answers] == [200, 200]
    assert all(lane.speed.samples for lane in stack.state.lanes.all())
    staller.faults.delay_s = 60.0
    # A clock outside the proxy's fleet that ticks at the healthy encoder's pace (50 ms a call).
    metronome, metronome_url = await stack.fakes.start("encode")
    metronome.faults.delay_s = 0.05
    stuck: list[asyncio.Task] = []
    # The staller's count of sub-requests at each tick since its first stuck call.
    staller_at: list[int] = []
    for n in range(200):
        task = await landed(stack, staller, chat(image(f"r{n}")))
        if task.done():
            assert task.result()[0] == 200
        else:
            stuck.append(task)
        if stuck:
            staller_at.append(len(staller.requests))
            if len(staller_at) > 60:
                break
        async with stack.client.post(metronome_url + "/v1/chat/completions", json=chat(image("tick"))) as tick:
            assert tick.status == 200
    for task in stuck:
        task.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)
    assert metronome.requests and stuck, "the staller got work before it was found out"
    # 30 ticks of at least 50 ms after its first stuck call, the staller gets nothing new.
    assert staller_at[30] == staller_at[-1], staller_at
