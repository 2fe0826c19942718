"""Step 7: send decode the prepared body and hand back its answer once it is committed.

The client's status is decided only after decode's headers arrive, so a failure anywhere in the
pipeline reaches a streaming client as a real HTTP error instead of a 200 stream that breaks off.
vLLM itself answers a stream with 200 before the engine runs and reports a generation failure
in-band (see sse.py), so a stream's head is held until its first generated event: until then a
failure is still a retry or a real HTTP error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from epd_proxy.calls.sse import Head, Verdict
from epd_proxy.calls.upstream import Answer, NoAnswer, Payload, Timeouts, Upstream
from epd_proxy.fleet.backends import CHAT_PATH, Instance

# A non-streaming answer is read whole before it is relayed. Its size grows with the request
# (n choices x max_tokens x top logprobs): 64 MiB holds n=8 x 4096 tokens with 20 top logprobs.
MAX_JSON_ANSWER_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One prefill or decode request: the instance, the prepared body, and how it goes out (its
    headers and limits, the writer that splices the client's media back in, the client's API's
    path)."""

    instance: Instance
    body: dict[str, Any]
    headers: dict[str, str]
    timeouts: Timeouts
    dumps: Callable[[Any], Payload] = orjson.dumps
    path: str = CHAT_PATH


@dataclass(slots=True)
class DecodeAnswer:
    """Decode's 2xx answer: the bytes read while judging its head, and the rest still unread.
    `chunks` raises NoAnswer when decode goes silent (`--stream-idle-timeout`) or breaks off."""

    answer: Answer
    chunks: AsyncIterator[bytes]
    backend: str
    held: bytes = b""

    @property
    def status(self) -> int:
        return self.answer.status

    @property
    def content_type(self) -> str:
        return self.answer.content_type

    @property
    def streaming(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def release(self) -> None:
        """Back to the pool if read to the end, else closed, so a stalled decode is let go."""
        self.answer.release()


async def open_decode(upstream: Upstream, call: EngineCall) -> DecodeAnswer:
    """A 2xx answer whose body is still unread; the caller must release it. The decode timeout
    bounds the wait for headers, the idle timeout each silence after them: a long stream is
    legitimate, a silent one is not."""
    answer = await upstream.open(
        call.instance,
        "POST",
        call.path,
        body=call.dumps(call.body),
        headers=call.headers,
        timeouts=call.timeouts,
        stage="decode",
        what="Decode request",
        # The request holds this decoder from routing's choice on (pipeline.Route.held).
        count_inflight=False,
    )
    if answer.status >= 400:
        answer.cap_body(upstream.limits.buffered_body_bytes)
        async with answer:
            try:
                await answer.read()
            except NoAnswer:
                pass  # the status is the answer; a body cut short only loses the details
        raise answer.error()
    decode_answer = DecodeAnswer(answer, answer.chunks(), call.instance.url)
    if not decode_answer.streaming:
        answer.cap_body(MAX_JSON_ANSWER_BYTES)  # relayed whole, so read whole: bounded
    return decode_answer


async def hold_head(answer: DecodeAnswer, judge: Callable[[bytes], Verdict]) -> tuple[Verdict, dict[str, Any] | None]:
    """Read a stream until its first generated event, a JSON answer whole (its cap set by
    `open_decode`) for `judge` (its door's). The verdict: COMMIT; ERROR with vLLM's in-band error
    object when the stream reported a failure before generating; NOTHING when vLLM aborted the
    request before generating; CUT when it aborted a JSON answer partway. Failures to read raise."""
    if not answer.streaming:
        answer.held = b"".join([chunk async for chunk in answer.chunks])
        return judge(answer.held), None
    head = Head()
    async for chunk in answer.chunks:
        verdict, error = head.judge(chunk)
        if verdict is Verdict.HOLD:
            continue
        answer.held = bytes(head.held)
        return verdict, error
    answer.held = bytes(head.held)
    return Verdict.COMMIT, None
