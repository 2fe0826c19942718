"""The request id: the client's `x-request-id` when it is a short plain token, else the proxy's own.

The id reaches every backend (vLLM takes it for its own request id), every log line, span and
`/status.json`, so a client's value is taken only as 1 to 128 characters of `[A-Za-z0-9._:-]`,
which covers UUIDs, ULIDs and the usual `req_...` ids. Any other value (too long, a space, a
quote, a control or non-ASCII byte) is replaced by a random id the proxy makes; the refused value
goes to the request's log line only, cut short and escaped, so operators can still correlate.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

HEADER = "x-request-id"
MAX_LENGTH = 128
_TOKEN_CHARS = "A-Za-z0-9._:-"
_ACCEPTED = re.compile(f"[{_TOKEN_CHARS}]{{1,{MAX_LENGTH}}}")
_SHOWN = re.compile(f"[{_TOKEN_CHARS}]")
# The part of a refused value the log keeps: enough to find the client's own record of it.
LOGGED_CHARS = 64


@dataclass(frozen=True, slots=True)
class RequestId:
    value: str
    # The client's value when it was refused, escaped for a log line; None when taken or absent.
    refused: str | None = None

    def __str__(self) -> str:
        """The id as an error log names it, with what the client sent in its place."""
        return self.value if self.refused is None else f"{self.value} (client x-request-id {self.refused})"


def request_id(headers: Mapping[str, str]) -> RequestId:
    """The one rule for every place that reads a client's `x-request-id`."""
    sent = headers.get(HEADER)
    if sent is not None and _ACCEPTED.fullmatch(sent):
        return RequestId(sent)
    return RequestId(uuid.uuid4().hex, _loggable(sent) if sent else None)


def _loggable(value: str) -> str:
    """Only token characters as they are; every other one as a backslash escape of its code, so
    the result is printable ASCII with no space, quote or `=` and reads back unambiguously."""
    shown = "".join(ch if _SHOWN.fullmatch(ch) else _escape(ord(ch)) for ch in value[:LOGGED_CHARS])
    return shown + ("..." if len(value) > LOGGED_CHARS else "")


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
