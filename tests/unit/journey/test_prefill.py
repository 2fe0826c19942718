"""Step 6 (prefill.py): one token of prefill, and the KV handles it hands to decode."""

from __future__ import annotations

import pytest

from epd_proxy.calls.upstream import RESET, NoAnswer, Timeouts
from epd_proxy.errors import ErrorAnswer, ProxyError
from epd_proxy.fleet.backends import CHAT_PATH, PREFILL, Instance
from epd_proxy.journey.decode import EngineCall
from epd_proxy.journey.prefill import run_prefill
from tests.unit.scripted_upstream import Reply, ScriptedUpstream, json_reply

P = "http://prefill"
TIMEOUTS = Timeouts(total=5)
KV = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "h"}


async def prefilled(*replies: Reply, prepared=None):
    upstream = ScriptedUpstream()
    upstream.script(P, *replies)
    body = prepared or {"model": "m", "messages": [], "stream": True, "max_tokens": 50}
    result = await run_prefill(upstream, EngineCall(Instance(P, PREFILL), body, {"x-request-id": "r"}, TIMEOUTS))
    return result, upstream


async def test_prefill_is_asked_for_one_token_in_one_piece_and_returns_its_kv_handles():
    kv, upstream = await prefilled(json_reply({"choices": [], "kv_transfer_params": KV}))
    assert kv == KV
    (sent,) = upstream.sent
    assert (sent.method, sent.path, sent.stage, sent.timeouts) == ("POST", CHAT_PATH, "prefill", TIMEOUTS)
    assert sent.headers == {"x-request-id": "r"}
    assert sent.body["max_tokens"] == 1 and sent.body["stream"] is False
    assert sent.body["kv_transfer_params"]["do_remote_decode"] is True


@pytest.mark.parametrize(
    "answer", [{"choices": []}, {"kv_transfer_params": None}, {"kv_transfer_params": {}}, {"kv_transfer_params": []}]
)
async def test_an_answer_without_usable_kv_handles_gives_none(answer):
    kv, _ = await prefilled(json_reply(answer))
    assert kv is None


async def test_a_json_answer_that_is_not_an_object_gives_none():
    kv, _ = await prefilled(json_reply([1, 2]))
    assert kv is None


@pytest.mark.parametrize("status", [400, 500, 503])
async def test_an_error_answer_keeps_prefills_own_status_and_body(status):
    with pytest.raises(ErrorAnswer) as err:
        await prefilled(Reply(status, (b'{"error":{"message":"no"}}',)))
    exc = err.value
    assert (exc.status, exc.answered, exc.stage, exc.backend, exc.message) == (status, status, "prefill", P, "no")


async def test_a_2xx_that_is_not_json_is_a_502_that_prefill_answered():
    with pytest.raises(ProxyError) as err:
        await prefilled(Reply(200, (b"<html>",)))
    exc = err.value
    assert not isinstance(exc, ErrorAnswer)
    assert (exc.status, exc.answered, exc.stage, exc.backend) == (502, 200, "prefill", P)
    assert "not JSON" in exc.message


async def test_no_answer_is_the_layers_failure_unchanged():
    with pytest.raises(NoAnswer) as err:
        await prefilled(Reply(fails=RESET))
    assert err.value.kind == RESET and err.value.stage == "prefill"
