"""/v1/responses and /v1/messages through the proxy against the fakes, compared with what one
consumer answers when it gets the same request itself."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import threading

import orjson
import pytest

from epd_proxy.http import agents as agents_module
from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

BIG = "A" * 4096  # large enough for the splice fast path


def b64(name: str, pad: str = "") -> str:
    return base64.b64encode(f"image-{name}{pad}".encode()).decode()


def responses_body(*names: str, stream: bool = False, **fields):
    parts = [{"type": "input_text", "text": "What is shown?"}]
    parts += [{"type": "input_image", "image_url": f"data:image/png;base64,{b64(n)}"} for n in names]
    return {"model": "tiny-vlm", "input": [{"role": "user", "content": parts}], "stream": stream, **fields}


def messages_body(*names: str, stream: bool = False, **fields):
    blocks = [{"type": "text", "text": "What is shown?"}]
    blocks += [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(n)}} for n in names
    ]
    return {
        "model": "tiny-vlm",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": blocks}],
        "stream": stream,
        **fields,
    }


BODIES = {"responses": responses_body, "messages": messages_body}


def essentials(api: str, answer: dict):
    if api == "messages":
        return answer["content"], answer["usage"], answer["stop_reason"]
    return [item["content"] for item in answer["output"]], answer["usage"], answer["status"]


async def post(stack, url: str, api: str, body, **kwargs):
    async with stack.client.post(f"{url}/v1/{api}", json=body, **kwargs) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def text_of_stream(api: str, raw: bytes) -> str:
    text = []
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                data = orjson.loads(line[6:])
                if api == "messages" and data.get("type") == "content_block_delta":
                    text.append(data["delta"]["text"])
                if api == "responses" and data.get("type") == "response.output_text.delta":
                    text.append(data["delta"])
    return "".join(text)


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("names", [("A",), ("A", "B", "A")])
@pytest.mark.parametrize("prefills", [0, 1])
async def test_answers_equal_the_consumers_own_and_embeddings_come_from_the_encoders(make_stack, api, names, prefills):
    stack = await make_stack(encoders=2, prefills=prefills)
    body = BODIES[api](*names)
    status, _, raw = await post(stack, stack.url, api, body)
    assert status == 200, raw
    consumer = (stack.prefills or stack.consumers)[0]
    assert consumer.loaded_from_cache == len(names) and consumer.encoded_locally == 0
    assert sum(len(e.requests) for e in stack.encoders) >= 1
    sent = consumer.requests[0].body
    assert sent["ec_transfer_params"]
    if prefills:
        assert sent["kv_transfer_params"]["do_remote_decode"] is True
        assert stack.pd.requests[0].body["kv_transfer_params"]["remote_block_ids"] == [1, 2, 3]
    # The same request straight to a consumer that runs everything itself.
    alone = await make_stack(encoders=1)
    status, _, direct = await post(alone, alone.pd_url, api, body)
    assert status == 200, direct
    assert essentials(api, orjson.loads(raw)) == essentials(api, orjson.loads(direct))


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_streams_are_relayed_as_the_consumer_wrote_them(make_stack, api):
    stack = await make_stack(encoders=1)
    status, content_type, raw = await post(stack, stack.url, api, BODIES[api]("A", stream=True))
    assert status == 200 and content_type.startswith("text/event-stream")
    alone = await make_stack(encoders=1)
    _, _, direct = await post(alone, alone.pd_url, api, BODIES[api]("A", stream=True))
    assert text_of_stream(api, raw) == text_of_stream(api, direct) != ""
    assert stack.pd.loaded_from_cache == 1


async def test_responses_images_reach_the_consumer_under_the_proxys_uuid(make_stack):
    stack = await make_stack(encoders=1)
    body = responses_body("A")
    body["input"][0]["content"][1]["uuid"] = "forged"
    status, _, raw = await post(stack, stack.url, "responses", body)
    assert status == 200, raw
    part = stack.pd.requests[0].body["messages"][0]["content"][1]
    encoder_part = stack.encoders[0].requests[0].body["messages"][0]["content"][0]
    assert part["type"] == "input_image" and part["uuid"] == encoder_part["uuid"] != "forged"


async def test_messages_images_reach_the_encoder_as_the_consumer_builds_them(make_stack):
    stack = await make_stack(encoders=1)
    status, _, raw = await post(stack, stack.url, "messages", messages_body("A"))
    assert status == 200, raw
    encoder_part = stack.encoders[0].requests[0].body["messages"][0]["content"][0]
    assert encoder_part == {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64('A')}"}}


async def test_tool_result_images_are_encoded_too(make_stack):
    stack = await make_stack(encoders=1)
    screen = f"data:image/png;base64,{b64('screen')}"
    image = {"type": "image", "source": {"type": "url", "url": screen}}
    body = messages_body("A")
    status, _, raw = await post(stack, stack.url, "messages", body)
    assert status == 200, raw
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]
    status, _, raw = await post(stack, stack.url, "messages", body)
    assert status == 200, raw
    # The first turn's image the fleet holds since that turn, left to the consumer (reuse.py); the
    # tool result's image is new and comes from the encoder.
    sent = [[p["image_url"]["url"] for p in r.body["messages"][0]["content"]] for r in stack.encoders[0].requests]
    assert sent[1:] == [[screen]]
    # Each turn's new image, loaded from the EC store; the first is in the second turn's prefix.
    assert stack.pd.loaded_from_cache == 2


@pytest.mark.parametrize(
    "api, field, value",
    [
        ("responses", "ec_transfer_params", {"x": 1}),
        ("messages", "kv_transfer_params", {"do_remote_prefill": True}),
        ("responses", "vllm_xargs", {"ec_transfer_params": "x"}),
        ("responses", "previous_response_id", "resp_1"),
        ("responses", "background", True),
    ],
)
async def test_fields_the_proxy_cannot_honour_are_a_400_naming_them(make_stack, api, field, value):
    stack = await make_stack(encoders=1)
    status, _, raw = await post(stack, stack.url, api, BODIES[api]("A", **{field: value}))
    assert status == 400
    assert field in raw.decode()
    assert not stack.encoders[0].requests and not stack.pd.requests
    if api == "messages":
        assert orjson.loads(raw)["type"] == "error"


async def test_client_embeddings_in_responses_input_are_refused(make_stack):
    stack = await make_stack(encoders=1)
    body = responses_body()
    body["input"][0]["content"].append({"type": "input_text", "text": "x", "image_embeds": {}, "uuid": "u"})
    status, _, raw = await post(stack, stack.url, "responses", body)
    assert status == 400 and b"image_embeds" in raw


def tool_turn(*output, kind: str = "function_call_output"):
    """A Responses agent's next turn: its tool's output, parts and all, after the call."""
    body = responses_body()
    body["input"] += [
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": kind, "call_id": "c1", "output": list(output)},
    ]
    return body


TOOL_OUTPUT_ATTACKS = {
    # A metadata-only embeddings reference: a PD engine without that cache entry dies on it.
    "embeddings": {"type": "input_image", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "attacker-chosen"},
    # No data, another tenant's uuid: vLLM would look the image up in the encoder cache.
    "data-less": {
        "type": "input_image",
        "image_url": None,
        "uuid": hashlib.sha256(b"https://x/theirs.png").hexdigest(),
    },
}


@pytest.mark.parametrize("kind", ["function_call_output", "custom_tool_call_output"])
@pytest.mark.parametrize("attack", sorted(TOOL_OUTPUT_ATTACKS))
async def test_a_tool_outputs_references_are_refused_before_any_backend_sees_them(make_stack, kind, attack):
    stack = await make_stack(encoders=1)
    status, _, raw = await post(stack, stack.url, "responses", tool_turn(TOOL_OUTPUT_ATTACKS[attack], kind=kind))
    assert status == 400, raw
    assert "input[2].output[0]" in orjson.loads(raw)["error"]["message"]
    assert not stack.encoders[0].requests and not stack.pd.requests


async def test_a_tool_outputs_image_is_encoded_and_reaches_the_consumer_under_the_proxys_uuid(make_stack):
    stack = await make_stack(encoders=1)
    url = f"data:image/png;base64,{b64('screen')}"
    screen = {"type": "input_image", "image_url": url, "uuid": "forged"}
    status, _, raw = await post(
        stack, stack.url, "responses", tool_turn({"type": "input_text", "text": "now:"}, screen)
    )
    assert status == 200, raw
    [encoded] = [p for r in stack.encoders[0].requests for p in r.body["messages"][0]["content"]]
    assert encoded["image_url"]["url"] == url
    # The consumer's tool message, as vLLM builds it from the item's output.
    [tool] = [m for m in stack.pd.requests[0].body["messages"] if m["role"] == "tool"]
    assert tool["content"][1] == {"type": "input_image", "image_url": url, "uuid": encoded["uuid"]}
    assert encoded["uuid"] != "forged"
    assert stack.pd.loaded_from_cache == 1 and stack.pd.encoded_locally == 0


@pytest.mark.parametrize(
    "api, body",
    [
        ("messages", {"model": "tiny-vlm", "messages": [{"role": "user", "content": "hi"}]}),
        ("messages", {"model": "tiny-vlm", "max_tokens": 0, "messages": []}),
        ("responses", {"model": "tiny-vlm"}),
        ("responses", {"model": "tiny-vlm", "input": [{"type": "bogus"}]}),
    ],
)
async def test_bad_bodies_get_the_consumers_own_4xx_in_its_shape(make_stack, api, body):
    stack = await make_stack(encoders=1)
    got = await post(stack, stack.url, api, body)
    direct = await post(stack, stack.pd_url, api, body)
    assert got[0] == direct[0] == 400
    assert orjson.loads(got[2]) == orjson.loads(direct[2])


async def test_an_encoder_error_reaches_an_anthropic_client_in_anthropics_shape(make_stack):
    stack = await make_stack(encoders=1)
    stack.encoders[0].faults.fail_next(status=400, body="cannot identify image file")
    status, _, raw = await post(stack, stack.url, "messages", messages_body("A"))
    assert status == 400
    answer = orjson.loads(raw)
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "cannot identify image file" in answer["error"]["message"]


async def test_an_unreachable_decoder_answers_anthropic_clients_in_their_shape(make_stack):
    stack = await make_stack(encoders=1)
    await stack.servers[-1].close()  # the decoder: consumers are started last
    status, _, raw = await post(stack, stack.url, "messages", messages_body())
    answer = orjson.loads(raw)
    assert status == 502 and answer["type"] == "error" and "Decode" in answer["error"]["message"]


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_consumer_500_is_retried_with_a_fresh_encode(make_stack, api):
    stack = await make_stack(encoders=1)
    stack.pd.faults.fail_next(status=500)
    status, _, raw = await post(stack, stack.url, api, BODIES[api]("A"))
    assert status == 200, raw
    assert len(stack.encoders[0].requests) == 2


async def test_api_key_guards_both_doors_and_messages_takes_x_api_key(make_stack):
    stack = await make_stack(encoders=1, api_key="sekret")
    assert (await post(stack, stack.url, "responses", responses_body()))[0] == 401
    assert (await post(stack, stack.url, "messages", messages_body()))[0] == 401
    headers = {"x-api-key": "sekret"}
    assert (await post(stack, stack.url, "messages", messages_body(), headers=headers))[0] == 200
    assert (await post(stack, stack.url, "responses", responses_body(), headers=headers))[0] == 401
    bearer = {"Authorization": "Bearer sekret"}
    assert (await post(stack, stack.url, "responses", responses_body(), headers=bearer))[0] == 200


async def test_metrics_count_requests_per_endpoint(make_stack):
    stack = await make_stack(encoders=1)
    await post(stack, stack.url, "responses", responses_body("A"))
    await post(stack, stack.url, "messages", messages_body("A"))
    await post(stack, stack.url, "messages", {"model": "tiny-vlm"})
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        text = await resp.text()
    assert 'epd_endpoint_requests_total{endpoint="responses",status="200"} 1.0' in text
    assert 'epd_endpoint_requests_total{endpoint="messages",status="200"} 1.0' in text
    assert 'epd_endpoint_requests_total{endpoint="messages",status="400"} 1.0' in text
    async with stack.client.get(f"{stack.url}/status.json") as resp:
        assert (await resp.json())["totals"]["endpoints"] == {"messages": 2, "responses": 1}


async def test_large_responses_images_take_the_splice_path(make_stack):
    stack = await make_stack(encoders=1)
    body = responses_body()
    url = f"data:image/png;base64,{b64('big', BIG)}"
    body["input"][0]["content"].append({"type": "input_image", "image_url": url})
    status, _, raw = await post(stack, stack.url, "responses", body)
    assert status == 200, raw
    assert stack.pd.requests[0].body["messages"][0]["content"][1]["image_url"] == url
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        assert 'epd_request_parse_total{path="splice"} 1.0' in await resp.text()


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_stream_that_fails_before_generating_is_retried(make_stack, api):
    stack = await make_stack(encoders=1)
    stack.pd.faults.generation_errors = 1
    status, _, raw = await post(stack, stack.url, api, BODIES[api]("A", stream=True))
    assert status == 200 and b"event: error" not in raw
    assert text_of_stream(api, raw) != "" and len(stack.encoders[0].requests) == 2


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_stream_failing_on_every_attempt_is_relayed_and_counted_aborted(make_stack, api):
    stack = await make_stack(encoders=1, decode_retries=0)
    stack.pd.faults.generation_errors = 1
    status, _, raw = await post(stack, stack.url, api, BODIES[api]("A", stream=True))
    assert status == 200 and raw.endswith(b"\n\n") and b"event: error\n" in raw
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        assert f'epd_endpoint_requests_total{{endpoint="{api}",status="aborted"}} 1.0' in await resp.text()


async def test_count_tokens_is_answered_by_a_decoder_and_takes_x_api_key(make_stack):
    stack = await make_stack(encoders=1, api_key="sekret")
    body = messages_body("A")
    headers = {"x-api-key": "sekret"}
    got = await post(stack, stack.url, "messages/count_tokens", body, headers=headers)
    direct = await post(stack, stack.pd_url, "messages/count_tokens", body)
    assert got[0] == direct[0] == 200 and orjson.loads(got[2]) == orjson.loads(direct[2])
    assert orjson.loads(got[2])["input_tokens"] > 0 and not stack.encoders[0].requests
    assert (await post(stack, stack.url, "messages/count_tokens", body))[0] == 401
    forged = await post(stack, stack.url, "messages/count_tokens", {**body, "ec_transfer_params": {}}, headers=headers)
    assert forged[0] == 400 and orjson.loads(forged[2])["type"] == "error"


async def test_count_tokens_keeps_the_media_limit_of_the_door_it_counts_for(make_stack):
    stack = await make_stack(encoders=1, max_media_items=2)
    status, _, raw = await post(stack, stack.url, "messages/count_tokens", messages_body("A", "B", "C"))
    error = orjson.loads(raw)
    assert status == 400 and error["type"] == "error" and "more than 2 media items" in error["error"]["message"]
    assert stack.pd.token_counts == 0
    # The same images in a tool result count alike, as /v1/messages counts them.
    blocks = messages_body("A", "B", "C")["messages"][0]["content"][1:]
    nested = {
        **messages_body(),
        "messages": [{"role": "user", "content": [{"type": "tool_result", "content": blocks}]}],
    }
    assert (await post(stack, stack.url, "messages/count_tokens", nested))[0] == 400
    assert stack.pd.token_counts == 0
    assert (await post(stack, stack.url, "messages/count_tokens", messages_body("A", "B")))[0] == 200
    assert stack.pd.token_counts == 1


async def test_count_tokens_is_refused_fast_while_max_inflight_is_taken(make_stack):
    stack = await make_stack(encoders=1, max_inflight=1)
    stack.encoders[0].faults.delay_s = 2
    slow = asyncio.create_task(stack.chat(chat(image("slow"))))
    await eventually(lambda: stack.state.admission.inflight == 1, timeout=20, what="the slow request holds the slot")
    calls = [post(stack, stack.url, "messages/count_tokens", messages_body("A")) for _ in range(5)]
    for status, _, raw in await asyncio.gather(*calls):
        assert status == 503 and orjson.loads(raw) == {
            "type": "error",
            "error": {
                "type": "overloaded",
                "message": "the proxy is at its limit of 1 requests in flight; retry shortly",
            },
        }
    async with stack.client.post("/v1/messages/count_tokens", json=messages_body("A")) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert stack.pd.token_counts == 0
    async with await slow as resp:
        assert resp.status == 200
    assert (await post(stack, stack.url, "messages/count_tokens", messages_body("A")))[0] == 200


@pytest.mark.parametrize("size, off_loop", [(4096, False), (5 * 1024 * 1024, True)])
async def test_large_count_tokens_bodies_are_read_off_the_loop(make_stack, monkeypatch, size, off_loop):
    on_main_thread = []
    real = agents_module.MESSAGES.parse

    def recording(*args, **kwargs):
        on_main_thread.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(agents_module, "MESSAGES", dataclasses.replace(agents_module.MESSAGES, parse=recording))
    stack = await make_stack(encoders=1)
    body = messages_body("A")
    body["messages"][0]["content"][1]["source"]["data"] = b64("A", pad="x" * size)
    status, _, raw = await post(stack, stack.url, "messages/count_tokens", body)
    assert status == 200 and orjson.loads(raw)["input_tokens"] > 0
    assert on_main_thread == [not off_loop] and stack.pd.token_counts == 1
