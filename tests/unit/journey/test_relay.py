"""Step 8 (relay.py): decode's answer to the client byte for byte, whole events only, and how it ended."""

from __future__ import annotations

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from epd_proxy.calls.sse import MAX_EVENT_BYTES
from epd_proxy.calls.upstream import BROKEN, IDLE_TIMEOUT, NoAnswer
from epd_proxy.journey.decode import DecodeAnswer, hold_head
from epd_proxy.journey.doors import CHAT, Door
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.relay import ABORTED, CLIENT_GONE, COMPLETE, relay
from epd_proxy.journey.responses_api import RESPONSES
from tests.unit.scripted_upstream import Reply, ScriptedAnswer, json_reply, stream_reply

PD = "http://pd"
EXTRA = {"x-request-id": "req-1"}
ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"Hi \xc3\xa9"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
VLLM_ERROR = b'data: {"error":{"message":"generation failed","code":500}}\n\n'


class Wire:
    """The writer aiohttp's response writes to: what the client would receive, in the pieces sent."""

    def __init__(self, reset_on_write: int | None = None) -> None:
        self.status_line = ""
        self.headers: dict[str, str] = {}
        self.writes: list[bytes] = []
        self.eof = False
        self.length: int | None = None
        self.output_size = 0
        self.buffer_size = 0
        self._reset_on_write = reset_on_write

    async def write_headers(self, status_line: str, headers) -> None:
        self.status_line = status_line
        self.headers = dict(headers)

    def send_headers(self) -> None:
        pass

    def enable_chunking(self) -> None:
        pass

    async def write(self, data) -> None:
        if self._reset_on_write is not None and len(self.writes) >= self._reset_on_write:
            raise ConnectionResetError("the client went away")
        self.writes.append(bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        self.eof = True

    async def drain(self) -> None:
        pass

    @property
    def sent(self) -> bytes:
        return b"".join(self.writes)


def decode_answer(reply: Reply, held: bytes = b"") -> DecodeAnswer:
    answer = ScriptedAnswer(reply, PD, "decode", "Decode request")
    return DecodeAnswer(answer, answer.chunks(), PD, held)


async def json_answer(reply: Reply) -> DecodeAnswer:
    """A JSON answer as the relay gets it: read whole by `hold_head` before it was committed."""
    answer = decode_answer(reply)
    await hold_head(answer, CHAT.judge)
    return answer


async def relayed(answer: DecodeAnswer, wire: Wire | None = None, door: Door = CHAT):
    wire = wire or Wire()
    request = make_mocked_request("POST", door.path, writer=wire)
    response, outcome = await relay(request, answer, EXTRA, door)
    return response, outcome, wire


def in_band_error(sent: bytes) -> dict:
    error, done, end = sent.split(b"\n\n")[-3:]
    assert (done, end) == (b"data: [DONE]", b"")
    return orjson.loads(error.removeprefix(b"data: "))["error"]


async def test_a_json_answer_goes_out_whole_with_decodes_status_and_content_type():
    answer = await json_answer(Reply(201, (b'{"choi', b'ces":[]}'), "application/json; charset=utf-8"))
    response, outcome, wire = await relayed(answer)
    assert outcome == COMPLETE
    assert response.status == 201 and response.body == b'{"choices":[]}'
    assert response.headers["Content-Type"] == "application/json; charset=utf-8"
    assert response.headers["x-request-id"] == "req-1"
    assert wire.writes == []  # the handler sends it, as any other response


async def test_a_stream_reaches_the_client_byte_for_byte_held_head_first():
    answer = decode_answer(stream_reply(TOKEN, DONE), held=ROLE)
    response, outcome, wire = await relayed(answer)
    assert outcome == COMPLETE and wire.eof
    assert wire.sent == ROLE + TOKEN + DONE
    assert wire.status_line == "HTTP/1.1 200 OK"
    assert wire.headers["Content-Type"] == "text/event-stream"
    assert wire.headers["Cache-Control"] == "no-cache" and wire.headers["x-request-id"] == "req-1"


async def test_only_whole_events_are_written_however_the_chunks_fall():
    stream = ROLE + TOKEN + DONE
    cuts = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    _, outcome, wire = await relayed(decode_answer(stream_reply(*cuts)))
    assert outcome == COMPLETE and wire.sent == stream
    assert all(piece.endswith(b"\n\n") for piece in wire.writes), wire.writes


async def test_a_last_event_without_its_empty_line_is_still_passed_on():
    _, outcome, wire = await relayed(decode_answer(stream_reply(TOKEN, b"data: [DONE]\n")))
    assert outcome == COMPLETE and wire.sent == TOKEN + b"data: [DONE]\n"


async def test_vllms_own_error_event_is_relayed_as_sent_and_counts_as_aborted():
    _, outcome, wire = await relayed(decode_answer(stream_reply(TOKEN, VLLM_ERROR, DONE), held=ROLE))
    assert outcome == ABORTED
    assert wire.sent == ROLE + TOKEN + VLLM_ERROR + DONE


async def test_vllms_error_event_in_the_held_head_counts_as_aborted():
    _, outcome, wire = await relayed(decode_answer(stream_reply(DONE), held=ROLE + VLLM_ERROR))
    assert outcome == ABORTED and wire.sent == ROLE + VLLM_ERROR + DONE


async def test_generated_text_that_quotes_an_error_is_not_an_abort():
    quoting = b'data: {"choices":[{"delta":{"content":"data: {\\"error\\""}}]}\n\n'
    _, outcome, _ = await relayed(decode_answer(stream_reply(quoting, DONE)))
    assert outcome == COMPLETE


@pytest.mark.parametrize("kind", [BROKEN, IDLE_TIMEOUT])
async def test_decode_breaking_off_ends_the_stream_with_an_in_band_error_after_the_whole_events(kind):
    half_event = TOKEN[:15]
    _, outcome, wire = await relayed(decode_answer(stream_reply(TOKEN, half_event, breaks=kind), held=ROLE))
    assert outcome == ABORTED and wire.eof
    assert wire.sent.startswith(ROLE + TOKEN + b"data: {")
    assert half_event not in wire.sent[len(ROLE + TOKEN) :]
    error = in_band_error(wire.sent)
    assert error["stage"] == "decode" and error["backend"] == PD
    assert error["code"] == (504 if kind == IDLE_TIMEOUT else 502)
    assert error["message"].startswith("Decode request")


async def test_an_event_over_the_cap_is_dropped_and_ends_the_stream_in_band():
    huge = b"data: " + b"x" * MAX_EVENT_BYTES
    _, outcome, wire = await relayed(decode_answer(stream_reply(TOKEN, huge[:1000], huge[1000:])))
    assert outcome == ABORTED
    assert wire.sent.startswith(TOKEN + b"data: {") and b"xxxx" not in wire.sent
    error = in_band_error(wire.sent)
    assert (error["code"], error["stage"], error["backend"]) == (502, "decode", PD)
    assert f"larger than {MAX_EVENT_BYTES} bytes" in error["message"]


def named(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


async def test_a_broken_messages_stream_ends_with_the_doors_own_error_event():
    delta = named("content_block_delta", {"type": "content_block_delta", "delta": {"text": "Hi"}})
    _, outcome, wire = await relayed(decode_answer(stream_reply(delta, breaks=BROKEN)), door=MESSAGES)
    assert outcome == ABORTED and wire.eof
    assert wire.sent.startswith(delta) and b"[DONE]" not in wire.sent
    name, data = wire.sent[len(delta) :].split(b"\n", 1)
    assert name == b"event: error" and orjson.loads(data.removeprefix(b"data: "))["error"]["type"] == "upstream_error"


async def test_a_responses_stream_over_the_event_cap_fails_after_the_last_event_it_sent():
    opened = {"id": "resp_9", "object": "response", "model": "m", "status": "in_progress", "output": []}
    head = named("response.created", {"type": "response.created", "sequence_number": 0, "response": opened})
    delta = named("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 5})
    huge = b"data: " + b"x" * MAX_EVENT_BYTES
    answer = decode_answer(stream_reply(delta + huge[:1000], huge[1000:]), held=head)
    _, outcome, wire = await relayed(answer, door=RESPONSES)
    assert outcome == ABORTED and wire.sent.startswith(head + delta) and b"xxxx" not in wire.sent
    failed = orjson.loads(wire.sent[len(head + delta) :].split(b"\n")[1].removeprefix(b"data: "))
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 6
    assert (
        failed["response"]["id"] == "resp_9"
        and f"larger than {MAX_EVENT_BYTES}" in failed["response"]["error"]["message"]
    )


async def test_a_client_that_goes_away_mid_stream_is_a_client_disconnect():
    answer = decode_answer(stream_reply(TOKEN, TOKEN, DONE))
    _, outcome, wire = await relayed(answer, Wire(reset_on_write=1))
    assert outcome == CLIENT_GONE and wire.writes == [TOKEN]


async def test_a_json_answer_that_breaks_off_is_raised_before_it_reaches_the_relay():
    with pytest.raises(NoAnswer) as err:
        await json_answer(Reply(200, (b'{"cho',), breaks=BROKEN))
    assert err.value.kind == BROKEN and err.value.status == 502


async def test_a_json_answer_read_whole_is_released_to_the_pool():
    answer = await json_answer(json_reply({"ok": True}))
    await relayed(answer)
    assert answer.answer.released


# -- the usage an answer reports (fair shares with --tenants, prompt sizes for placement) ------------

from epd_proxy.journey.relay import Listener, Usage, read_usage  # noqa: E402
from epd_proxy.journey.stream_usage import UnaskedUsage  # noqa: E402

CHAT_USAGE = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 100}}


@pytest.mark.parametrize(
    "data, expected",
    [
        (orjson.dumps({"choices": [], "usage": CHAT_USAGE}), Usage(20, 7, 100)),
        # Messages and Responses spell it as input and output tokens; Responses' stream nests it.
        (orjson.dumps({"type": "message", "usage": {"input_tokens": 9, "output_tokens": 4}}), Usage(9, 4)),
        (
            b'event: response.completed\ndata: {"response":{"usage":{"input_tokens":5,"output_tokens":2,'
            b'"input_tokens_details":{"cached_tokens":1}}}}\n\n',
            Usage(4, 2, 1),
        ),
        # A stream's usage event before [DONE].
        (TOKEN + b'data: {"choices":[],"usage":' + orjson.dumps(CHAT_USAGE) + b"}\n\n" + DONE, Usage(20, 7, 100)),
        # None reported, or nothing sane: nothing is charged.
        (TOKEN + DONE, None),
        (orjson.dumps({"usage": {"prompt_tokens": -5, "completion_tokens": 1}}), None),
        (orjson.dumps({"usage": {"prompt_tokens": "9", "completion_tokens": 1}}), None),
        (orjson.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": None}}), None),
        # No output count at all: none generated.
        (orjson.dumps({"usage": {"prompt_tokens": 9}}), Usage(9, 0)),
        (b'{"usage": broken', None),
        # More cached than computed is not believed: the whole prompt counts.
        (
            orjson.dumps(
                {"usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 9}}}
            ),
            Usage(3, 1),
        ),
    ],
)
def test_the_tokens_an_answer_reports_in_each_doors_spelling(data, expected):
    assert read_usage(data) == expected


async def test_relay_reports_the_usage_of_a_complete_answer_only():
    heard: list[Usage] = []
    for answer in (
        await json_answer(json_reply({"choices": [], "usage": CHAT_USAGE})),
        decode_answer(
            stream_reply(ROLE, TOKEN, b'data: {"choices":[],"usage":' + orjson.dumps(CHAT_USAGE) + b"}\n\n", DONE)
        ),
        decode_answer(
            stream_reply(ROLE, b'data: {"choices":[],"usage":' + orjson.dumps(CHAT_USAGE) + b"}\n\n", VLLM_ERROR, DONE)
        ),
        await json_answer(json_reply({"error": {"message": "no"}, "usage": CHAT_USAGE}, status=400)),
    ):
        request = make_mocked_request("POST", CHAT.path, writer=Wire())
        await relay(request, answer, EXTRA, CHAT, Listener(heard.append))
    assert heard == [Usage(20, 7, 100), Usage(20, 7, 100)]


# vLLM's chat stream asked for usage: the chunk ending the choice without the fingerprint, which
# moved to the usage chunk after it.
FINISHED = b'data: {"id":"c","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\n'
FINGERPRINTED = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],'
    b'"system_fingerprint":"vllm-0.32-abc"}\n\n'
)
USAGE_CHUNK = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":20,"total_tokens":27,"completion_tokens":7},'
    b'"system_fingerprint":"vllm-0.32-abc"}\n\n'
)


async def test_usage_only_the_proxy_asked_for_is_heard_and_the_client_gets_the_stream_it_asked_for():
    heard: list[Usage] = []
    wire = Wire()
    request = make_mocked_request("POST", CHAT.path, writer=wire)
    # Cut at odd places, so the finished chunk and the usage chunk arrive apart and in pieces.
    whole = ROLE + TOKEN + FINISHED + USAGE_CHUNK + DONE
    pieces = [whole[i : i + 37] for i in range(0, len(whole), 37)]
    _, outcome = await relay(
        request, decode_answer(stream_reply(*pieces)), EXTRA, CHAT, Listener(heard.append, UnaskedUsage())
    )
    assert outcome == COMPLETE
    assert wire.sent == ROLE + TOKEN + FINGERPRINTED + DONE
    assert heard == [Usage(20, 7)]


async def test_a_stream_broken_after_its_finished_chunk_still_passes_that_chunk_on():
    wire = Wire()
    request = make_mocked_request("POST", CHAT.path, writer=wire)
    broken = stream_reply(ROLE, TOKEN, FINISHED, breaks=BROKEN)
    _, outcome = await relay(request, decode_answer(broken), EXTRA, CHAT, Listener(lambda used: None, UnaskedUsage()))
    assert outcome == ABORTED
    assert wire.sent.startswith(ROLE + TOKEN + FINISHED + b'data: {"error"')
