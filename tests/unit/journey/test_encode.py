from __future__ import annotations

import base64

import orjson
import pytest

from epd_proxy.fleet.scheduler import coalesce_key
from epd_proxy.journey.encode import FORWARDED_FIELDS, IdMint, Work, coalesced_payload, encoder_body
from epd_proxy.journey.extract import normalise_request, parse_request
from epd_proxy.journey.trace import Trace
from tests.media import chat, image


def test_encoder_body_carries_only_media_and_the_processing_options():
    body = chat(
        image("A"),
        image("B"),
        seed=3,
        temperature=0,
        max_tokens=99,
        mm_processor_kwargs={"size": {"shortest_edge": 1}},
        media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}},
        priority=-1,
        session_id="s1",
    )
    items = normalise_request(body).items
    sub = encoder_body(body, items, send_uuid=True)
    assert sub == {
        "model": "tiny-vlm",
        "messages": [
            {
                "role": "user",
                "content": [{**items[0].part, "uuid": items[0].uuid}, {**items[1].part, "uuid": items[1].uuid}],
            }
        ],
        "stream": False,
        "mm_processor_kwargs": {"size": {"shortest_edge": 1}},
        "media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}},
        "priority": -1,
        "session_id": "s1",
    }
    assert "uuid" not in body["messages"][0]["content"][1]


def test_push_mode_names_the_consumer_and_one_transfer_id_per_item_in_order():
    body = chat(image("A"), image("A"))
    items = normalise_request(body).items
    sub = encoder_body(body, items, send_uuid=False, transfer_ids=["t1", "t2"], consumer_zmq="tcp://c:1")
    assert sub["ec_transfer_params"] == {
        "consumer_zmq": "tcp://c:1",
        "ec_items": [{"transfer_id": "t1"}, {"transfer_id": "t2"}],
    }
    assert sub["messages"][0]["content"][0] is items[0].part


def test_child_ids_name_the_parent_and_first_item():
    mint = IdMint()
    rid = mint.child_request_id("req", 4)
    parent, first, suffix = rid.split(":")
    assert (parent, first, len(suffix)) == ("req", "4", 6)
    assert mint.child_request_id("req", 4) != rid


def test_transfer_ids_are_unique_within_and_across_mints():
    ids = {IdMint().transfer_id() for _ in range(50)} | {m.transfer_id() for m in [IdMint()] for _ in range(1000)}
    assert len(ids) == 1050 and all(len(i) == 32 for i in ids)


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
