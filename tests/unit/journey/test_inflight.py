"""Identical images in flight at once are encoded once (inflight.py), against scripted encodes."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from epd_proxy.errors import ProxyError
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.inflight import InFlight
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.trace import Trace
from tests.media import chat, image

GRID = {"image_grid_thw": [[1, 4, 4]]}


class Encoder:
    """An encode step the test releases by hand: what each call was asked, and its answer."""

    def __init__(self, fail: BaseException | None = None, unmatched: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.release = asyncio.Event()
        self.fail = fail
        self.unmatched = unmatched

    async def __call__(self, items) -> Matches:
        self.calls.append([item.uuid for item in items])
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        matches = Matches()
        for item in items:
            mm_hash = None if self.unmatched else f"hash-{item.uuid[:8]}"
            matches.items[item.index] = ItemMatch(GRID, mm_hash, f"own-{item.index}")
            if mm_hash is not None:
                matches.handles[mm_hash] = {"peer": "e1"}
        return matches


def request(*names: str):
    items = normalise_request(chat(*(image(name) for name in names))).items
    return items, {item.index: f"name-{item.uuid}" for item in items}


ids = itertools.count()


async def encode(in_flight: InFlight, items, names, encoder, trace=None) -> Matches:
    return await in_flight.encode(items, names, encoder, lambda: f"t{next(ids)}", trace or Trace("r"))


async def started(encoder: Encoder, calls: int) -> None:
    while len(encoder.calls) < calls:
        await asyncio.sleep(0)


async def test_a_request_waits_for_the_same_image_in_flight_and_takes_its_answer():
    in_flight = InFlight()
    first, second = Encoder(), Encoder()
    items, names = request("x")
    one = asyncio.create_task(encode(in_flight, items, names, first))
    await started(first, 1)
    other_items, other_names = request("y", "x")
    two = asyncio.create_task(encode(in_flight, other_items, other_names, second))
    await started(second, 1)
    assert second.calls == [[other_items[0].uuid]]  # only its own image goes out
    first.release.set()
    second.release.set()
    mine, theirs = await one, await two
    shared = theirs.items[1]
    assert (shared.metadata, shared.ec_mm_hash) == (mine.items[0].metadata, mine.items[0].ec_mm_hash)
    assert shared.transfer_id != mine.items[0].transfer_id and theirs.handles[shared.ec_mm_hash] == {"peer": "e1"}
    assert len(in_flight) == 0


@pytest.mark.parametrize(
    ("failure", "media_failed"),
    [
        (ProxyError(500, "boom", stage="encode", backend="http://e1", answered=500), True),
        (ProxyError(400, "bad image", stage="encode", backend="http://e1", answered=400), False),
        (asyncio.CancelledError(), False),
        (None, False),  # answered, but nothing the proxy could match to the item
    ],
    ids=["5xx", "4xx", "cancelled", "unmatched"],
)
async def test_when_the_encode_it_waited_for_fails_a_request_encodes_on_its_own(failure, media_failed):
    in_flight = InFlight()
    first, second = Encoder(fail=failure, unmatched=failure is None), Encoder()
    items, names = request("x")
    one = asyncio.create_task(encode(in_flight, items, names, first))
    await started(first, 1)
    trace = Trace("r2")
    two = asyncio.create_task(encode(in_flight, items, names, second, trace))
    for _ in range(5):
        await asyncio.sleep(0)
    assert second.calls == []  # waiting, not sending
    first.release.set()
    second.release.set()
    await asyncio.gather(one, return_exceptions=True)
    matches = await two
    assert second.calls == [[items[0].uuid]] and matches.items[0].transfer_id == "own-0"
    assert (trace.media_failed_on == "http://e1") is media_failed
    assert len(in_flight) == 0


async def test_a_request_that_goes_away_leaves_the_image_to_the_one_waiting():
    in_flight = InFlight()
    first, second = Encoder(), Encoder()
    items, names = request("x")
    one = asyncio.create_task(encode(in_flight, items, names, first))
    await started(first, 1)
    two = asyncio.create_task(encode(in_flight, items, names, second))
    for _ in range(5):
        await asyncio.sleep(0)
    one.cancel()
    second.release.set()
    matches = await two
    assert one.cancelled() and second.calls == [[items[0].uuid]] and 0 in matches.items


async def test_a_repeat_within_one_request_goes_out_with_it():
    in_flight = InFlight()
    encoder = Encoder()
    items, names = request("x", "x")
    encoder.release.set()
    matches = await encode(in_flight, items, names, encoder)
    assert encoder.calls == [[items[0].uuid, items[1].uuid]] and set(matches.items) == {0, 1}
