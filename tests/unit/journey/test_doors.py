"""Each door's error shape."""

from __future__ import annotations

import orjson

from epd_proxy.errors import ErrorAnswer, ProxyError
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.messages_api import (
    MESSAGES,
)
from epd_proxy.journey.responses_api import (
    RESPONSES,
)


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
