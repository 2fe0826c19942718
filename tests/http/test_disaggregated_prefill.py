"""E+P+D: prefill runs one token and its KV handles reach decode."""

from __future__ import annotations

from tests.media import chat, image


async def test_prefill_gets_one_token_copy_and_decode_gets_its_kv_params(make_stack):
    stack = await make_stack(encoders=2, prefills=1)
    body = chat(image("A"), image("B"), stream=False, max_completion_tokens=20, stream_options={"include_usage": True})
    async with await stack.chat(body) as resp:
        assert resp.status == 200, await resp.text()
    prefill = stack.prefills[0].requests[0].body
    assert prefill["max_tokens"] == 1 and prefill["max_completion_tokens"] == 1
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert [p["type"] for p in prefill["messages"][0]["content"][1:]] == ["image_embeds", "image_embeds"]
    decode = stack.pd.requests[0].body
    assert decode["kv_transfer_params"]["remote_block_ids"] == [1, 2, 3]
    assert decode["max_completion_tokens"] == 20 and decode["stream_options"] == {"include_usage": True}
    assert stack.prefills[0].requests[0].headers["x-request-id"] == stack.pd.requests[0].headers["x-request-id"]


async def test_prefill_error_keeps_its_status_and_message(make_stack):
    stack = await make_stack(encoders=1, prefills=1)
    stack.prefills[0].faults.fail_next(1, 400, "prompt too long for prefill")
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 400
        assert resp.headers["x-epd-stage"] == "prefill"
        assert (await resp.json())["error"]["message"] == "prompt too long for prefill"
    assert stack.pd.requests == []


async def test_prefill_500_re_encodes_and_retries(make_stack):
    stack = await make_stack(encoders=1, prefills=1, decode_retries=1)
    stack.prefills[0].faults.fail_next()
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
    assert len(stack.encoder_requests()) == 2 and len(stack.prefills[0].requests) == 2


async def test_a_retry_never_inherits_the_previous_attempts_kv_or_transfer_ids(make_stack):
    stack = await make_stack(encoders=1, prefills=1, decode_retries=1)
    stack.pd.faults.fail_next()
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
    first, second = (seen.body for seen in stack.pd.requests)
    ids = [b["ec_transfer_params"]["ec_items"][0]["transfer_id"] for b in (first, second)]
    assert ids[0] != ids[1]
    assert len(stack.prefills[0].requests) == 2


async def test_prefill_drops_sampling_constraints_that_contradict_one_token(make_stack):
    stack = await make_stack(encoders=1, prefills=1)
    async with await stack.chat(chat(image("A"), min_tokens=4, n=1)) as resp:
        assert resp.status == 200, await resp.text()
    sent = stack.prefills[0].requests[0].body
    assert "min_tokens" not in sent and sent["max_tokens"] == 1
    assert stack.pd.requests[0].body["min_tokens"] == 4


async def test_backends_answering_another_2xx_are_successes(make_stack):
    stack = await make_stack(encoders=1, prefills=1, encoder_options={"success_status": 201})
    stack.prefills[0].success_status = 202
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200, await resp.text()
    assert stack.pd.requests[0].body["messages"][0]["content"][1]["type"] == "image_embeds"
