"""Each door's error shape, and where its conversation lies."""

from __future__ import annotations

import orjson
from openai.types.responses import ResponseFailedEvent

from epd_proxy.errors import BackendUnreachable, ErrorAnswer, ProxyError
from epd_proxy.journey.doors import CHAT, Conversation, Relayed, chat_conversation
from epd_proxy.journey.messages_api import (
    MESSAGES,
)
from epd_proxy.journey.responses_api import (
    RESPONSES,
)
from tests.media import chat, conversation, image


def test_errors_take_each_doors_shape():
    own = ProxyError(503, "no live decode instance", stage="route", error_type="service_unavailable")
    assert orjson.loads(MESSAGES.error(own)) == {
        "type": "error",
        "error": {"type": "service_unavailable", "message": "no live decode instance"},
    }
    assert RESPONSES.error(own) is None and CHAT.error(own) is None
    consumer = ErrorAnswer(
        400, b'{"type":"error","error":{"type":"x","message":"y"}}', "application/json", stage="decode", backend="b"
    )
    assert MESSAGES.error(consumer) == consumer.raw_body
    encoder = ErrorAnswer(
        400,
        b'{"error":{"message":"bad image","type":"BadRequestError"}}',
        "application/json",
        stage="encode",
        backend="e",
    )
    assert orjson.loads(MESSAGES.error(encoder)) == {
        "type": "error",
        "error": {"type": "BadRequestError", "message": "bad image"},
    }


# -- in-band errors of a stream broken after its 200 ---------------------------------------------

BROKEN = BackendUnreachable("Decode request failed: the backend closed the connection", stage="decode", backend="b")
# A Responses stream's head as vLLM opens it (`ResponsesResponse.from_request`, abridged), and an
# event generated after it.
OPENED = {
    "id": "resp_1",
    "created_at": 1700000000,
    "model": "tiny-vlm",
    "object": "response",
    "output": [],
    "parallel_tool_calls": True,
    "status": "in_progress",
    "tool_choice": "auto",
    "tools": [{"type": "function", "name": "look", "parameters": {"type": "object"}, "strict": None}],
    "usage": None,
}


def sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


HEAD = sse("response.created", {"type": "response.created", "sequence_number": 0, "response": OPENED}) + sse(
    "response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": OPENED}
)
DELTA = sse("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 7, "delta": "x"})


def only_event(raw: bytes) -> tuple[str, dict]:
    name, data, end = raw.split(b"\n")[0], raw.split(b"\n")[1], raw[-2:]
    assert raw.count(b"\n\n") == 1 and end == b"\n\n"
    return name.removeprefix(b"event: ").decode(), orjson.loads(data.removeprefix(b"data: "))


def test_a_broken_chat_stream_ends_in_vllms_error_event_and_done():
    raw = CHAT.stream_error(BROKEN, Relayed(b"", b""))
    error, done, end = raw.split(b"\n\n")
    assert (done, end) == (b"data: [DONE]", b"")
    assert orjson.loads(error.removeprefix(b"data: "))["error"] == {
        "message": BROKEN.message,
        "type": "upstream_error",
        "param": None,
        "code": 502,
        "stage": "decode",
        "backend": "b",
    }


def test_a_broken_messages_stream_ends_in_anthropics_error_event():
    name, data = only_event(MESSAGES.stream_error(BROKEN, Relayed(b"", b"")))
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "upstream_error", "message": BROKEN.message}}


def test_a_broken_responses_stream_fails_the_opened_response_in_sequence():
    name, data = only_event(RESPONSES.stream_error(BROKEN, Relayed(HEAD, DELTA + b": keep-alive\n\n")))
    assert name == "response.failed"
    failed = ResponseFailedEvent.model_validate(data, strict=True)
    assert failed.sequence_number == 8
    response = failed.response
    assert (response.id, response.model, response.tools[0].name) == ("resp_1", "tiny-vlm", "look")
    assert response.status == "failed" and response.output == [] and response.usage is None
    assert (response.error.code, response.error.message) == ("server_error", BROKEN.message)


def test_a_responses_stream_broken_right_after_its_head_continues_the_heads_numbering():
    _, data = only_event(RESPONSES.stream_error(BROKEN, Relayed(HEAD, HEAD)))
    assert data["sequence_number"] == 2


def test_a_responses_stream_that_did_not_open_as_vllm_does_still_fails_a_response():
    _, data = only_event(RESPONSES.stream_error(BROKEN, Relayed(b'data: {"choices": []}\n\n', b"")))
    # Without an opened response the model is not known; the SDK builds stream events unvalidated.
    response = data["response"]
    assert data["sequence_number"] == 0 and response["id"].startswith("resp_") and "model" not in response
    assert response["status"] == "failed" and response["error"]["message"] == BROKEN.message
    assert {"created_at", "object", "output", "parallel_tool_calls", "tool_choice", "tools"} <= response.keys()


# -- where each door's conversation lies -------------------------------------------------------------


def test_a_chat_opens_through_its_first_user_message():
    body = conversation([image("a")], [image("b")], [image("c")])
    seen = chat_conversation(body)
    assert seen.entries is body["messages"] and seen.preamble is None
    assert seen.opening == 2  # system, user
    assert chat_conversation(chat(image("a"))).opening == 1


def test_a_chat_without_a_user_message_has_no_opening():
    assert chat_conversation({"messages": [{"role": "system", "content": "x"}]}).opening == 0
    assert chat_conversation({"messages": "not a list"}) == Conversation()
    assert chat_conversation({}) == Conversation()
