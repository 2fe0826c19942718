from __future__ import annotations

import asyncio
import base64
import time

import orjson
import pytest

from epd_proxy.journey.coalesce import Work, coalesced_payload
from epd_proxy.journey.extract import normalise_request, parse_request
from epd_proxy.journey.subrequest import FORWARDED_FIELDS, LOOP_LAG_S, Overdue, coalesce_key, encoder_body
from epd_proxy.journey.trace import Trace
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image


def big_image(name: str) -> dict:
    data = base64.b64encode(f"image-{name}".encode() * 200).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def work_of(raw: bytes, consumer_zmq: str | None = None) -> Work:
    normalised, spliced = parse_request(raw)
    dumps = spliced.dumps if spliced is not None else orjson.dumps
    key = coalesce_key(normalised.body, FORWARDED_FIELDS, consumer_zmq)
    return Work(key, list(normalised.items), normalised.body, consumer_zmq, Trace("r"), dumps, None)


@pytest.mark.parametrize("consumer_zmq", [None, "tcp://c:1"])
def test_a_shared_body_is_each_requests_media_around_the_fields_they_share(consumer_zmq):
    options = {"mm_processor_kwargs": {"size": {"shortest_edge": 4}}, "priority": 2}
    raws = [
        orjson.dumps(chat(big_image("A"), image("B"), **options)),  # spliced: A stays the client's bytes
        orjson.dumps(chat(big_image("C"), **options, max_tokens=50)),
        orjson.dumps(chat(image("D"), big_image("A"), **options, temperature=0.5)),
    ]
    works = [work_of(raw, consumer_zmq) for raw in raws]
    assert len({work.key for work in works}) == 1
    items = [item for work in works for item in work.items]
    ids = [f"t{i}" for i in range(len(items))]
    payload = coalesced_payload(works, ids, send_uuid=True)
    sent = orjson.loads(b"".join(bytes(piece) for piece in payload))
    # What one request holding all of these media would send, its URLs parsed in full.
    every_item = [item for raw in raws for item in normalise_request(orjson.loads(raw)).items]
    alone = encoder_body(works[0].body, every_item, send_uuid=True, transfer_ids=ids, consumer_zmq=consumer_zmq)
    assert sent == alone
    assert [part["uuid"] for part in sent["messages"][0]["content"]] == [item.uuid for item in items]
    # A lifted URL goes out as a slice of its own client's buffer, never copied into a string.
    assert any(isinstance(piece, memoryview) for piece in payload)


def test_a_shared_body_without_uuids_forwards_the_parts_as_they_are():
    works = [work_of(orjson.dumps(chat(image(n)))) for n in "XY"]
    sent = orjson.loads(b"".join(bytes(p) for p in coalesced_payload(works, ["a", "b"], send_uuid=False)))
    assert sent["messages"][0]["content"] == [works[0].items[0].part, works[1].items[0].part]
    assert "ec_transfer_params" not in sent and sent["stream"] is False


async def test_the_overdue_watchdog_fires_on_time_but_not_for_its_own_event_loops_stall():
    fired = []
    Overdue(0.05, lambda: fired.append("on time"))
    await eventually(lambda: fired, what="the watchdog fired")
    late = Overdue(0.05, lambda: fired.append("late"))
    time.sleep(0.05 + LOOP_LAG_S * 2)  # the loop itself held up past the deadline
    await asyncio.sleep(0.01)
    assert fired == ["on time"], "a late wake-up says nothing about the encoder"
    await eventually(lambda: fired == ["on time", "late"], what="it fired once the loop was on time")
    late.cancel()
