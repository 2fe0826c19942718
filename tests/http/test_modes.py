"""Mooncake push mode (consumer addresses, DP ranks) and --no-rewrite."""

from __future__ import annotations

from tests.media import chat, image

SIZE = {"size": {"shortest_edge": 3136, "longest_edge": 1000000}}


async def test_mooncake_push_names_consumer_and_aligns_transfer_ids(make_stack):
    stack = await make_stack(encoders=2, ec_consumer_zmq_addrs=("tcp://10.0.0.9:14579",))
    async with await stack.chat(chat(image("A"), image("B"), image("A"), mm_processor_kwargs=SIZE)) as resp:
        assert resp.status == 200, await resp.text()
    sent_ids = {}
    for sub in stack.encoder_requests():
        params = sub["ec_transfer_params"]
        assert params["consumer_zmq"] == "tcp://10.0.0.9:14579"
        assert len(params["ec_items"]) == len(sub["messages"][0]["content"])
        assert all(set(item) == {"transfer_id"} for item in params["ec_items"])
        for part, item in zip(sub["messages"][0]["content"], params["ec_items"]):
            sent_ids.setdefault(part["uuid"], []).append(item["transfer_id"])
    decode = stack.pd.requests[0].body
    ec_items = decode["ec_transfer_params"]["ec_items"]
    assert len(ec_items) == 3 and all(i["mm_hash"] in stack.store.entries for i in ec_items)
    assert ec_items[0]["mm_hash"] == ec_items[2]["mm_hash"]
    assert sorted(i["transfer_id"] for i in ec_items) == sorted(t for ids in sent_ids.values() for t in ids)
    assert "X-data-parallel-rank".lower() not in stack.pd.requests[0].headers


async def test_dp_replicas_rotate_with_rank_header_and_address(make_stack):
    addrs = ("tcp://pd:100", "tcp://pd:101")
    stack = await make_stack(encoders=1, ec_consumer_zmq_addrs=addrs, ec_consumer_dp_size=2)
    for _ in range(3):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 200
    ranks = [seen.headers["x-data-parallel-rank"] for seen in stack.pd.requests]
    zmq = [sub["ec_transfer_params"]["consumer_zmq"] for sub in stack.encoder_requests()]
    assert ranks == ["0", "1", "0"] and zmq == ["tcp://pd:100", "tcp://pd:101", "tcp://pd:100"]
    assert all("x-data-parallel-rank" not in seen.headers for e in stack.encoders for seen in e.requests)


async def test_no_rewrite_sends_raw_media_and_handles_under_engine_hash(make_stack):
    stack = await make_stack(encoders=2, rewrite=False)
    body = chat(image("A"), image("B"), mm_processor_kwargs=SIZE)
    async with await stack.chat(body) as resp:
        assert resp.status == 200
    for sub in stack.encoder_requests():
        assert all("uuid" not in p for p in sub["messages"][0]["content"])
    decode = stack.pd.requests[0].body
    assert decode["messages"] == body["messages"]
    params = decode["ec_transfer_params"]
    assert set(params) == set(stack.store.entries) and "ec_items" not in params
    # the consumer derives the same hash from the raw media and finds the embedding
    assert stack.pd.loaded_from_cache == 2 and stack.pd.encoded_locally == 0


async def test_no_rewrite_with_mooncake_lists_ec_items(make_stack):
    stack = await make_stack(encoders=1, rewrite=False, ec_consumer_zmq_addrs=("tcp://c:1",))
    async with await stack.chat(chat(image("A"), image("B"))) as resp:
        assert resp.status == 200
    ec_items = stack.pd.requests[0].body["ec_transfer_params"]["ec_items"]
    assert [i["mm_hash"] in stack.store.entries for i in ec_items] == [True, True]


async def test_mooncake_consumer_gets_each_occurrence_its_own_transfer_id(make_stack):
    # One group of distinct images plus a repeat: any permutation of the ids within the group
    # hands the consumer a transfer id that names another image's push, and vLLM fails that.
    stack = await make_stack(encoders=1, ec_consumer_zmq_addrs=("tcp://c:1",))
    async with await stack.chat(chat(image("A"), image("B"), image("A"), image("C"))) as resp:
        assert resp.status == 200, await resp.text()
    assert stack.pd.generation_failures == []
    sub = stack.encoder_requests()[0]["ec_transfer_params"]["ec_items"]
    sent = stack.pd.requests[0].body["ec_transfer_params"]["ec_items"]
    assert [i["transfer_id"] for i in sent] == [i["transfer_id"] for i in sub]


async def test_mooncake_consumer_fails_like_vllm_on_a_foreign_transfer_id(make_stack):
    stack = await make_stack(encoders=1, ec_consumer_zmq_addrs=("tcp://c:1",), decode_retries=0)
    async with await stack.chat(chat(image("A"), image("B"))) as resp:
        assert resp.status == 200
    body = stack.pd.requests[0].body
    items = body["ec_transfer_params"]["ec_items"]
    # Pushed again (each push serves one request), then handed over crossed.
    stack.store.pushes.update({item["transfer_id"]: item["mm_hash"] for item in items})
    items[0]["transfer_id"], items[1]["transfer_id"] = items[1]["transfer_id"], items[0]["transfer_id"]
    async with stack.client.post(stack.pd_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"] == {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    assert "names mm_hash" in stack.pd.generation_failures[-1]


async def test_legacy_encoder_items_stay_raw_and_keep_their_ec_items_position(make_stack):
    # E0 reports per-hash entries, E1 is an older encoder whose ec_transfer_params is only a
    # bare list. B (on E1) has no usable entry, sits before the repeated A, and must still hold
    # its own ec_items position, or the second A resolves to the first A's transfer id.
    stack = await make_stack(encoders=2, ec_consumer_zmq_addrs=("tcp://c:1",))
    stack.encoders[1].legacy_params = True
    async with await stack.chat(chat(image("A"), image("B"), image("A"))) as resp:
        assert resp.status == 200, await resp.text()
    assert stack.pd.generation_failures == []
    body = stack.pd.requests[0].body
    kinds = [part["type"] for part in body["messages"][0]["content"][1:]]
    # B has no metadata, so no image is referenced: vLLM refuses raw images beside image embeddings
    assert kinds == ["image_url", "image_url", "image_url"]
    ec_items = body["ec_transfer_params"]["ec_items"]
    assert len(ec_items) == 3 and len({i["transfer_id"] for i in ec_items}) == 3
    assert ec_items[1]["mm_hash"] is None


async def test_legacy_encoder_without_push_mode_leaves_media_raw(make_stack):
    stack = await make_stack(encoders=1, encoder_options={"legacy_params": True})
    async with await stack.chat(chat(image("A"), image("B"))) as resp:
        assert resp.status == 200, await resp.text()
    parts = stack.pd.requests[0].body["messages"][0]["content"][1:]
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    assert stack.pd.loaded_from_cache == 2


async def test_media_io_kwargs_alone_make_the_engine_derive_the_identifier(make_stack):
    stack = await make_stack(encoders=1)
    body = chat(image("A"), media_io_kwargs={"image": {"mode": "RGB"}})
    async with await stack.chat(body) as resp:
        assert resp.status == 200, await resp.text()
    sent = stack.pd.requests[0].body
    part = sent["messages"][0]["content"][1]
    (key,) = stack.store.entries
    assert part["type"] == "image_embeds" and key != part["uuid"]
    assert key in sent["ec_transfer_params"] and stack.pd.loaded_from_cache == 1


async def test_static_split_prefill_pins_the_decode_replica_like_the_reference(make_stack):
    # The static replica flags describe --decode-servers-urls: the reference sends the rank to
    # decode, never to prefill, in E+P+D as in E+PD.
    stack = await make_stack(encoders=1, prefills=1, ec_consumer_dp_size=2)
    for _ in range(2):
        async with await stack.chat(chat(image("A"))) as resp:
            assert resp.status == 200, await resp.text()
    assert [seen.headers.get("x-data-parallel-rank") for seen in stack.pd.requests] == ["0", "1"]
    assert all("x-data-parallel-rank" not in seen.headers for seen in stack.prefills[0].requests)


async def test_a_mooncake_transfer_id_is_single_use_as_in_vllm(make_stack):
    # vLLM's consumer cancels every reservation its request named once the request finishes
    # (`ECMooncakeScheduler.request_finished`): the same body again waits for a push that never
    # comes and fails, so a retried decode needs a fresh push.
    stack = await make_stack(encoders=1, ec_consumer_zmq_addrs=("tcp://c:1",), decode_retries=0)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200, await resp.text()
    body = stack.pd.requests[0].body
    async with stack.client.post(stack.pd_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 500
    assert "no push under transfer id" in stack.pd.generation_failures[-1]


async def test_an_encoder_that_cannot_reach_its_consumer_answers_200_and_the_consumer_fails(make_stack):
    # vLLM's producer pushes after it answered (a failed reserve is logged, not returned): the
    # consumer alone finds out, after its push wait, with a retryable 500. The retry re-encodes
    # with fresh transfer ids, on an encoder that can reach the consumer.
    stack = await make_stack(encoders=2, ec_consumer_zmq_addrs=("tcp://c:1",), decode_retries=1)
    # An idle fleet places the first request on the first encoder (ties go by order).
    stack.encoders[0].unreachable_consumers = {"tcp://c:1"}
    async with await stack.chat(chat(image("A"))) as resp:
        text = await resp.text()
    first = stack.encoders[0].requests
    assert first, "the first attempt's sub-request went to the encoder that cannot push"
    failures = stack.pd.generation_failures
    assert resp.status == 200, text
    assert len(failures) == 1 and "no push under transfer id" in failures[0]
    assert len(stack.pd.requests) == 2 and stack.encoders[1].requests
