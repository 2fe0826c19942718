"""Two tenants on one fleet, for `epd-proxy bench --workload tenants`: their keys and the tenants
file that names them, their requests, and the client that sends them.

- the *flood* tenant sends image-heavy requests (`FLOOD_IMAGES` images each) at Poisson times, at
  a rate a multiple of its weighted share of the encoders' capacity: an open loop, because a
  flooding client does not wait for its answers;
- the *interactive* tenant runs a few chat clients, each sending a one-image question, reading the
  streamed answer and pausing before the next one; or, to keep both tenants backlogged, floods
  too (`Load.backlog_rate`), with requests of the flood's kind.

Every request's images are distinct bytes (a JPEG comment carries a serial number), so no proxy
and no engine cache can serve one request's images from another's: the flood costs the encoders
what it says. Each request carries its tenant's key as `Authorization: Bearer`; a proxy without
tenants ignores it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import secrets
import time
from dataclasses import dataclass, field

import aiohttp

from epd_proxy_tools.bench.chat_load import carries_a_token, read_answer
from epd_proxy_tools.bench.workload import CHAT_SIZES, QUESTIONS, TINY_SIZES, _textured_jpeg, streamed_body

FLOOD, INTERACTIVE = "flood", "interactive"
FLOOD_IMAGES = (6, 12)
# Tokens a request is counted for when its answer reports no usage: the tiny model's 64 per
# 224x224 image, a short question, and the answer's max_tokens.
TOKENS_PER_IMAGE, TOKENS_PER_REQUEST = 64, 32
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TenantSpec:
    name: str
    key: str
    weight: float = 1.0
    # The tenants file's deadline_ms; None: the tenant waits as long as it takes.
    deadline_ms: int | None = None
    # The vLLM `priority` every request of the tenant carries (its range [p, p]); 0: vLLM's default.
    priority: int = 0


def new_tenants(flood_deadline_ms: int | None, interactive_priority: int = 0) -> tuple[TenantSpec, TenantSpec]:
    """The flood and the interactive tenant, with fresh keys: only their digests are written down."""
    return (
        TenantSpec(FLOOD, secrets.token_urlsafe(24), 1.0, flood_deadline_ms),
        TenantSpec(INTERACTIVE, secrets.token_urlsafe(24), 1.0, None, interactive_priority),
    )


def tenants_toml(tenants: tuple[TenantSpec, ...]) -> str:
    """The proxy's `--tenants` file for these tenants (docs/keys.md): key digests, never keys."""
    lines = ["[default]", ""]
    for t in tenants:
        lines += [f"[tenants.{t.name}]", f'key_sha256 = ["{hashlib.sha256(t.key.encode()).hexdigest()}"]']
        lines.append(f"weight = {t.weight:g}")
        if t.deadline_ms is not None:
            lines.append(f"deadline_ms = {t.deadline_ms}")
        if t.priority:
            lines.append(f"priority = [{t.priority}, {t.priority}]")
        lines.append("")
    return "\n".join(lines)


def _unique(jpeg: bytes, serial: int) -> str:
    """The same picture as other bytes: a comment segment (FF FE) right after the start marker."""
    note = f"bench {serial}".encode()
    marked = jpeg[:2] + b"\xff\xfe" + (len(note) + 2).to_bytes(2, "big") + note + jpeg[2:]
    return "data:image/jpeg;base64," + base64.b64encode(marked).decode("ascii")


@dataclass
class Request:
    body: bytes
    images: int


def requests_for(
    tenant: str, count: int, *, model: str, seed: int, tiny: bool, first_serial: int = 0, heavy: bool = False
) -> list[Request]:
    """`count` streamed chat requests of `tenant`'s kind (`heavy`: the flood's kind whoever sends
    them), the same for every arm given the seed."""
    # Another tenant's flood draws apart from that tenant's chats.
    rng = random.Random(f"{seed}-{tenant}" + ("-heavy" if heavy and tenant != FLOOD else ""))
    heavy = heavy or tenant == FLOOD
    sizes = TINY_SIZES if tiny else CHAT_SIZES
    lo, hi = (600, 6_000) if tiny else (8_000, 40_000)
    pictures = [_textured_jpeg(rng, rng.choice(sizes), lo, hi) for _ in range(12)]
    out, serial = [], first_serial
    for _ in range(count):
        n = rng.randint(*FLOOD_IMAGES) if heavy else 1
        content: list[dict] = [{"type": "text", "text": rng.choice(QUESTIONS) if n > 1 else "What is in this image?"}]
        for _ in range(n):
            serial += 1
            content.append({"type": "image_url", "image_url": {"url": _unique(rng.choice(pictures), serial)}})
        out.append(Request(streamed_body(model, [{"role": "user", "content": content}], MAX_TOKENS), n))
    return out


@dataclass
class Sent:
    tenant: str
    started: float
    images: int
    ended: float | None = None  # None: no answer by the end of the block
    status: int = 0
    ttft: float | None = None
    tokens: int | None = None  # from the answer's usage
    retry_after: str | None = None
    error: str | None = None
    # Without an answer: how long it had waited when the block gave up on it.
    waited: float | None = None

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


async def send(session: aiohttp.ClientSession, url: str, tenant: TenantSpec, request: Request, out: list[Sent]) -> None:
    sent = Sent(tenant.name, time.perf_counter(), request.images)
    out.append(sent)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {tenant.key}"}
    events: list[bytes] = []
    try:
        async with session.post(url, data=request.body, headers=headers) as resp:
            sent.status = resp.status
            sent.retry_after = resp.headers.get("Retry-After")
            if resp.status != 200:
                sent.error = (await resp.read())[:200].decode(errors="replace")
            else:
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if sent.ttft is None and carries_a_token(data):
                        sent.ttft = time.perf_counter() - sent.started
                    events.append(data)
                answer, sent.error = read_answer(events)
                if answer is not None and answer.prompt_tokens is not None:
                    sent.tokens = answer.prompt_tokens + (answer.completion_tokens or 0)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        sent.error = f"{type(exc).__name__}: {exc}"[:200]
    sent.ended = time.perf_counter()


@dataclass
class Load:
    """One block's traffic: the flood's rate (0: the interactive tenant alone), the interactive
    tenant's own flood (0: it chats), and for how long."""

    seconds: float
    flood_rate: float
    interactive_clients: int
    backlog_rate: float = 0.0
    think_s: tuple[float, float] = (0.2, 0.5)
    # How long requests still open when sending stops may take to answer before they are dropped.
    drain_s: float = 10.0
    seed: int = 0
    tenants: tuple[TenantSpec, ...] = field(default_factory=tuple)


def flood_count(load: Load, rate: float | None = None) -> int:
    """Enough flood requests for the block's arrivals at `rate` (the flood's), with room for the
    Poisson draw's spread."""
    rate = load.flood_rate if rate is None else rate
    expected = rate * load.seconds
    return int(expected + 4 * expected**0.5 + 8) if rate > 0 else 0


def interactive_count(load: Load) -> int:
    """Enough for clients that never wait on an answer: one per shortest pause."""
    return load.interactive_clients * (int(load.seconds / max(0.05, load.think_s[0])) + 2)


async def _drive(
    url: str, load: Load, flood: list[Request], chats: list[Request], backlog: list[Request]
) -> list[Sent]:
    by_name = {t.name: t for t in load.tenants}
    out: list[Sent] = []
    rng = random.Random(load.seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        origin = time.perf_counter()
        stop = origin + load.seconds
        tasks: list[asyncio.Task] = []

        async def flooding(tenant: TenantSpec, rate: float, requests: list[Request], draw: random.Random) -> None:
            todo = iter(requests)
            at = origin
            while rate > 0:
                at += draw.expovariate(rate)
                if at >= stop:
                    return
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                request = next(todo, None)
                if request is None:
                    return
                tasks.append(asyncio.create_task(send(session, url, tenant, request, out)))

        todo_chats = iter(chats)

        async def chatting(client: int) -> None:
            pauses = random.Random(f"{load.seed}-{client}")
            # Clients start spread over the first pause, not all at once.
            await asyncio.sleep(pauses.uniform(0, load.think_s[1]))
            while time.perf_counter() < stop:
                request = next(todo_chats, None)
                if request is None:
                    return
                await send(session, url, by_name[INTERACTIVE], request, out)
                await asyncio.sleep(pauses.uniform(*load.think_s))

        clients = [asyncio.create_task(chatting(c)) for c in range(load.interactive_clients)]
        await asyncio.gather(
            flooding(by_name[FLOOD], load.flood_rate, flood, rng),
            flooding(by_name[INTERACTIVE], load.backlog_rate, backlog, random.Random(f"{load.seed}-backlog")),
        )
        rest = [*clients, *tasks]
        left = max(0.0, stop - time.perf_counter()) + load.drain_s
        _, pending = await asyncio.wait(rest, timeout=left) if rest else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        cut = time.perf_counter()
    for sent in out:
        if sent.ended is None:
            sent.waited = cut - sent.started
        sent.started -= origin
        if sent.ended is not None:
            sent.ended -= origin
    return out


def run(
    url: str, load: Load, flood: list[Request], chats: list[Request], backlog: list[Request] | None = None
) -> list[Sent]:
    """Send the block to `url` (a chat completions URL); each request's record, times from the
    block's start. A request without an answer when the drain ends keeps `ended` None."""
    return asyncio.run(_drive(url, load, flood, chats, backlog or []))


async def _calibrate(url: str, tenant: TenantSpec, requests: list[Request], concurrency: int) -> tuple[float, float]:
    out: list[Sent] = []
    todo = iter(requests)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def client() -> None:
            for request in todo:
                await send(session, url, tenant, request, out)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
        wall = time.perf_counter() - started
    ok = [s for s in out if answered(s)]
    if not ok:
        # Every figure of the run is against this capacity: none is worth a run.
        first = next((s for s in out), None)
        why = "nothing sent" if first is None else (first.error or f"HTTP {first.status}")
        raise SystemExit(f"[bench] the proxy answered none of the {len(out)} capacity requests ({why}): see its log")
    done = [(s.ended, s.images if answered(s) else 0) for s in out if s.ended is not None]
    whole = (len(ok) / wall, sum(s.images for s in ok) / wall) if wall else (0.0, 0.0)
    return steady_rate(done, concurrency) or whole


def answered(sent: Sent) -> bool:
    """Answered 200 in full."""
    return sent.status == 200 and sent.error is None and sent.ended is not None


def steady_rate(done: list[tuple[float, int]], concurrency: int) -> tuple[float, float] | None:
    """Answers and images answered per second while `concurrency` requests were always in flight:
    between the `concurrency`-th request to end and the one `concurrency` before the last, when
    the pipeline was full. `done`: each request's end and the images of its answer (0: it failed).
    The first answers wait on a cold start and the last ones on fewer in flight, and counting them
    measured 37.5 images/s of a fleet that then served 48. None when too few requests ended."""
    done = sorted(done)
    first, last = concurrency - 1, len(done) - concurrency - 1
    if last - first < concurrency or done[last][0] <= done[first][0]:
        return None
    window, span = done[first + 1 : last + 1], done[last][0] - done[first][0]
    return sum(1 for _, images in window if images) / span, sum(images for _, images in window) / span


def capacity(url: str, tenant: TenantSpec, requests: list[Request], concurrency: int) -> tuple[float, float]:
    """Flood requests and their images answered per second with `concurrency` of them always in
    flight: what the encoders sustain of that kind of request."""
    return asyncio.run(_calibrate(url, tenant, requests, concurrency))
