"""What following the engines' KV events costs the proxy at fleet scale, without a fleet:

    python -m epd_proxy_tools.bench.kv_sim [--pds 4,16,64] [--sessions 1000,10000]
        [--blocks-per-pd 4096] [--requests 5000] [--exact] [--json out.json]

Each PD is the fake vLLM's block pool (testing/fake_kv_events.BlockPool: vLLM's LRU free queue,
32-token blocks) and its events travel as the fake publishes them (msgpack of vLLM's structs),
so the proxy's side is its own code path, ZMQ's receive aside: `kv_events.Feed.receive` decodes
each batch with kv_wire.py and applies it to a `KvIndex` with the proxy's default bounds.

The workload is agent sessions, `--sessions` of them live at once, each step a request to a
uniformly random live session: a shared preamble of 1,500 tokens (system prompt and tools), then
per step 35 tokens of text, one 64-token screenshot named as the proxy names an image
(extract.content_uuid of its `data:` URL; each session's first screenshot is one of a few every
session shares) and a 16-token answer: 115 tokens a step. A session ends after 10 steps and a new
one takes its place; the live ones start at random steps, with histories no PD ever served.

Per request the proxy's own per-request calls are timed (journey/pipeline.py's choose_route and
_known, past the conversation key): `PrefixAffinity.choose` over every PD with the KV index's
answers (`KvHolds`) and the prefill cost of each (fleet/prefill_cost.py), then the chosen consumer's answers for the request's images,
`index_uuids`, `media_names` and `HeldMedia.held` (`decide_held`). The chosen PD serves the
request; its events go out as batches, each run of one event type a batch of its own so that
stores and removals are timed apart, and the feed applies them. Everything timed is process CPU
time (`time.process_time`) summed over the measured requests, after a warm-up of at least one
request per session, longer (up to two per session) until every PD has evicted. Reading the
process's CPU time costs a system call: the mean of an empty span is taken off every span. Index
memory is the size of every object the index holds (a walk of its references, each counted once;
`--tracemalloc` also sums the allocations made by the index's code still alive, slower). Load:
the last `--in-flight-per-pd` x PDs requests count as in flight where they went, their prefill
work queued there. With `--exact`, placement asks about the prompt's blocks, named as
fleet/rendered.py names a render server's answer (`--render-urls`), the render itself aside.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from epd_proxy.fleet import kv_events, kv_index
from epd_proxy.fleet.backends import PREFILL_DECODE, Instance
from epd_proxy.fleet.kv_events import Feed, Source
from epd_proxy.fleet.kv_holds import KvHolds
from epd_proxy.fleet.kv_index import KvIndex
from epd_proxy.fleet.kv_wire import seq_bytes
from epd_proxy.fleet.prefill_cost import Prompt as PromptEstimate
from epd_proxy.fleet.rendered import Item, Rendered
from epd_proxy.fleet.routing import EXACT, INDEX, Placement, PrefixAffinity
from epd_proxy.journey.extract import MediaItem, Place, content_uuid
from epd_proxy.journey.held import HeldMedia, index_uuids, media_names
from epd_proxy_tools.testing.fake_kv_events import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    Feature,
    KVEventBatch,
    Prompt,
)

BLOCK_SIZE = 32
PREAMBLE_TOKENS = 1500
TEXT_TOKENS = 35
IMAGE_TOKENS = 64
ANSWER_TOKENS = 16
STEPS = 10
SHARED_FIRST_SCREENSHOTS = 4
IMAGE_TOKEN = 258  # the fake's image placeholder
# The proxy's request rate the simulated clock assumes: what ages its records and the index.
SECONDS_PER_REQUEST = 0.01
MODEL = "sim-vlm"


@dataclass
class Settings:
    pds: int = 16
    sessions: int = 10_000
    blocks_per_pd: int = 4096
    requests: int = 5_000
    # Requests before measuring: at least this many, and until every PD has evicted.
    warmup: int | None = None
    max_index_blocks: int = 250_000
    shared_first_screenshots: int = SHARED_FIRST_SCREENSHOTS
    # Requests in flight per PD on average: the last `pds * this` requests count as in flight
    # where they went, their prefill work queued there as placement weighs it.
    in_flight_per_pd: int = 4
    seed: int = 0
    tracemalloc: bool = False
    # Place from the prompt's blocks as a render server would give them (--render-urls), not
    # through its images: the names are made and looked up in the timed span.
    exact: bool = False


@dataclass
class Result:
    pds: int
    sessions: int
    blocks_per_pd: int
    requests: int
    warmup: int
    # The index at the end.
    index_blocks: int = 0
    index_bytes: int = 0
    bytes_per_block: float = 0.0
    traced_bytes: int | None = None
    index_evictions: int = 0
    pool_blocks: int = 0
    # Measured requests' events and CPU (seconds).
    stored_batches: int = 0
    stored_blocks: int = 0
    stored_cpu_s: float = 0.0
    removed_batches: int = 0
    removed_blocks: int = 0
    removed_cpu_s: float = 0.0
    decisions: int = 0
    placement_cpu_s: float = 0.0
    held_cpu_s: float = 0.0
    # How placement went: by the index, and against the pools' own state.
    placed_by_index: int = 0
    # The session's last step ran on a PD that still holds its whole prompt, and how many of those
    # requests went back to it.
    prefix_kept: int = 0
    prefix_followed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    images: int = 0
    images_held: int = 0
    # The share of the measured requests the busiest PD served.
    busiest_share: float = 0.0
    sim_wall_s: float = 0.0
    # What an empty timed span measured (taken off every span), in µs.
    timer_bias_us: float = 0.0
    per_pd_blocks: list[int] = field(default_factory=list)

    @property
    def us_per_stored_batch(self) -> float:
        return _us(self.stored_cpu_s, self.stored_batches)

    @property
    def us_per_stored_block(self) -> float:
        return _us(self.stored_cpu_s, self.stored_blocks)

    @property
    def us_per_removed_block(self) -> float:
        return _us(self.removed_cpu_s, self.removed_blocks)

    @property
    def us_per_decision(self) -> float:
        return _us(self.placement_cpu_s + self.held_cpu_s, self.decisions)

    @property
    def us_per_placement(self) -> float:
        return _us(self.placement_cpu_s, self.decisions)

    @property
    def us_per_held(self) -> float:
        return _us(self.held_cpu_s, self.decisions)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        for name in (
            "us_per_stored_batch",
            "us_per_stored_block",
            "us_per_removed_block",
            "us_per_decision",
            "us_per_placement",
            "us_per_held",
        ):
            out[name] = round(getattr(self, name), 2)
        return out


def timer_bias(samples: int = 20_000) -> float:
    """The mean of an empty `process_time` interval: what each timed span counts beyond its work
    (reading a process's CPU time is a system call, microseconds where it is not in the vDSO)."""
    clock = time.process_time
    total = 0.0
    for _ in range(samples):
        started = clock()
        total += clock() - started
    return total / samples


def _us(seconds: float, count: int) -> float:
    return seconds * 1e6 / count if count else 0.0


# -- the workload ------------------------------------------------------------------------------------


IMAGE = [IMAGE_TOKEN] * IMAGE_TOKENS


def screenshot_uuid(session: int, step: int, shared: int) -> str:
    """The proxy's name of a step's screenshot: a session's first one is one of `shared` every
    session shares (when there are any)."""
    label = f"shared {session % shared}" if step == 0 and shared else f"session {session} step {step}"
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + label.encode().hex()}}
    return content_uuid(part, "image_url")


class Session:
    """One agent session: its id, the step it is at, where its last step ran, and its steps' text,
    answers and screenshots' uuids as far as it got."""

    __slots__ = ("id", "step", "last_pd", "last_hash", "pieces")

    def __init__(self, session_id: int, step: int) -> None:
        self.id = session_id
        self.step = step
        self.last_pd: int | None = None
        # The engine hash of the last full block the last step stored: a PD evicts a request's
        # blocks tail first, so while it holds this one it holds the whole prompt.
        self.last_hash: int | None = None
        self.pieces: list[tuple[bytes, str, bytes]] = []


class Workload:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.preamble = list(random.Random(-1).randbytes(PREAMBLE_TOKENS))
        self._next_id = 0
        self.live = [self._new(self.rng.randrange(STEPS)) for _ in range(settings.sessions)]

    def _new(self, step: int) -> Session:
        self._next_id += 1
        return Session(self._next_id, step)

    def pick(self) -> tuple[int, Session]:
        slot = self.rng.randrange(len(self.live))
        return slot, self.live[slot]

    def advance(self, slot: int, session: Session) -> None:
        session.step += 1
        if session.step >= STEPS:
            self.live[slot] = self._new(0)

    def prompt(self, session: Session) -> tuple[Prompt, list[int], list[str]]:
        """The step's prompt, the answer it will get, and the uuids of its images in order."""
        shared = self.settings.shared_first_screenshots
        while len(session.pieces) <= session.step:
            step = len(session.pieces)
            rng = random.Random(session.id * STEPS + step)
            uuid = screenshot_uuid(session.id, step, shared)
            session.pieces.append((rng.randbytes(TEXT_TOKENS), uuid, rng.randbytes(ANSWER_TOKENS)))
        tokens = list(self.preamble)
        features: list[Feature] = []
        for text, uuid, answer in session.pieces[: session.step]:
            tokens += text
            features.append(Feature(uuid, len(tokens), IMAGE_TOKENS))
            tokens += IMAGE
            tokens += answer
        text, uuid, answer = session.pieces[session.step]
        tokens += text
        features.append(Feature(uuid, len(tokens), IMAGE_TOKENS))
        tokens += IMAGE
        return Prompt(tokens, features, [len(tokens)]), list(answer), [feature.identifier for feature in features]


def media_items(uuids: Sequence[str]) -> list[MediaItem]:
    return [MediaItem(i, "image_url", {}, uuid, Place(i, "content", 1)) for i, uuid in enumerate(uuids)]


# -- the fleet and the proxy's side ------------------------------------------------------------------


def runs(events: Sequence[Any]) -> Iterator[list[Any]]:
    """The events in order, cut where their type changes: each run goes out as one batch."""
    run: list[Any] = []
    for event in events:
        if run and type(event) is not type(run[-1]):
            yield run
            run = []
        run.append(event)
    if run:
        yield run


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """The PDs' pools and, on the proxy's side, the index with one feed per PD and the routing."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.clock = Clock()
        self.index = KvIndex(max_blocks=settings.max_index_blocks, clock=self.clock)
        self.instances = [Instance(f"http://pd{i}:8000", PREFILL_DECODE) for i in range(settings.pds)]
        self.pools = [BlockPool(settings.blocks_per_pd, BLOCK_SIZE) for _ in self.instances]
        self.feeds: list[Feed] = []
        for instance in self.instances:
            feed = Feed((instance.url, 0), Source("tcp://sim:5557"), self.index, None)  # type: ignore[arg-type]
            self.index.watch(feed.engine)
            self.feeds.append(feed)
        self.seqs = [0] * settings.pds
        self.evicting = [False] * settings.pds
        self.served = [0] * settings.pds
        self.in_flight: deque[tuple[int, float]] = deque()
        ranks = {instance.url: (0,) for instance in self.instances}
        self.holds = KvHolds(self.index, lambda url: ranks.get(url, ()))
        self.placement = PrefixAffinity(clock=self.clock)
        self.placement.holds = self.holds
        self.placement.decided = self._decided
        self.decided_by: str | None = None
        self.held = HeldMedia(clock=self.clock)
        self._encode = msgspec.msgpack.Encoder().encode
        # Taken off every timed span.
        self.bias = timer_bias()

    def started(self, pd: int, claim: float) -> None:
        """The request holds its PD, and its prefill work stays queued there, until
        `in_flight_per_pd * pds` later requests have started."""
        self.instances[pd].inflight += 1
        self.instances[pd].prefill_queue += claim
        self.in_flight.append((pd, claim))
        if len(self.in_flight) > self.settings.in_flight_per_pd * self.settings.pds:
            done, work = self.in_flight.popleft()
            self.instances[done].inflight -= 1
            self.instances[done].prefill_queue -= work

    def _decided(self, source: str) -> None:
        self.decided_by = source

    def route(
        self, session: Session, items: list[MediaItem], prompt: Prompt
    ) -> tuple[Placement, int, float, float, int]:
        """The proxy's per-request calls: the placement and its PD, CPU seconds of placement and
        of the held decision, and how many images it takes as held."""
        body: dict[str, Any] = {"model": MODEL}
        key = f"session {session.id}"
        started = time.process_time()
        uuids = list(index_uuids(body, items).values())
        rendered = None
        if self.settings.exact:
            rendered = Rendered(prompt.tokens, [Item(f.identifier, f.offset, f.length) for f in prompt.features])
        estimate = PromptEstimate(float(len(prompt.tokens)), uuids, rendered)
        placement = self.placement.place(self.instances, key, estimate)
        chosen = placement.instance
        placed = time.process_time()
        names = media_names(body, items) or {}
        by_index = index_uuids(body, items)
        depth = dict(zip(by_index, self.holds(chosen.url, list(by_index.values()), None)))
        heard_at = self.holds.heard_at(chosen.url, None)
        holding = self.held.held(items, names, chosen.url, depth, heard_at)
        done = time.process_time()
        self.held.sent(chosen.url, names.values())
        self.held.encoded(names[i] for i in range(len(items)) if i not in holding.held)
        bias = self.bias
        pd = int(chosen.url[len("http://pd") : -len(":8000")])
        return placement, pd, placed - started - bias, done - placed - bias, len(holding.held)

    def serve(self, pd: int, prompt: Prompt, answer: list[int], result: Result | None) -> tuple[int, int | None]:
        """The PD serves the request and its events reach the proxy: the prompt tokens it found
        cached, and the engine hash of the last block it stored."""
        events: list[Any] = []
        served = self.pools[pd].serve(prompt, answer, None, events)
        feed = self.feeds[pd]
        for run in runs(events):
            payload = self._encode(KVEventBatch(ts=self.clock.now, events=run, data_parallel_rank=0))
            frames = [b"", seq_bytes(self.seqs[pd]), payload]
            self.seqs[pd] += 1
            started = time.process_time()
            feed.receive(frames)
            cpu = time.process_time() - started - self.bias
            if type(run[0]) is BlockRemoved:
                self.evicting[pd] = True
            if result is None:
                continue
            if type(run[0]) is BlockStored:
                result.stored_batches += 1
                result.stored_blocks += sum(len(event.block_hashes) for event in run)
                result.stored_cpu_s += cpu
            else:
                result.removed_batches += 1
                result.removed_blocks += sum(len(event.block_hashes) for event in run)
                result.removed_cpu_s += cpu
        stored = [event for event in events if type(event) is BlockStored]
        return served.cached_tokens, stored[-1].block_hashes[-1] if stored else None

    def holds_prompt(self, pd: int, block_hash: int) -> bool:
        return block_hash in self.pools[pd]._holders


def step(fleet: Fleet, workload: Workload, result: Result | None) -> None:
    slot, session = workload.pick()
    prompt, answer, uuids = workload.prompt(session)
    items = media_items(uuids)
    fleet.clock.now += SECONDS_PER_REQUEST
    fleet.decided_by = None
    placement, pd, placement_s, held_s, held = fleet.route(session, items, prompt)
    kept = session.last_pd is not None and session.last_hash is not None
    kept = kept and fleet.holds_prompt(session.last_pd, session.last_hash)  # type: ignore[arg-type]
    fleet.started(pd, placement.claim)
    cached, last_hash = fleet.serve(pd, prompt, answer, result)
    placement.turn.prefilled_at = fleet.clock.now
    if result is not None:
        result.decisions += 1
        result.placement_cpu_s += placement_s
        result.held_cpu_s += held_s
        result.placed_by_index += fleet.decided_by in (INDEX, EXACT)
        result.prefix_kept += kept
        result.prefix_followed += kept and pd == session.last_pd
        result.prompt_tokens += len(prompt.tokens)
        result.cached_tokens += cached
        result.images += len(items)
        result.images_held += held
    if session.last_pd != pd or last_hash is not None:
        session.last_hash = last_hash
    session.last_pd = pd
    fleet.served[pd] += result is not None
    workload.advance(slot, session)


# -- memory ------------------------------------------------------------------------------------------


def retained_bytes(root: object) -> int:
    """The size of every object reachable from `root`, each counted once; classes, functions and
    modules (shared with the rest of the process) are not counted."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    skip = (type, type(sys), type(retained_bytes))
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def index_bytes(index: KvIndex) -> int:
    return retained_bytes(index._engines)


def traced_index_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """What the index's code (kv_index.py, and kv_wire.py's decoding, which made the hashes and
    media ids the index keeps) allocated and still holds."""
    files = [tracemalloc.Filter(True, kv_index.__file__), tracemalloc.Filter(True, kv_events.__file__)]
    wire = sys.modules["epd_proxy.fleet.kv_wire"].__file__
    assert wire is not None
    files.append(tracemalloc.Filter(True, wire))
    return sum(stat.size for stat in snapshot.filter_traces(files).statistics("filename"))


# -- a run -------------------------------------------------------------------------------------------


def simulate(settings: Settings) -> tuple[Result, Fleet]:
    began = time.perf_counter()
    workload = Workload(settings)
    fleet = Fleet(settings)
    if settings.tracemalloc:
        tracemalloc.start()
    warmup = 0
    least = settings.sessions if settings.warmup is None else settings.warmup
    most = max(least, 2 * settings.sessions) if settings.warmup is None else settings.warmup
    while warmup < least or (warmup < most and not all(fleet.evicting)):
        step(fleet, workload, None)
        warmup += 1
    result = Result(settings.pds, settings.sessions, settings.blocks_per_pd, settings.requests, warmup)
    for _ in range(settings.requests):
        step(fleet, workload, result)
    if settings.tracemalloc:
        result.traced_bytes = traced_index_bytes(tracemalloc.take_snapshot())
        tracemalloc.stop()
    index = fleet.index
    result.index_blocks = index.blocks
    result.index_bytes = index_bytes(index)
    result.bytes_per_block = result.index_bytes / index.blocks if index.blocks else 0.0
    result.index_evictions = index.evictions
    result.per_pd_blocks = [index.size(feed.engine) for feed in fleet.feeds]
    result.pool_blocks = sum(len(pool._holders) for pool in fleet.pools)
    result.timer_bias_us = round(fleet.bias * 1e6, 2)
    result.busiest_share = max(fleet.served) / max(result.decisions, 1)
    result.sim_wall_s = time.perf_counter() - began
    return result, fleet


HEADER = (
    f"{'PDs':>4} {'sessions':>8} {'blocks':>8} {'index MB':>8} {'B/block':>7} {'µs/store':>8} {'µs/blk+':>7} "
    f"{'µs/blk-':>7} {'µs/dec':>7} {'place':>7} {'held':>5} {'by idx':>6} {'kept':>5} {'follow':>6} "
    f"{'cached':>6} {'top':>5} {'wall s':>6}"
)


def row(r: Result) -> str:
    followed = r.prefix_followed / r.prefix_kept if r.prefix_kept else 0.0
    return (
        f"{r.pds:>4} {r.sessions:>8} {r.index_blocks:>8} {r.index_bytes / 1e6:>8.1f} {r.bytes_per_block:>7.0f} "
        f"{r.us_per_stored_batch:>8.1f} {r.us_per_stored_block:>7.2f} {r.us_per_removed_block:>7.2f} "
        f"{r.us_per_decision:>7.1f} {r.us_per_placement:>7.1f} {r.us_per_held:>5.1f} "
        f"{r.placed_by_index / max(r.decisions, 1):>6.2f} {r.prefix_kept / max(r.decisions, 1):>5.2f} "
        f"{followed:>6.2f} {r.cached_tokens / max(r.prompt_tokens, 1):>6.2f} "
        f"{r.busiest_share:>5.2f} {r.sim_wall_s:>6.1f}"
    )


LEGEND = """\
blocks: index entries at the end; B/block: index bytes per entry; µs/store: CPU per BlockStored batch
(decode and apply); µs/blk+ per block stored; µs/blk-: per block removed (one BlockRemoved each);
µs/dec: CPU per routing decision = place (PrefixAffinity over every PD) + held (the consumer's
images); by idx: share placed by the index; kept: share of requests whose last step's PD still held
their whole prompt; follow: of those, share sent back there; cached: prompt tokens from cache;
top: the busiest PD's share of the requests."""


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_proxy_tools.bench.kv_sim", description=__doc__.split("\n")[0])
    parser.add_argument("--pds", type=_counts, default=[4, 16, 64], help="PD counts to simulate (comma list)")
    parser.add_argument("--sessions", type=_counts, default=[10_000], help="live sessions (comma list)")
    parser.add_argument("--blocks-per-pd", type=int, default=Settings.blocks_per_pd, help="KV blocks per PD")
    parser.add_argument("--requests", type=int, default=Settings.requests, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: fill every PD)")
    parser.add_argument(
        "--max-index-blocks",
        type=int,
        default=Settings.max_index_blocks,
        help="the index's cap (--kv-index-max-blocks)",
    )
    parser.add_argument("--shared-first-screenshots", type=int, default=SHARED_FIRST_SCREENSHOTS)
    parser.add_argument(
        "--in-flight-per-pd", type=int, default=Settings.in_flight_per_pd, help="requests in flight per PD (load)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracemalloc", action="store_true", help="also trace the index's allocations (slower CPU)")
    parser.add_argument(
        "--exact", action="store_true", help="place from each prompt's blocks, as with --render-urls (the render aside)"
    )
    parser.add_argument("--json", help="write every run's figures to this file")
    args = parser.parse_args(argv)
    results = []
    print(HEADER, flush=True)
    for sessions in args.sessions:
        for pds in args.pds:
            settings = Settings(
                pds=pds,
                sessions=sessions,
                blocks_per_pd=args.blocks_per_pd,
                requests=args.requests,
                warmup=args.warmup,
                max_index_blocks=args.max_index_blocks,
                shared_first_screenshots=args.shared_first_screenshots,
                in_flight_per_pd=args.in_flight_per_pd,
                seed=args.seed,
                tracemalloc=args.tracemalloc,
                exact=args.exact,
            )
            result, _ = simulate(settings)
            results.append(result)
            print(row(result), flush=True)
            if result.traced_bytes is not None:
                print(f"     traced: {result.traced_bytes / 1e6:.1f} MB", flush=True)
    print(LEGEND)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([r.summary() for r in results], out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
