"""`epd-proxy bench --stack` / `epd-proxy bench --encode-urls ... --decode-urls ...`: proxies A/B'd
in front of the same real vLLM engines, reporting what the engines did.

Each arm is a proxy command line; the bench appends the reference's flags (`--host --port
--encode-servers-urls --decode-servers-urls`, and `--prefill-servers-urls` in E+P+D) and starts a
fresh process for every block, so no proxy carries state from one block to the next. Before every
block the engines' caches are emptied (vLLM's dev-mode reset endpoints, and the EC and KV stores
when the bench knows where they are), then the block sends its warm-up requests (other content),
then the measured conversations, the same bodies for every arm. Load levels are closed-loop
concurrencies and Poisson arrival rates; arms run interleaved (A B C, C B A, ...) at each level.

Answers are compared with a single plain vLLM instance's answers to the same bodies sent one at a
time; the same instance under the same load is an arm too ("single-instance"), which gives the
rate at which batching alone changes an answer on this hardware.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from epd_proxy.options import add_arguments, parse_into
from epd_proxy_tools.bench import chat_load, engines, procs, real_report
from epd_proxy_tools.bench.engines import BASELINE, DECODE, ENCODE, PD, PREFILL, Engine
from epd_proxy_tools.bench.flags import OUR_COMMAND, REAL_GROUPS, REAL_QUICK, RealBenchOptions
from epd_proxy_tools.bench.kv_counts import KvEventCounter, Tally
from epd_proxy_tools.bench.launch import command_words, http_get, proxy_environment, stop_process, wait_ready
from epd_proxy_tools.bench.workload import AgentSpec, ChatMixSpec, get_chats
from epd_proxy_tools.testing.harness import free_port

SINGLE = "single-instance"


@dataclass
class Arm:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # Ours run from the results folder with this checkout first on PYTHONPATH (see launch.py).
    ours: bool = False
    direct_url: str | None = None  # the single-instance arm: no proxy, straight to the baseline
    blocks: list[dict[str, Any]] = field(default_factory=list)


def parse_arm(spec: str) -> Arm:
    """`NAME=[KEY=VALUE ...] COMMAND`: leading KEY=VALUE words are the proxy's environment, so
    `ref-per-item=ENCODER_MAX_BATCH_SIZE=1 python disagg_epd_proxy.py` is one arm."""
    name, sep, rest = spec.partition("=")
    words = shlex.split(rest)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not name or not sep or not words:
        raise SystemExit(f"--proxy needs NAME=[KEY=VALUE ...] COMMAND, got {spec!r}")
    ours = words[:2] == ["epd-proxy", "serve"]
    return Arm(name, command_words(words), env, ours=ours)


def parse_variant(spec: str) -> Arm:
    """`NAME:KEY=VALUE[,KEY=VALUE]`: epd-proxy with its defaults and this environment."""
    name, _, pairs = spec.partition(":")
    env = dict(pair.partition("=")[::2] for pair in pairs.split(",") if "=" in pair)
    return Arm(name, [sys.executable, "-m", "epd_proxy", "serve"], env, ours=True)


def _floats(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


MODES = "--stack starts a local real stack; --encode-urls URLS --decode-urls URLS use a running deployment"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-proxy bench --stack | --encode-urls URLS --decode-urls URLS",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, [RealBenchOptions], REAL_GROUPS)
    return parser


def think_range(args: RealBenchOptions) -> tuple[float, float]:
    """Seconds between turns: --think-ms LO-HI, else 100-400 ms for agents (their tools run between
    steps) and none for the chat mix."""
    text = args.think_ms if args.think_ms is not None else ("100-400" if args.workload == "agent" else "0")
    lo, _, hi = text.partition("-")
    try:
        low, high = float(lo) / 1000, float(hi or lo) / 1000
    except ValueError:
        raise SystemExit(f"--think-ms takes LO-HI in milliseconds, got {text!r}") from None
    if not 0 <= low <= high:
        raise SystemExit(f"--think-ms needs 0 <= LO <= HI, got {text!r}")
    return low, high


def wants_real_mode(argv: list[str]) -> bool:
    return any(a == "--stack" or a.startswith("--encode-urls") for a in argv)


class RealBench:
    def __init__(self, args: RealBenchOptions) -> None:
        self.args = replace(args, **REAL_QUICK) if args.quick else args
        self.out: Path = args.out or Path("results") / time.strftime("real-%Y%m%d-%H%M%S")
        self.out.mkdir(parents=True, exist_ok=True)
        self.stack = None
        self.engines: list[Engine] = []
        self.stores: list[Path] = []
        self.cpus: set[int] | None = None
        self.notes: list[str] = []
        self.resets = not args.no_reset
        self.canonical: dict[tuple[int, int], chat_load.Answer] = {}
        self.think = think_range(args)
        self.cores: dict[str, str] = {}
        self.kv_counter: KvEventCounter | None = None
        # The stack's render server (--render): its URL for the arms, its process for its CPU.
        self.render_url: str | None = None
        self.render_pid: int | None = None

    # -- engines ---------------------------------------------------------------------------------
    def start_engines(self) -> None:
        a = self.args
        if a.stack:
            from epd_proxy_tools.local.stack import RENDER, LocalStack, StackConfig, assign_cores

            # The reset endpoints exist only in vLLM's dev mode; the stack's servers inherit it.
            os.environ["VLLM_SERVER_DEV_MODE"] = "1"
            config = StackConfig(
                encoders=a.encoders,
                baseline=True,
                prefill=a.prefill,
                consumers=a.pds,
                with_proxy=False,
                base_port=a.base_port,
                work_dir=a.stack_dir,
                # Four servers starting on a shared 2-core machine can take minutes.
                health_timeout=900.0,
                num_gpu_blocks_pd=a.kv_blocks,
                max_model_len=a.max_model_len,
                render=a.render,
                extra_vllm_args=a.vllm_args,
                ec_connector=a.ec_connector,
                kv_connector=a.kv_connector,
            )
            self.stack = LocalStack(config, progress_stream=sys.stderr)
            self.stack.start(tty=False)
            st = self.stack
            for line in st.kv_events_summary():
                sys.stderr.write(f"[bench] KV events: {line}\n")
            self.kv_counter = KvEventCounter(
                {name: f"tcp://{st.loopback}:{ports.events}" for name, ports in st.kv_event_ports().items()}
            )
            cores = assign_cores(a.encoders, True, sorted(os.sched_getaffinity(0)), prefill=a.prefill, consumers=a.pds)
            self.cores = cores
            self.render_url = st.render_url
            for m in st.instances:
                if m.name == RENDER:
                    self.render_pid = m.proc.pid
                    continue
                kind = m.name.split("-")[0]
                role = {"pd": PD, "prefill": PREFILL, "decode": DECODE, "baseline": BASELINE}.get(kind, ENCODE)
                self.engines.append(Engine(m.name, role, m.health_url.rsplit("/", 1)[0], m.proc.pid))
                if not a.no_pin:
                    # vLLM binds only its compute threads; its API server (media decoding and
                    # processing) would otherwise run on whichever core is free.
                    procs.pin_tree(m.proc.pid, _parse_cores(cores[m.name]))
            self.stores = st.stores()
            self.model = st.model_name
            default_cpus = _parse_cores(cores["encoder-0"])
        else:
            if not a.encode_urls or not a.decode_urls:
                raise SystemExit("give --stack, or --encode-urls and --decode-urls of a running deployment")
            split = [u.strip().rstrip("/") for u in a.encode_urls.split(",") if u.strip()]
            self.engines += [Engine(f"encoder-{i}", ENCODE, u) for i, u in enumerate(split)]
            decoders = [u.strip().rstrip("/") for u in a.decode_urls.split(",") if u.strip()]
            prefills = [u.strip().rstrip("/") for u in a.prefill_urls.split(",") if u.strip()]
            role = DECODE if prefills else PD
            self.engines += [Engine(f"{role}-{i}", role, u) for i, u in enumerate(decoders)]
            self.engines += [Engine(f"prefill-{i}", PREFILL, u) for i, u in enumerate(prefills)]
            if a.baseline_url:
                self.engines.append(Engine(BASELINE, BASELINE, a.baseline_url.rstrip("/")))
            for engine in self.engines:
                engine.pid = engines.listening_pid(engine.url)
            self.stores = [a.ec_store] if a.ec_store else []
            self.model = a.model or orjson.loads(http_get(decoders[0] + "/v1/models", 30))["data"][0]["id"]
            default_cpus = None
        if not a.no_pin and hasattr(os, "sched_setaffinity"):
            self.cpus = _parse_cores(a.proxy_cpus) if a.proxy_cpus else default_cpus
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)

    def urls(self, role: str) -> list[str]:
        return [e.url for e in self.engines if e.role == role]

    @property
    def baseline(self) -> Engine | None:
        return next((e for e in self.engines if e.role == BASELINE), None)

    def reset(self) -> None:
        if not self.resets:
            return
        for engine in self.engines:
            if not engine.reset_caches():
                self.resets = False
                self.notes.append(
                    f"{engine.name} has no cache reset endpoints (start vLLM with VLLM_SERVER_DEV_MODE=1): "
                    "engine caches carry over from block to block"
                )
                return
        for store in self.stores:
            # The engines are idle between blocks; what an earlier block saved must not be loaded.
            for child in Path(store).iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink(missing_ok=True)

    # -- arms ------------------------------------------------------------------------------------
    def build_arms(self) -> list[Arm]:
        a = self.args
        arms = [parse_arm(s) for s in a.proxy] + [parse_variant(s) for s in a.variant]
        if not arms:
            arms = [parse_arm(f"epd-proxy={OUR_COMMAND}")]
        if self.baseline and not a.no_single_instance:
            arms.append(Arm(SINGLE, [], direct_url=self.baseline.url))
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise SystemExit(f"arm names must differ: {', '.join(names)}")
        return arms

    def start_proxy(self, arm: Arm, log_name: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        words = [w.replace("{render}", self.render_url) for w in arm.command] if self.render_url else arm.command
        cmd = [*words, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--encode-servers-urls", ",".join(self.urls(ENCODE))]
        cmd += ["--decode-servers-urls", ",".join(self.urls(DECODE) or self.urls(PD))]
        if self.urls(PREFILL):
            cmd += ["--prefill-servers-urls", ",".join(self.urls(PREFILL))]
        if self.stack is not None and (zmq := self.stack.ec_consumer_zmq_addrs()):
            # Mooncake: where the encoders push for each PD, as every arm (the reference too) is told.
            cmd += ["--ec-consumer-zmq-addrs", ",".join(zmq)]
        env = proxy_environment(arm.ours, own=arm.env)
        cwd = self.out if arm.ours else None
        cpus = self.cpus
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(self.out / f"proxy-{log_name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, preexec_fn=preexec)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/v1/models", proc)
        return proc, url

    # -- a consumer restarted mid-block ------------------------------------------------------------
    def restart_target(self) -> str | None:
        a = self.args
        if a.restart_after is None:
            return None
        if self.stack is None:
            raise SystemExit("--restart-after needs --stack: the bench restarts an instance it started")
        names = [e.name for e in self.engines if e.role in (PD, PREFILL)]
        name = a.restart_name or names[-1]
        if name not in {e.name for e in self.engines}:
            raise SystemExit(f"--restart-name {name!r} is none of the stack's instances: {', '.join(names)}")
        return name

    def restart_later(self, name: str, delay: float, block_over: threading.Event, record: dict) -> None:
        """Stop `name` `delay` seconds in (unless the block is over by then) and start it again on its
        port; `record` keeps its counters at the stop and at the start, so the block's deltas span both
        of its lives."""
        if block_over.wait(delay):
            return
        engine = next(e for e in self.engines if e.name == name)
        record["at_stop"] = engine.scrape()
        stopped = time.perf_counter()
        assert self.stack is not None
        self.stack.restart(name)
        record["down_s"] = time.perf_counter() - stopped
        proc = self.stack.by_name(name).proc
        engine.pid = proc.pid if proc is not None else None
        if engine.pid is not None and not self.args.no_pin and name in self.cores:
            procs.pin_tree(engine.pid, _parse_cores(self.cores[name]))
        record["at_start"] = engine.scrape()

    # -- blocks ----------------------------------------------------------------------------------
    def drive(self, url: str, conversations: list[list[bytes]], level: tuple[str, float]) -> list[chat_load.Result]:
        kind, value = level
        think = self.think
        if kind == "rate":
            return chat_load.run(
                url + "/v1/chat/completions", conversations, rate=value, seed=self.args.seed, think=think
            )
        return chat_load.run(url + "/v1/chat/completions", conversations, concurrency=int(value), think=think)

    def run_block(self, arm: Arm, level: tuple[str, float], round_no: int, measured, warmup) -> dict[str, Any]:
        self.reset()
        proc = None
        if arm.direct_url:
            url = arm.direct_url
        else:
            proc, url = self.start_proxy(arm, arm.name)
        try:
            if warmup:
                self.drive(url, warmup, ("concurrency", max(1, min(len(warmup), _closed(level)))))
            before = engines.settled(self.engines)
            kv_before = self.kv_counter.snapshot() if self.kv_counter else {}
            proxy_before = procs.tree_cpu_split(proc.pid) if proc else (0.0, 0.0)
            render_before = procs.tree_cpu_split(self.render_pid) if self.render_pid else (0.0, 0.0)
            harness_before = _own_cpu()
            cores_before = procs.core_busy()
            block_over, restarted = threading.Event(), {}
            # Measured blocks only: the engines' first-request blocks (round -1) stay whole.
            target = self.restart_target() if proc is not None and round_no >= 0 else None
            restarter = None
            if target is not None:
                delay = float(self.args.restart_after or 0.0)
                restarter = threading.Thread(
                    target=self.restart_later, args=(target, delay, block_over, restarted), daemon=True
                )
                restarter.start()
            started = time.perf_counter()
            results = self.drive(url, measured, level)
            wall = time.perf_counter() - started
            block_over.set()
            if restarter is not None:
                # The next block starts on a whole fleet; a restart still under way is waited for.
                restarter.join()
            harness = _own_cpu() - harness_before
            cores_after = procs.core_busy()
            proxy_after = procs.tree_cpu_split(proc.pid) if proc else (0.0, 0.0)
            render_after = procs.tree_cpu_split(self.render_pid) if self.render_pid else (0.0, 0.0)
            after = engines.settled(self.engines)
            kv_after = self.kv_counter.snapshot() if self.kv_counter else {}
            if arm.ours:
                # What the scheduler saw by the block's end, to tell a bad round's cause afterwards.
                status = self.out / f"status-{arm.name}-{level[0]}{level[1]:g}-round{round_no}.json"
                status.write_bytes(http_get(url + "/status.json"))
                # Its own counters too: what placed each request and why (epd_prefix_decisions_total).
                status.with_name(status.name.replace("status-", "metrics-")).with_suffix(".txt").write_bytes(
                    http_get(url + "/metrics")
                )
        finally:
            if proc is not None:
                stop_process(proc)
        deltas = {name: engines.delta(before[name], after[name]) for name in after}
        if "at_stop" in restarted:
            # Counters start from zero in the new process: its life before the stop plus its life since.
            old = engines.delta(before[target], restarted["at_stop"])
            new = engines.delta(restarted["at_start"], after[target])
            deltas[target] = {key: old.get(key, 0.0) + new[key] for key in new}
        # The single instance publishes no events: the consumers' counts are not its own.
        kv = {} if arm.direct_url else {n: kv_after[n].minus(kv_before.get(n, Tally())) for n in kv_after}
        # The single-instance arm's engine figures are the baseline's own.
        arm_engines = [e for e in self.engines if (e.role == BASELINE) == bool(arm.direct_url)]
        if arm.direct_url:
            arm_engines = [Engine(e.name, PD, e.url, e.pid) for e in arm_engines]
        ok = [r for r in results if r.ok]
        sent = sum(map(len, measured))
        # Busy time on this machine that none of our processes explain: other tenants.
        busy = sum(cores_after[c][0] - cores_before[c][0] for c in cores_after)
        ours = harness + sum(proxy_after) - sum(proxy_before)
        ours += sum(d.get("cpu_s", 0.0) for d in deltas.values()) + sum(render_after) - sum(render_before)
        local = all(e.pid is not None for e in self.engines)
        block = {
            "level": list(level),
            "round": round_no,
            "requests": sent,
            "answered": len(ok),
            "failed": sent - len(ok),
            # Answered with an error; the rest of `failed` were never sent, as a client whose turn
            # failed ends its conversation.
            "errored": len(results) - len(ok),
            "errors": sorted({r.error or f"HTTP {r.status}" for r in results if not r.ok})[:5],
            "wall_s": wall,
            "req_per_s": len(ok) / wall if wall else 0.0,
            "latency_s": [r.latency for r in ok],
            "ttft_s": [r.ttft for r in ok if r.ttft is not None],
            "proxy_cpu_ms_per_request": 1000 * sum(proxy_after) - 1000 * sum(proxy_before),
            "render_cpu_ms_per_request": 1000 * sum(render_after) - 1000 * sum(render_before),
            "harness_core_share": harness / wall if wall else 0.0,
            # In cores' worth; only known when every engine runs here.
            "other_load_cores": max(0.0, busy - ours) / wall if local and wall else None,
            "engines": engines.summarise(arm_engines, {e.name: deltas[e.name] for e in arm_engines}, len(ok)),
            # Each engine's own counter deltas, for checking the figures above.
            "engine_deltas": {name: {k: v for k, v in d.items() if v} for name, d in deltas.items()},
            "kv_blocks_stored": sum(t.stored for t in kv.values()) if kv else None,
            "kv_blocks_removed": sum(t.removed for t in kv.values()) if kv else None,
            "restart": {"instance": target, "down_s": restarted.get("down_s")} if "at_stop" in restarted else None,
        }
        stored = block["kv_blocks_stored"]
        block["eviction_rate"] = block["kv_blocks_removed"] / stored if stored else None
        block["kv_blocks_removed_per_request"] = block["kv_blocks_removed"] / len(ok) if kv and ok else None
        block["proxy_cpu_ms_per_request"] /= max(1, len(ok))
        block["render_cpu_ms_per_request"] /= max(1, len(ok))
        if self.canonical:
            same = sum(1 for r in ok if self.canonical.get((r.conversation, r.turn)) == r.answer)
            block["exact"] = same
            # Which turns differ, to tell batching's changes from a routing fault afterwards.
            block["differing"] = sorted(
                [r.conversation, r.turn] for r in ok if self.canonical.get((r.conversation, r.turn)) != r.answer
            )
            block["exact_rate"] = same / sent if sent else None
        return block

    def answers_one_at_a_time(self, measured: list[list[bytes]]) -> None:
        if self.baseline is None:
            self.notes.append("no baseline instance: answers are not checked")
            return
        self.reset()
        results = chat_load.run(self.baseline.url + "/v1/chat/completions", measured, concurrency=1)
        self.canonical = {(r.conversation, r.turn): r.answer for r in results if r.ok}
        missing = sum(map(len, measured)) - len(self.canonical)
        if missing:
            self.notes.append(f"the baseline did not answer {missing} request(s) sent one at a time")

    def run(self) -> dict[str, Any]:
        a = self.args
        levels = [("concurrency", c) for c in _floats(a.concurrency)] + [("rate", r) for r in _floats(a.rate)]
        if not levels:
            raise SystemExit("give at least one --concurrency or --rate level")
        self.start_engines()
        try:
            if a.workload == "agent":
                spec = AgentSpec(
                    seed=a.seed,
                    conversations=a.conversations,
                    model=self.model,
                    steps=a.steps,
                    preamble_chars=a.preamble_chars,
                    shared_screens=a.shared_screens,
                )
            else:
                spec = ChatMixSpec(
                    seed=a.seed,
                    conversations=a.conversations,
                    multi_turn_share=a.multi_turn_share,
                    popular_share=a.popular_share,
                    max_images=a.max_images,
                    model=self.model,
                )
            mix = get_chats(spec, a.cache_dir)
            warm = get_chats(
                type(spec)(**{**spec.__dict__, "seed": a.seed + 7919, "conversations": max(1, a.warmup)}),
                a.cache_dir,
            )
            measured, warmup = mix.conversations, warm.conversations if a.warmup else []
            arms = self.build_arms()
            self.answers_one_at_a_time(measured)
            # The engines' first requests after start are slow (allocation, first-use paths).
            for arm in arms:
                self.run_block(arm, ("concurrency", 1), -1, warmup or measured[:1], [])
            for level in levels:
                for round_no in range(a.rounds):
                    order = arms if round_no % 2 == 0 else arms[::-1]
                    for arm in order:
                        block = self.run_block(arm, level, round_no, measured, warmup)
                        arm.blocks.append(block)
                        _progress(arm, block)
            result = real_report.build(self, arms, levels, mix)
            real_report.write(self.out, result, chart=not a.no_chart)
            return result
        finally:
            if self.kv_counter is not None:
                self.kv_counter.close()
            if self.stack is not None:
                self.stack.stop()


def _closed(level: tuple[str, float]) -> int:
    return int(level[1]) if level[0] == "concurrency" else 4


def _parse_cores(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _progress(arm: Arm, block: dict[str, Any]) -> None:
    kind, value = block["level"]
    sys.stderr.write(
        f"[bench] {kind} {value:g} round {block['round']} {arm.name}: {block['req_per_s']:.2f} req/s, "
        f"{block['failed']} failed, E sub-requests/request "
        f"{block['engines'].get('encoder_subrequests_per_request', 0):.2f}\n"
    )


def main(argv: list[str]) -> int:
    (options,) = parse_into(build_parser(), argv, [RealBenchOptions], {})
    bench = RealBench(options)
    if options.workload == "tenants":
        from epd_proxy_tools.bench.tenant_bench import run_real

        return run_real(bench)
    result = bench.run()
    print(result["table_md"])
    print(f"results: {bench.out}")
    return 1 if result["flagged"] else 0
