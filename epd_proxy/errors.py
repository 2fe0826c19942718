"""Every failure becomes one ProxyError here, so every path answers with the same JSON shape."""

from __future__ import annotations

import orjson


class ProxyError(Exception):
    """A failure with the HTTP status the client should see.

    `stage` names the step that failed (request, encode, match, prefill, decode, proxy) so an
    operator can tell a bad image from a dead encoder from the error body alone. `answered` is
    the HTTP status the backend itself answered when this error stands for its answer (health
    counts it), None when the proxy found the failure on its own.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        stage: str = "proxy",
        error_type: str | None = None,
        backend: str | None = None,
        answered: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.answered = answered
        self.message = message
        self.stage = stage
        self.error_type = error_type or _default_type(status)
        self.backend = backend
        # Seconds a client should wait before trying again (the Retry-After header); None: not said.
        self.retry_after_s: int | None = None

    def body(self) -> bytes:
        error: dict[str, object] = {
            "message": self.message,
            "type": self.error_type,
            "code": self.status,
            "stage": self.stage,
        }
        if self.backend:
            error["backend"] = self.backend
        return orjson.dumps({"error": error})


class BadRequest(ProxyError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message, stage="request", error_type="invalid_request_error")


class InternalError(ProxyError):
    """A fault inside the proxy. The client learns that it happened and the id the log has the
    details under, never the exception's text (it may name files, hosts or internals)."""

    def __init__(self, request_id: str, status: int = 500) -> None:
        super().__init__(status, f"internal proxy error; the proxy's log has the details under request id {request_id}")


class BackendUnreachable(ProxyError):
    """No answer from a backend (refused, reset, timed out). Which kinds count against the
    instance's health is health.py's call; an answered error never does (the instance is alive)."""

    def __init__(self, message: str, *, stage: str, backend: str, timed_out: bool = False) -> None:
        super().__init__(504 if timed_out else 502, message, stage=stage, backend=backend)


# The type vLLM's admission control (`AsyncLLM.check_admission`: --max-num-queued-reqs,
# --max-num-queued-tokens) gives its 503, in every API's error shape: the phrase of the status.
# No other vLLM error carries it, and no client text reaches it.
ENGINE_BUSY_TYPE = "Service Unavailable"


class ErrorAnswer(ProxyError):
    """A backend answered with an error; its status and body are passed on as they were.

    `busy`: vLLM's admission control refused the request before its engine saw any of it, so it
    may go to another instance (vLLM answers 503 for this so that a router does just that)."""

    def __init__(self, status: int, raw_body: bytes, content_type: str, *, stage: str, backend: str) -> None:
        error = _error_of(raw_body)
        super().__init__(status, _message_of(raw_body, error), stage=stage, backend=backend, answered=status)
        self.raw_body = raw_body
        self.content_type = content_type
        self.busy = status == 503 and isinstance(error, dict) and error.get("type") == ENGINE_BUSY_TYPE
        if self.busy:
            # Every instance tried was at its limit: a queue drains within seconds.
            self.retry_after_s = 1


def _default_type(status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    if status in (502, 504):
        return "upstream_error"
    if status == 503:
        return "service_unavailable"
    return "proxy_error" if status >= 500 else "request_error"


def _error_of(raw_body: bytes) -> object:
    """The error object of a JSON body (vLLM's `{"error": {...}}`, or the body itself), else None."""
    try:
        parsed = orjson.loads(raw_body)
    except orjson.JSONDecodeError:
        return None
    return parsed.get("error", parsed) if isinstance(parsed, dict) else parsed


def _message_of(raw_body: bytes, error: object) -> str:
    """The human part of a backend error body: vLLM's {"error": {"message": ...}} or plain text."""
    if isinstance(error, dict):
        if isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error.get("detail"), str):
            return error["detail"]
    if isinstance(error, str):
        return error
    return raw_body.decode("utf-8", "replace")[:2000]
