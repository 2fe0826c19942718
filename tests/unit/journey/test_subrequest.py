from __future__ import annotations

from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.subrequest import IdMint, encoder_body
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
