"""A streaming chat client for real engines: conversations closed-loop at a concurrency, or opened
at Poisson arrival times; each turn waits for the previous turn's answer, as a chat client does.

It records, per request, latency, time to first token and the answer (text, finish reason, token
counts) so answers can be compared with a single plain vLLM instance's. Real engines serve a few
requests per second here, so aiohttp's client costs the harness little; its share is reported.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

import aiohttp
import orjson

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass
class Result:
    conversation: int
    turn: int
    started: float
    ended: float
    status: int
    ttft: float | None = None
    answer: Answer | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.answer is not None and self.error is None

    @property
    def latency(self) -> float:
        return self.ended - self.started


def read_answer(events: list[bytes]) -> tuple[Answer | None, str | None]:
    """The answer assembled from a chat completion's SSE `data:` payloads, or the in-band error
    vLLM sends after a 200 when a stream fails."""
    text, finish, usage = [], None, None
    for data in events:
        if data == b"[DONE]":
            break
        event = orjson.loads(data)
        if "error" in event:
            return None, str(event["error"])[:300]
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    usage = usage or {}
    return Answer("".join(text), finish, usage.get("prompt_tokens"), usage.get("completion_tokens")), None


def carries_a_token(data: bytes) -> bool:
    """Whether an SSE payload holds generated output: time to first token is when the first
    such event arrives. vLLM's role-only opening chunk (`"content": ""`) does not count; a proxy
    may hold it back until the first token to judge the stream's head, which costs the user
    nothing, while counting it would credit a proxy for relaying it early."""
    if data == b"[DONE]" or b'"delta"' not in data:
        return False
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if any(value for key, value in delta.items() if key != "role"):
            return True
    return False


def turn_request_id(conversation: int, turn: int) -> str:
    """The `x-request-id` of one turn: named by conversation and turn, so a proxy's request log
    shows where each turn of a conversation went; unique, as vLLM takes it for its own id."""
    return f"c{conversation}-t{turn}-{uuid.uuid4().hex[:8]}"


async def _send(session: aiohttp.ClientSession, url: str, body: bytes, conversation: int, turn: int) -> Result:
    started = time.perf_counter()
    result = Result(conversation, turn, started, started, 0)
    events: list[bytes] = []
    try:
        headers = {"Content-Type": "application/json", "x-request-id": turn_request_id(conversation, turn)}
        async with session.post(url, data=body, headers=headers) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error = (await resp.read())[:300].decode(errors="replace")
            else:
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if result.ttft is None and carries_a_token(data):
                        result.ttft = time.perf_counter() - started
                    events.append(data)
                result.answer, result.error = read_answer(events)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.ended = time.perf_counter()
    return result


# Pauses between a conversation's turns, in seconds: (shortest, longest), drawn uniformly from a
# stream seeded by the conversation, so every arm waits the same. An agent's tools run between its
# steps; without pauses a closed loop flatters load-based routing (the instance a turn just left
# is the less loaded one when the next turn arrives).
Think = tuple[float, float]


async def _conversation(
    session, url: str, index: int, turns: list[bytes], results: list[Result], think: Think = (0.0, 0.0)
) -> None:
    pauses = random.Random(index)
    for turn, body in enumerate(turns):
        if turn and think[1] > 0:
            await asyncio.sleep(pauses.uniform(*think))
        result = await _send(session, url, body, index, turn)
        results.append(result)
        if not result.ok:
            return  # a client whose turn failed does not send the next one


def _session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(1, concurrency), force_close=False),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )


async def closed_loop(
    url: str, conversations: list[list[bytes]], concurrency: int, think: Think = (0.0, 0.0)
) -> list[Result]:
    """`concurrency` clients, each taking the next conversation as soon as its last one ended."""
    results: list[Result] = []
    todo = iter(enumerate(conversations))

    async def client(session) -> None:
        for index, turns in todo:
            await _conversation(session, url, index, turns, results, think)

    async with _session(concurrency) as session:
        await asyncio.gather(*(client(session) for _ in range(max(1, concurrency))))
    return results


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps, the same for every arm given the same seed."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def open_loop(
    url: str, conversations: list[list[bytes]], rate_rps: float, seed: int, think: Think = (0.0, 0.0)
) -> list[Result]:
    """Conversations start at Poisson times so that requests arrive at about `rate_rps` while the
    system keeps up; a slow system is not given a pause (no client waits for another)."""
    turns = sum(map(len, conversations)) / max(1, len(conversations))
    starts = arrival_times(len(conversations), rate_rps / turns, seed)
    results: list[Result] = []
    async with _session(len(conversations)) as session:
        origin = time.perf_counter()

        async def start_at(index: int, delay: float) -> None:
            await asyncio.sleep(max(0.0, origin + delay - time.perf_counter()))
            await _conversation(session, url, index, conversations[index], results, think)

        await asyncio.gather(*(start_at(i, d) for i, d in enumerate(starts)))
    return results


def run(
    url: str,
    conversations: list[list[bytes]],
    *,
    concurrency: int = 0,
    rate: float = 0.0,
    seed: int = 0,
    think: Think = (0.0, 0.0),
):
    if rate > 0:
        return asyncio.run(open_loop(url, conversations, rate, seed, think))
    return asyncio.run(closed_loop(url, conversations, concurrency, think))
