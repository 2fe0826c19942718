"""Step 7 (decode.py): what decode's answer becomes before anything reaches the client."""

from __future__ import annotations

import orjson
import pytest

from epd_proxy.calls.sse import Verdict
from epd_proxy.calls.upstream import BROKEN, IDLE_TIMEOUT, Limits, NoAnswer, Timeouts
from epd_proxy.errors import ErrorAnswer
from epd_proxy.fleet.backends import CHAT_PATH, PREFILL_DECODE, Instance
from epd_proxy.journey.decode import MAX_JSON_ANSWER_BYTES, EngineCall, hold_head, open_decode
from epd_proxy.journey.doors import CHAT, Door
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.responses_api import RESPONSES
from tests.unit.scripted_upstream import Reply, ScriptedUpstream, json_reply, stream_reply

PD = "http://pd"
TIMEOUTS = Timeouts(connect=1, headers=2, idle=3)
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
VLLM_ERROR = b'data: {"error":{"message":"EC load failed","type":"InternalServerError","code":500}}\n\n'
DONE = b"data: [DONE]\n\n"


def decoder() -> Instance:
    return Instance(PD, PREFILL_DECODE)


async def opened(*replies: Reply, limits: Limits = Limits()):
    upstream = ScriptedUpstream(limits)
    upstream.script(PD, *replies)
    answer = await open_decode(
        upstream, EngineCall(decoder(), {"model": "m", "stream": True}, {"x-request-id": "r"}, TIMEOUTS)
    )
    return answer, upstream


async def test_the_body_goes_to_chat_completions_without_counting_the_decoder_twice():
    answer, upstream = await opened(stream_reply(ROLE, TOKEN, DONE))
    (sent,) = upstream.sent
    assert (sent.method, sent.path, sent.stage) == ("POST", CHAT_PATH, "decode")
    assert sent.body == {"model": "m", "stream": True} and sent.headers == {"x-request-id": "r"}
    assert sent.timeouts is TIMEOUTS
    # Routing already counted the request against this decoder.
    assert sent.options["count_inflight"] is False
    assert answer.backend == PD and answer.status == 200 and answer.streaming


@pytest.mark.parametrize("status", [400, 404, 422, 500, 503])
async def test_an_error_answer_raises_the_backends_own_status_and_body(status):
    body = b'{"error":{"message":"bad things","code":%d}}' % status
    upstream = ScriptedUpstream()
    upstream.script(PD, Reply(status, (body,)))
    with pytest.raises(ErrorAnswer) as err:
        await open_decode(upstream, EngineCall(decoder(), {}, {}, TIMEOUTS))
    exc = err.value
    assert (exc.status, exc.answered, exc.raw_body, exc.message) == (status, status, body, "bad things")
    assert (exc.stage, exc.backend) == ("decode", PD)
    (answer,) = upstream.answers
    # An error body is read whole to be passed on, so it is held to the pool's buffered limit.
    assert answer.capped_at == Limits().buffered_body_bytes
    assert answer.released


async def test_an_error_answer_cut_short_is_still_the_backends_status():
    upstream = ScriptedUpstream()
    upstream.script(PD, Reply(500, (b'{"error":{"mess',), breaks=BROKEN))
    with pytest.raises(ErrorAnswer) as err:
        await open_decode(upstream, EngineCall(decoder(), {}, {}, TIMEOUTS))
    assert err.value.status == 500 and err.value.raw_body == b""
    assert upstream.answers[0].released


async def test_the_error_body_cap_is_the_pools():
    upstream = ScriptedUpstream(Limits(buffered_body_bytes=1234))
    upstream.script(PD, Reply(400, (b"no",)))
    with pytest.raises(ErrorAnswer):
        await open_decode(upstream, EngineCall(decoder(), {}, {}, TIMEOUTS))
    assert upstream.answers[0].capped_at == 1234


async def test_a_json_answer_is_capped_since_it_is_relayed_whole():
    answer, upstream = await opened(json_reply({"choices": []}))
    assert not answer.streaming and answer.content_type == "application/json"
    assert upstream.answers[0].capped_at == MAX_JSON_ANSWER_BYTES
    assert [chunk async for chunk in answer.chunks] == [b'{"choices":[]}']


async def test_a_stream_is_not_capped_as_a_whole():
    _, upstream = await opened(stream_reply(ROLE, TOKEN, DONE))
    assert upstream.answers[0].capped_at is None


async def test_no_answer_at_all_is_the_layers_failure_unchanged():
    upstream = ScriptedUpstream()
    upstream.script(PD, Reply(fails="refused"))
    with pytest.raises(NoAnswer) as err:
        await open_decode(upstream, EngineCall(decoder(), {}, {}, TIMEOUTS))
    assert err.value.kind == "refused" and err.value.status == 502


async def test_the_head_is_held_until_the_first_generated_event_and_the_rest_stays_unread():
    answer, _ = await opened(stream_reply(ROLE, TOKEN, b'data: {"choices":[{"delta":{"content":"!"}}]}\n\n', DONE))
    assert await hold_head(answer, CHAT.judge) == (Verdict.COMMIT, None)
    assert answer.held == ROLE + TOKEN
    assert [chunk async for chunk in answer.chunks] == [b'data: {"choices":[{"delta":{"content":"!"}}]}\n\n', DONE]


async def test_an_event_split_over_chunks_is_judged_once_it_ends():
    answer, _ = await opened(stream_reply(ROLE + TOKEN[:20], TOKEN[20:], DONE))
    assert await hold_head(answer, CHAT.judge) == (Verdict.COMMIT, None)
    assert answer.held == ROLE + TOKEN


async def test_vllms_error_before_anything_generated_is_handed_back():
    answer, _ = await opened(stream_reply(ROLE, VLLM_ERROR, DONE))
    verdict, error = await hold_head(answer, CHAT.judge)
    assert verdict is Verdict.ERROR
    assert error == {"message": "EC load failed", "type": "InternalServerError", "code": 500}
    assert answer.held == ROLE + VLLM_ERROR


async def test_an_error_after_generated_text_is_not_judged():
    answer, _ = await opened(stream_reply(ROLE, TOKEN, VLLM_ERROR, DONE))
    assert await hold_head(answer, CHAT.judge) == (Verdict.COMMIT, None)
    assert answer.held == ROLE + TOKEN


async def test_a_stream_that_breaks_off_before_generating_commits_with_all_it_sent():
    answer, _ = await opened(stream_reply(ROLE, b": keep-alive\n\n"))
    assert await hold_head(answer, CHAT.judge) == (Verdict.COMMIT, None)
    assert answer.held == ROLE + b": keep-alive\n\n"


async def test_a_stream_that_ends_having_generated_nothing_is_told_apart():
    answer, _ = await opened(stream_reply(ROLE, DONE))
    assert await hold_head(answer, CHAT.judge) == (Verdict.NOTHING, None)
    assert answer.held == ROLE + DONE


CHAT_USED = {"prompt_tokens": 59, "total_tokens": 64, "completion_tokens": 5}
NONE_USED = {"prompt_tokens": 76, "total_tokens": 76, "completion_tokens": 0}
ONE_USED = {"prompt_tokens": 59, "total_tokens": 60, "completion_tokens": 1}


def chat_answer(finish: str | None, usage: dict | None, text: str = "hello") -> dict:
    return {"choices": [{"message": {"content": text}, "finish_reason": finish}], "usage": usage}


def message(usage: dict, stop: str | None = "end_turn", text: str = "hello") -> dict:
    out = {"type": "message", "content": [{"type": "text", "text": text}], "usage": usage}
    return out if stop is None else {**out, "stop_reason": stop}  # vLLM leaves a null out


def response(status: str, output: int) -> dict:
    return {"object": "response", "status": status, "usage": {"input_tokens": 59, "output_tokens": output}}


def tool_use(stop: str | None) -> dict:
    """A Messages answer that called a tool whose input the model wrote: JSON of its own."""
    call = {"type": "tool_use", "id": "t1", "name": "report", "input": {"stop_reason": "end_turn"}}
    return {**message({"input_tokens": 59, "output_tokens": 9}, stop), "content": [call]}


# vLLM 0.32's JSON answers to a request it aborted (a pause, a shutdown) before its engine ran it or
# partway, and to ones it finished (a first token that was end-of-sequence is one token), in each
# door's shape: an aborted one goes elsewhere, as the client has none of it.
@pytest.mark.parametrize(
    ("door", "body", "verdict"),
    [
        (CHAT, chat_answer("abort", NONE_USED, ""), Verdict.NOTHING),
        (CHAT, chat_answer("abort", CHAT_USED), Verdict.CUT),
        (CHAT, chat_answer("stop", ONE_USED, ""), Verdict.COMMIT),
        (CHAT, chat_answer("length", CHAT_USED), Verdict.COMMIT),
        (CHAT, chat_answer("stop", None), Verdict.COMMIT),
        # Text that spells the abort is escaped inside its string: not the answer's finish reason.
        (CHAT, chat_answer("stop", CHAT_USED, '"finish_reason":"abort"'), Verdict.COMMIT),
        (MESSAGES, message({"input_tokens": 76, "output_tokens": 0}, None, ""), Verdict.NOTHING),
        (MESSAGES, message({"input_tokens": 59, "output_tokens": 5}, None), Verdict.CUT),
        (MESSAGES, message({"input_tokens": 59, "output_tokens": 5}), Verdict.COMMIT),
        (MESSAGES, message({"input_tokens": 59, "output_tokens": 5}, "max_tokens"), Verdict.COMMIT),
        (MESSAGES, message({"input_tokens": 59, "output_tokens": 1}, "end_turn", '"stop_reason"'), Verdict.COMMIT),
        # A tool's input spells a stop reason unescaped: the answer's own is what counts.
        (MESSAGES, tool_use(None), Verdict.CUT),
        (MESSAGES, tool_use("tool_use"), Verdict.COMMIT),
        (RESPONSES, response("completed", 0), Verdict.NOTHING),
        (RESPONSES, response("cancelled", 5), Verdict.CUT),
        # What vLLM answers for a request aborted partway on a model without harmony: no sign of it.
        (RESPONSES, response("completed", 5), Verdict.COMMIT),
        (RESPONSES, response("incomplete", 5), Verdict.COMMIT),
    ],
)
async def test_a_json_answer_is_read_whole_and_one_vllm_aborted_is_told_apart(door: Door, body: dict, verdict):
    answer, _ = await opened(json_reply(body))
    assert await hold_head(answer, door.judge) == (verdict, None)
    assert answer.held == orjson.dumps(body)
    assert [chunk async for chunk in answer.chunks] == []


@pytest.mark.parametrize("door", [CHAT, MESSAGES, RESPONSES])
@pytest.mark.parametrize(
    "body", [b"[]", b'{"usage":{"completion_tokens":0', b'{"usage":{"output_tokens":0', b'[{"finish_reason":"abort"}]']
)
def test_an_answer_that_is_no_json_object_is_not_judged_aborted(door: Door, body: bytes):
    assert door.judge(body) is Verdict.COMMIT


@pytest.mark.parametrize("kind", [BROKEN, IDLE_TIMEOUT])
async def test_a_stream_that_fails_while_its_head_is_held_raises(kind):
    answer, _ = await opened(stream_reply(ROLE, breaks=kind))
    with pytest.raises(NoAnswer) as err:
        await hold_head(answer, CHAT.judge)
    assert err.value.kind == kind and err.value.stage == "decode"
