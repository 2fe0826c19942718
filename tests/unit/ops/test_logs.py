"""Log setup (logs.py): text or one JSON object per line."""

from __future__ import annotations

import logging
import sys

import orjson
import pytest

from epd_proxy.ops.logs import JsonFormatter, configure_logging


def record(msg: str = "hello %s", args: tuple = ("world",), **extra) -> logging.LogRecord:
    rec = logging.LogRecord("epd_proxy.request", logging.INFO, __file__, 1, msg, args, None)
    rec.created, rec.msecs = 0.0, 7
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_a_plain_record_is_one_json_object_with_its_message():
    entry = orjson.loads(JsonFormatter().format(record()))
    assert entry == {
        "ts": "1970-01-01T00:00:00.007Z",
        "level": "INFO",
        "logger": "epd_proxy.request",
        "message": "hello world",
    }


def test_a_request_line_carries_its_fields_instead_of_the_message():
    fields = {"request_id": "r-1", "status": 200, "decode": None, "odd": object()}
    entry = orjson.loads(JsonFormatter().format(record(fields=fields)))
    assert entry["request_id"] == "r-1" and entry["status"] == 200 and entry["decode"] is None
    assert "message" not in entry and entry["odd"].startswith("<object")


def test_an_exception_is_in_the_object():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record(exc_info=sys.exc_info())
    entry = orjson.loads(JsonFormatter().format(rec))
    assert "ValueError: boom" in entry["exception"]


@pytest.fixture
def restored_logging():
    root, app = logging.getLogger(), logging.getLogger("epd_proxy.app")
    saved = root.handlers[:], root.level, app.level
    yield
    root.handlers[:], _, _ = saved
    root.setLevel(saved[1])
    app.setLevel(saved[2])


def test_configure_sets_one_handler_the_level_and_the_request_log(restored_logging):
    configure_logging("warning", "json", log_requests=True)
    root = logging.getLogger()
    assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.WARNING
    assert logging.getLogger("epd_proxy.app").level == logging.DEBUG
    configure_logging("INFO", "text", log_requests=False)
    assert len(root.handlers) == 1 and not isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.INFO
