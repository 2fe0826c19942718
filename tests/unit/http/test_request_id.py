"""The request id rule (http/request_id.py): a client's `x-request-id` is taken only as a short
plain token; anything else is replaced by the proxy's own id, and the refused value is kept for
the log only, cut short and escaped so it cannot forge or break a log line."""

from __future__ import annotations

import re

import pytest
from multidict import CIMultiDict

from epd_proxy.http.request_id import LOGGED_CHARS, MAX_LENGTH, request_id

PROXY_ID = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize(
    "sent",
    ["client-7", "a", "0af7651916cd43dd8448eb211c80319c", "req_01HV:attempt.2", "x" * MAX_LENGTH],
)
def test_a_plain_token_is_the_request_id(sent):
    rid = request_id(CIMultiDict({"X-Request-Id": sent}))
    assert (rid.value, rid.refused) == (sent, None)


def test_without_one_the_proxy_makes_one_and_there_is_nothing_to_log():
    for headers in ({}, {"x-request-id": ""}):
        rid = request_id(headers)
        assert PROXY_ID.fullmatch(rid.value) and rid.refused is None
    assert request_id({}).value != request_id({}).value


@pytest.mark.parametrize(
    "sent",
    [
        "x" * (MAX_LENGTH + 1),
        "r" * 8000,
        "abc\udcff",  # an obs-text byte, as aiohttp hands it on (surrogate escape)
        "café",
        "two words",
        'a"b',
        "a=b",
        "line\r\nforged=1",
        "tab\there",
        "a/b",
    ],
)
def test_anything_else_is_replaced_and_kept_escaped_for_the_log(sent):
    rid = request_id({"x-request-id": sent})
    assert PROXY_ID.fullmatch(rid.value)
    logged = rid.refused
    assert logged is not None and logged.isascii() and logged.isprintable()
    # Nothing a key=value log line or a JSON log reader could take for a separator or a new field.
    assert not set(logged) & set(' "=\r\n\t')
    assert len(logged) <= LOGGED_CHARS * 10 + 3


def test_the_logged_value_starts_as_the_client_sent_it_and_says_it_was_cut():
    assert request_id({"x-request-id": "r" * 8000}).refused == "r" * LOGGED_CHARS + "..."
    assert request_id({"x-request-id": "ab c\udcff"}).refused == "ab\\x20c\\udcff"
