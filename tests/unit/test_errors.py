"""One error shape for every failure (errors.py)."""

from __future__ import annotations

import orjson
import pytest

from epd_proxy.errors import BackendUnreachable, BadRequest, ErrorAnswer, InternalError, ProxyError


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "request_error"),
        (500, "proxy_error"),
        (502, "upstream_error"),
        (503, "service_unavailable"),
        (504, "upstream_error"),
    ],
)
def test_the_error_type_follows_the_status(status, kind):
    assert ProxyError(status, "m").error_type == kind


def test_the_body_is_openai_shaped_and_names_the_stage_and_backend():
    body = orjson.loads(ProxyError(502, "gone", stage="encode", backend="http://e0").body())
    assert body == {
        "error": {"message": "gone", "type": "upstream_error", "code": 502, "stage": "encode", "backend": "http://e0"}
    }
    assert "backend" not in orjson.loads(BadRequest("no").body())["error"]


def test_an_internal_error_gives_the_request_id_and_nothing_else():
    error = InternalError("rid-9")
    assert error.status == 500 and "rid-9" in error.message and error.answered is None


def test_unreachable_is_502_or_504_when_timed_out_and_never_an_answer():
    assert BackendUnreachable("x", stage="decode", backend="b").status == 502
    timed_out = BackendUnreachable("x", stage="decode", backend="b", timed_out=True)
    assert timed_out.status == 504 and timed_out.answered is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"error": {"message": "bad image", "type": "BadRequestError"}}', "bad image"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b'{"error": "plain"}', "plain"),
        (b"Internal Server Error", "Internal Server Error"),
        (b"[1, 2]", "[1, 2]"),
        (b"\xff\xfe", "\ufffd\ufffd"),
    ],
)
def test_a_backend_answer_keeps_its_status_and_body_and_says_its_message(raw, message):
    error = ErrorAnswer(422, raw, "application/json", stage="decode", backend="http://d")
    assert (error.status, error.answered, error.raw_body, error.message) == (422, 422, raw, message)


def test_a_long_text_answer_is_cut_in_the_message_only():
    raw = b"x" * 5000
    error = ErrorAnswer(500, raw, "text/plain", stage="encode", backend="e")
    assert len(error.message) == 2000 and error.raw_body == raw


BUSY = "The engine is currently busy and cannot accept new requests."


@pytest.mark.parametrize(
    ("status", "raw", "busy"),
    [
        # vLLM's admission refusals, chat / Responses shape and Messages shape.
        (503, orjson.dumps({"error": {"message": BUSY, "type": "Service Unavailable", "code": 503}}), True),
        (503, orjson.dumps({"type": "error", "error": {"type": "Service Unavailable", "message": BUSY}}), True),
        # Any other 503 (an engine error, a gateway in front) or another status is the backend's answer.
        (503, orjson.dumps({"error": {"message": BUSY, "type": "InternalServerError", "code": 503}}), False),
        (503, b"upstream connect error or disconnect/reset before headers", False),
        (500, orjson.dumps({"error": {"message": BUSY, "type": "Service Unavailable", "code": 500}}), False),
        (503, orjson.dumps({"error": "Service Unavailable"}), False),
    ],
)
def test_only_vllms_admission_refusal_is_busy(status, raw, busy):
    assert ErrorAnswer(status, raw, "application/json", stage="decode", backend="http://d").busy is busy
