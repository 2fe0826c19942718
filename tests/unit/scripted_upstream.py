"""A stand-in for the backend-call layer (epd_proxy.calls.upstream.Upstream) for unit tests: each backend
answers from a script, every call is recorded, and no socket is opened."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.calls.upstream import Limits, NoAnswer, Payload, Timeouts
from epd_proxy.errors import ErrorAnswer

SSE = "text/event-stream"


@dataclass(frozen=True)
class Reply:
    """What a backend does with one call: answer `status` with `chunks`, then break off with a
    failure of kind `breaks` if set; with `fails` set it never answers at all."""

    status: int = 200
    chunks: Sequence[bytes] = (b"{}",)
    content_type: str = "application/json"
    breaks: str | None = None
    fails: str | None = None


def json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, (orjson.dumps(obj),))


def stream_reply(*events: bytes, breaks: str | None = None) -> Reply:
    return Reply(200, events, SSE, breaks=breaks)


@dataclass
class Sent:
    """One call as the layer was asked to make it."""

    url: str
    method: str
    path: str
    body: Any
    headers: dict[str, str]
    timeouts: Timeouts
    stage: str
    options: dict[str, Any]


class ScriptedAnswer:
    """The parts of upstream.Answer the stages use."""

    def __init__(self, reply: Reply, url: str, stage: str, what: str) -> None:
        self.status = reply.status
        self.content_type = reply.content_type
        self.body: bytes | None = None
        self.capped_at: int | None = None
        self.released = False
        self._reply = reply
        self._url = url
        self._stage = stage
        self._what = what

    def cap_body(self, max_bytes: int) -> None:
        self.capped_at = max_bytes

    def error(self) -> ErrorAnswer:
        return ErrorAnswer(self.status, self.body or b"", self.content_type, stage=self._stage, backend=self._url)

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._reply.chunks:
            yield chunk
        if self._reply.breaks is not None:
            self.release()
            raise NoAnswer(self._reply.breaks, "scripted", what=self._what, stage=self._stage, backend=self._url)
        self.release()

    async def read(self) -> bytes:
        if self.body is None:
            self.body = b"".join([chunk async for chunk in self.chunks()])
        return self.body

    def release(self) -> None:
        self.released = True

    async def __aenter__(self) -> ScriptedAnswer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _loaded(body: Payload | None) -> Any:
    if body is None:
        return None
    raw = b"".join(bytes(part) for part in body) if isinstance(body, list) else bytes(body)
    return orjson.loads(raw)


class ScriptedUpstream:
    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self.sent: list[Sent] = []
        self.answers: list[ScriptedAnswer] = []
        self._scripts: dict[str, deque[Reply]] = defaultdict(deque)

    def script(self, url: str, *replies: Reply) -> None:
        self._scripts[url].extend(replies)

    def to(self, url: str) -> list[Sent]:
        return [sent for sent in self.sent if sent.url == url]

    async def open(
        self,
        target,
        method: str,
        path: str,
        *,
        body: Payload | None = None,
        headers: dict[str, str] | None = None,
        timeouts: Timeouts,
        stage: str,
        what: str,
        **options: Any,
    ) -> ScriptedAnswer:
        self.sent.append(Sent(target.url, method, path, _loaded(body), dict(headers or {}), timeouts, stage, options))
        script = self._scripts[target.url]
        assert script, f"{target.url} was called more often than scripted"
        reply = script.popleft()
        if reply.fails is not None:
            raise NoAnswer(reply.fails, "scripted", what=what, stage=stage, backend=target.url)
        answer = ScriptedAnswer(reply, target.url, stage, what)
        self.answers.append(answer)
        return answer

    async def call(self, target, method: str, path: str, **options: Any) -> ScriptedAnswer:
        answer = await self.open(target, method, path, **options)
        try:
            await answer.read()
        finally:
            answer.release()
        return answer

    def unused(self) -> dict[str, int]:
        return {url: len(script) for url, script in self._scripts.items() if script}
