"""E+PD through the proxy against fake vLLM servers that enforce vLLM's EC contract."""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import threading

import blake3
import orjson
import pytest

import epd_proxy.http.routes as routes_module
from tests.media import audio, chat, image

SIZE = {"size": {"shortest_edge": 3136, "longest_edge": 1000000}}


def essentials(answer):
    return answer["choices"], answer["usage"]


async def answer_of(stack, body):
    async with await stack.chat(body) as resp:
        assert resp.status == 200, await resp.text()
        return essentials(await resp.json())


async def direct_answer(stack, body):
    """What one consumer answers when it gets the raw request itself (no disaggregation)."""
    async with stack.client.post(stack.pd_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return essentials(await resp.json())


async def test_single_image_is_encoded_once_and_referenced(make_stack):
    stack = await make_stack(encoders=2)
    choices, _ = await answer_of(stack, chat(image("A")))
    assert choices[0]["message"]["content"].startswith("answer-")
    assert len(stack.encoder_requests()) == 1
    part = stack.pd.requests[0].body["messages"][0]["content"][1]
    assert part["type"] == "image_embeds" and set(part) == {"type", "image_embeds", "uuid"}
    assert stack.pd.loaded_from_cache == 1 and stack.pd.encoded_locally == 0


async def test_single_image_requests_rotate_over_encoders_under_round_robin(make_stack):
    # Without reuse the same image is encoded on every request, not sent raw once the fleet holds it.
    stack = await make_stack(encoders=3, encode_policy="round_robin", reuse=False)
    for _ in range(4):
        await answer_of(stack, chat(image("A")))
    assert [len(e.requests) for e in stack.encoders] == [2, 1, 1]
    assert stack.encoders[0].requests[1].body == stack.encoders[0].requests[0].body


@pytest.mark.parametrize("cap, sizes", [(0, [3, 3]), (1, [1] * 6), (2, [2, 2, 1, 1])])
async def test_batching_cap_shapes_the_fan_out(make_stack, cap, sizes):
    stack = await make_stack(encoders=2, encoder_max_batch_size=cap)
    body = chat(*(image(n) for n in "AACDAF"), **{"mm_processor_kwargs": SIZE})
    answer = await answer_of(stack, body)
    got = sorted((len(r["messages"][0]["content"]) for r in stack.encoder_requests()), reverse=True)
    assert got == sorted(sizes, reverse=True)
    assert answer == await direct_answer(stack, body)


async def test_repeated_images_with_derived_hashes_match_the_direct_answer(make_stack):
    stack = await make_stack(encoders=2)
    body = chat(*(image(n) for n in "ABACD"), mm_processor_kwargs=SIZE)
    original = copy.deepcopy(body)
    answer = await answer_of(stack, body)
    assert body == original
    assert stack.pd.loaded_from_cache == 5 and stack.pd.encoded_locally == 0
    assert answer == await direct_answer(stack, body)
    sent = stack.pd.requests[0].body
    assert [p["type"] for p in sent["messages"][0]["content"][1:]] == ["image_embeds"] * 5
    assert len(sent["ec_transfer_params"]["ec_items"]) == 5
    assert len({i["transfer_id"] for i in sent["ec_transfer_params"]["ec_items"]}) == 5


async def test_processing_options_reach_every_encoder_request(make_stack):
    stack = await make_stack(encoders=2)
    options = {
        "mm_processor_kwargs": SIZE,
        "media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}},
        "priority": 5,
        "session_id": "sess-1",
    }
    await answer_of(stack, chat(image("A"), image("B"), image("C"), **options))
    for sub in stack.encoder_requests():
        for name, value in options.items():
            assert sub[name] == value
        assert sub["stream"] is False and "max_tokens" not in sub
        assert [m["role"] for m in sub["messages"]] == ["user"]
        assert all(p["type"] == "image_url" and p["uuid"] for p in sub["messages"][0]["content"])


async def test_encoder_child_ids_name_the_client_request(make_stack):
    stack = await make_stack(encoders=2)
    await answer_of(stack, chat(image("A"), image("B")))
    async with await stack.chat(chat(image("C")), headers={"x-request-id": "client-7"}) as resp:
        assert resp.headers["x-request-id"] == "client-7"
    ids = [seen.headers["x-request-id"] for e in stack.encoders for seen in e.requests]
    assert any(i.startswith("client-7:0:") for i in ids)
    assert stack.pd.requests[-1].headers["x-request-id"] == "client-7"


async def test_text_only_skips_the_encoders(make_stack):
    stack = await make_stack(encoders=2)
    await answer_of(stack, chat())
    assert stack.encoder_requests() == []
    assert "ec_transfer_params" not in stack.pd.requests[0].body


async def test_audio_is_single_and_references_are_all_or_nothing(make_stack):
    stack = await make_stack(encoders=1)
    body = chat(image("A"), audio("s"), image("B"))
    assert (await answer_of(stack, body)) == await direct_answer(stack, body)
    assert sorted(len(r["messages"][0]["content"]) for r in stack.encoder_requests()) == [1, 2]
    parts = stack.pd.requests[0].body["messages"][0]["content"][1:]
    assert [p["type"] for p in parts] == ["image_embeds", "audio_embeds", "image_embeds"]


async def test_old_encoders_without_positions_still_work_one_item_at_a_time(make_stack):
    stack = await make_stack(encoders=2, encoder_options={"report_indices": False}, encoder_max_batch_size=1)
    body = chat(image("A"), image("B"), image("A"), mm_processor_kwargs=SIZE)
    assert (await answer_of(stack, body)) == await direct_answer(stack, body)


async def test_ambiguous_batch_from_old_encoder_is_502(make_stack):
    stack = await make_stack(encoders=1, encoder_options={"report_indices": False})
    async with await stack.chat(chat(image("A"), image("B"), mm_processor_kwargs=SIZE)) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert "cannot be matched" in error["message"] and error["stage"] == "match"
    assert stack.pd.requests == []


async def test_connector_handles_are_keyed_by_the_engine_hash(make_stack):
    handles = {"peer_host": "10.1.1.1", "peer_port": 9000, "size_bytes": 4096}
    stack = await make_stack(encoders=1, encoder_options={"handles": handles})
    await answer_of(stack, chat(image("A"), image("B"), mm_processor_kwargs=SIZE))
    params = stack.pd.requests[0].body["ec_transfer_params"]
    reported = stack.encoders[0].requests[0].body  # noqa: F841 - the encoder derived these keys
    engine_hashes = [i["mm_hash"] for i in params["ec_items"]]
    assert set(engine_hashes) == set(stack.store.entries)
    for h in engine_hashes:
        assert params[h]["peer_host"] == "10.1.1.1" and params[h]["size_bytes"] == 4096


async def test_the_fake_consumer_fails_where_vllm_fails(make_stack):
    """The fakes must be able to catch the bugs the proxy tests are about."""
    stack = await make_stack(encoders=1)
    part = image("A")
    uuid = "0" * 64

    async def post(url, body):
        async with stack.client.post(url + "/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.text()

    missing = chat({"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": uuid})
    status, text = await post(stack.pd_url, missing)
    assert status == 500 and "Expected number of multimodal embeddings" in text

    # The pre-fix proxy: the encoder gets no options, so it stores under the bare uuid, while PD
    # (which gets the options) derives another identifier and finds nothing.
    status, text = await post(stack.backend_urls["e"][0], chat({**part, "uuid": uuid}))
    grid = orjson.loads(text)["ec_transfer_params"][uuid]["metadata"]["image_grid_thw"][0]
    reference = chat({"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": uuid})
    assert (await post(stack.pd_url, reference))[0] == 200
    status, text = await post(stack.pd_url, {**reference, "mm_processor_kwargs": SIZE})
    assert status == 500 and "Expected number of multimodal embeddings" in text

    wrong_grid = chat({"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": uuid})
    status, text = await post(stack.pd_url, wrong_grid)
    assert status == 500 and "multimodal tokens to 1 placeholders" in text


def big_image(name: str, size: int) -> dict:
    data = base64.b64encode(name.encode() * (size // len(name))).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


@pytest.mark.parametrize("offload_above", [1 << 40, 64 * 1024])
async def test_large_bodies_are_read_off_the_loop_with_the_same_outcome(make_stack, monkeypatch, offload_above):
    """Bodies above the offload size are lifted and hashed in a worker thread; everything the
    backends see is what the loop itself would have produced."""
    threads = []
    real_parse_request = routes_module.CHAT.parse

    def recording_parse_request(*args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return real_parse_request(*args, **kwargs)

    monkeypatch.setattr(routes_module, "OFFLOAD_READ_BYTES", offload_above)
    monkeypatch.setattr(routes_module, "CHAT", dataclasses.replace(routes_module.CHAT, parse=recording_parse_request))
    stack = await make_stack(encoders=2)
    body = chat(big_image("A", 90_000), big_image("B", 60_000), image("C"))
    answer = await answer_of(stack, body)
    assert threads == [offload_above > 1 << 30]  # on the loop's thread only below the offload size
    assert answer == await direct_answer(stack, body)
    urls = [part["image_url"]["url"] for part in body["messages"][0]["content"][1:]]
    sent = [part for r in stack.encoder_requests() for part in r["messages"][0]["content"]]
    assert sorted(part["uuid"] for part in sent) == sorted(hashlib.sha256(u.encode()).hexdigest() for u in urls)
    assert sorted(part["image_url"]["url"] for part in sent) == sorted(urls)


async def test_blake3_media_hash_names_media_on_both_parse_paths(make_stack):
    stack = await make_stack(encoders=2, media_hash="blake3")
    lifted, parsed = big_image("A", 3000), image("B")  # only the first is long enough to be lifted
    body = chat(lifted, parsed)
    answer = await answer_of(stack, body)
    assert stack.pd.loaded_from_cache == 2 and stack.pd.encoded_locally == 0
    assert answer == await direct_answer(stack, body)
    urls = {part["image_url"]["url"] for part in (lifted, parsed)}
    names = {blake3.blake3(url.encode()).hexdigest() for url in urls}
    sent = [part for r in stack.encoder_requests() for part in r["messages"][0]["content"]]
    assert {part["uuid"] for part in sent} == names
    references = [p for p in stack.pd.requests[0].body["messages"][0]["content"] if p["type"] == "image_embeds"]
    assert {p["uuid"] for p in references} == names
