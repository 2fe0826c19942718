"""`python -m epd_proxy_tools.bench`: start fakes and proxies, drive interleaved arms, write results.

Layout on a 2-core machine: every proxy is pinned to core 0 and everything else (this process,
the fake backends, the load generators) to core 1, so proxy CPU is never shared with the harness
and the harness's own load is visible as core 1's busy share.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from epd_proxy.options import add_arguments, parse_into
from epd_proxy_tools.bench import procs, real, report
from epd_proxy_tools.bench.flags import PRESETS, FakeBenchOptions
from epd_proxy_tools.bench.launch import command_words, http_get, proxy_environment, wait_ready
from epd_proxy_tools.bench.loadgen import Block, ClientPool
from epd_proxy_tools.bench.workload import API_PATHS, WorkloadSpec, get_pool
from epd_proxy_tools.testing.harness import free_port

COST, FREE = "cost", "free"


@dataclass
class Arm:
    name: str
    kind: str  # "proxy" | "direct"
    cluster: str = COST
    batch: int = 0
    workers: int = 1
    note: str = ""
    skipped: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Another proxy's command line (`--proxy`); empty for ours.
    command: list[str] = field(default_factory=list)
    port: int = 0
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = None
    blocks: list[dict[str, Any]] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    # One request in flight: no queueing anywhere, so differences between arms are path costs.
    unloaded_ms: list[float] = field(default_factory=list)
    unloaded_free_ms: list[float] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    """Against fakes; the real-engine mode's options (real.py) follow in the epilog, as
    `bench --help` is where a reader looks for them."""
    parser = argparse.ArgumentParser(
        prog="epd-proxy bench",
        description=__doc__,
        epilog=f"real-engine mode ({real.MODES}):\n\n{real.build_parser().format_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, [FakeBenchOptions])
    return parser


def parse_args(argv: list[str] | None) -> FakeBenchOptions:
    (parsed,) = parse_into(build_parser(), argv, [FakeBenchOptions], {})
    return parsed


def encoder_speeds(args: FakeBenchOptions) -> list[float]:
    """--encoder-speeds as one cost multiplier per costed fake encoder."""
    if args.encoder_speeds is None:
        return [1.0] * args.encoders
    try:
        speeds = [float(x) for x in args.encoder_speeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--encoder-speeds takes numbers, got {args.encoder_speeds!r}") from None
    if len(speeds) != args.encoders or any(x <= 0 for x in speeds):
        raise SystemExit(f"--encoder-speeds needs {args.encoders} positive numbers (one per --encoders)")
    return speeds


def _cpus(spec: str) -> set[int]:
    return {int(c) for c in spec.split(",") if c.strip()}


def proxy_supports_workers() -> bool:
    out = subprocess.run([sys.executable, "-m", "epd_proxy", "serve", "--help"], capture_output=True, text=True)
    return "--workers" in out.stdout


def json_floor(bodies: list[bytes], repeat: int) -> dict[str, float]:
    """What a proxy must spend per request at the very least: parse the body once and write it
    once (orjson), plus name every image (sha256 of its URL, the reference's content uuid; blake3
    for `--media-hash blake3`). Beside it, what epd-proxy's splice spends to read the same body
    (lift the media, check them, parse the skeleton) and, where msgspec is installed, what
    decoding it with the URLs as `msgspec.Raw` spans would (the alternative splice was chosen over)."""
    import hashlib

    import blake3

    from epd_proxy.journey.splice import lift

    def per_request_ms(work) -> float:
        start = time.process_time()
        for _ in range(repeat):
            for body in bodies:
                work(body)
        return (time.process_time() - start) * 1000 / (repeat * len(bodies))

    url_lists = {
        id(body): [
            p["image_url"]["url"].encode()
            for m in orjson.loads(body)["messages"]
            for p in m["content"]
            if p.get("type") == "image_url"
        ]
        for body in bodies
    }

    def splice_read(body: bytes) -> None:
        lifted = lift(body)
        orjson.loads(lifted[0] if lifted else body)

    floor = {
        "json_loads_dumps_ms_per_request": per_request_ms(lambda body: orjson.dumps(orjson.loads(body))),
        "sha256_urls_ms_per_request": per_request_ms(
            lambda body: [hashlib.sha256(url).hexdigest() for url in url_lists[id(body)]]
        ),
        "blake3_urls_ms_per_request": per_request_ms(
            lambda body: [blake3.blake3(url).hexdigest() for url in url_lists[id(body)]]
        ),
        "splice_read_ms_per_request": per_request_ms(splice_read),
        "mean_body_kb": sum(map(len, bodies)) / len(bodies) / 1024,
    }
    raw_decoder = _msgspec_raw_decoder()
    if raw_decoder is not None:
        floor["msgspec_raw_decode_ms_per_request"] = per_request_ms(raw_decoder.decode)
    return floor


def _msgspec_raw_decoder():
    """A msgspec decoder for chat bodies that keeps every image URL as a `msgspec.Raw` span of the
    input, or None without msgspec (it is not a dependency of the proxy)."""
    try:
        import msgspec
    except ImportError:
        return None

    # defstruct, not class statements: this module's postponed annotations would leave msgspec
    # strings to resolve in a scope it cannot see.
    image_url = msgspec.defstruct("ImageURL", [("url", msgspec.Raw)])
    part = msgspec.defstruct(
        "Part", [("type", str | None, None), ("text", str | None, None), ("image_url", image_url | None, None)]
    )
    message = msgspec.defstruct("Message", [("role", str), ("content", str | list[part])])
    body = msgspec.defstruct("Body", [("messages", list[message])])
    return msgspec.json.Decoder(body)


class Bench:
    def __init__(self, args: FakeBenchOptions) -> None:
        self.args = args
        preset = PRESETS["quick" if args.quick else "full"]
        self.pool_size = args.pool_size or preset.pool_size
        self.concurrency = args.concurrency or preset.concurrency
        self.requests = args.requests or preset.requests
        self.rounds = args.rounds or preset.rounds
        self.warmup = preset.warmup if args.warmup is None else args.warmup
        self.unloaded_requests = preset.unloaded_requests if args.unloaded_requests is None else args.unloaded_requests
        self.preset = "quick" if args.quick else "full"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out: Path = args.out or Path("results") / f"bench-{stamp}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.children: list[subprocess.Popen] = []
        self.fake_ports: dict[str, int] = {}
        self.fakes: subprocess.Popen | None = None
        self.clients: ClientPool | None = None
        self.pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity")
        self.notes: list[str] = []
        self.profile: subprocess.Popen | None = None

    # -- processes -------------------------------------------------------------------------------
    def start_fakes(self) -> None:
        a = self.args
        servers = []
        speeds = encoder_speeds(a)
        for cluster, enc_ms, img_ms, pd_ms in ((COST, a.encoder_ms, a.encoder_image_ms, a.pd_ms), (FREE, 0, 0, 0)):
            for i in range(a.encoders):
                server = {"name": f"{cluster}-e{i}", "role": "encode", "request_ms": enc_ms, "image_ms": img_ms}
                if cluster == COST:
                    server["slowdown"] = speeds[i]
                    server["repeat_factor"] = a.encoder_repeat_factor
                    server["cache_items"] = a.encoder_cache_items
                servers.append(server)
            servers.append({"name": f"{cluster}-pd", "role": "pd", "answer_ms": pd_ms})
        self.fakes = subprocess.Popen(
            [sys.executable, "-m", "epd_proxy_tools.testing.fake_vllm", orjson.dumps({"servers": servers})],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.children.append(self.fakes)
        import select

        ready, _, _ = select.select([self.fakes.stdout], [], [], 60)
        line = self.fakes.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError("fake backends failed to start")
        self.fake_ports = orjson.loads(line)["ports"]

    def fake_names(self, cluster: str) -> tuple[list[str], str]:
        return [f"{cluster}-e{i}" for i in range(self.args.encoders)], f"{cluster}-pd"

    def start_proxy(self, arm: Arm) -> None:
        encoders, pd = self.fake_names(arm.cluster)
        arm.port = free_port()
        # The reference's command line, which ours accepts too.
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            str(arm.port),
            "--encode-servers-urls",
            ",".join(f"http://127.0.0.1:{self.fake_ports[e]}" for e in encoders),
            "--decode-servers-urls",
            f"http://127.0.0.1:{self.fake_ports[pd]}",
        ]
        if arm.command:
            cmd = [*arm.command, *common]
        else:
            cmd = [sys.executable, "-m", "epd_proxy", "serve", *common]
            cmd += ["--encoder-max-batch-size", str(arm.batch), "--log-level", "WARNING"]
        if arm.workers > 1:
            cmd += ["--workers", str(arm.workers)]
        cpus = _cpus(self.args.proxy_cpus)
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if self.pin else None
        ours = not arm.command
        env = proxy_environment(ours, self.args.proxy_env, arm.env)
        cwd = self.out if ours else None
        with open(self.out / f"proxy-{arm.name}.log", "wb") as log:
            arm.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec, env=env, cwd=cwd)
        self.children.append(arm.proc)
        wait_ready(f"http://127.0.0.1:{arm.port}/v1/models", arm.proc)

    def stats(self, cluster: str) -> dict[str, dict]:
        encoders, pd = self.fake_names(cluster)
        return {
            name: orjson.loads(http_get(f"http://127.0.0.1:{self.fake_ports[name]}/stats")) for name in (*encoders, pd)
        }

    # -- arms ------------------------------------------------------------------------------------
    def build_arms(self) -> list[Arm]:
        wanted = [a.strip() for a in self.args.arms.split(",") if a.strip()]
        arms = []
        for name in wanted:
            if name == "batched":
                arms.append(Arm("batched", "proxy", COST, batch=0, note="--encoder-max-batch-size 0"))
            elif name == "per-item":
                arms.append(Arm("per-item", "proxy", COST, batch=1, note="--encoder-max-batch-size 1"))
            elif name == "direct":
                arms.append(Arm("direct", "direct", COST, note="client -> PD fake, no proxy, no encoders"))
            elif name == "saturation":
                arms.append(Arm("saturation", "proxy", FREE, batch=0, note="batched, fake costs 0: proxy-bound"))
            elif name == "workers":
                arm = Arm(
                    f"workers-{self.args.workers}",
                    "proxy",
                    FREE,
                    batch=0,
                    workers=self.args.workers,
                    note=f"batched, fake costs 0, --workers {self.args.workers}",
                )
                if not proxy_supports_workers():
                    arm.skipped = "`epd-proxy serve --help` has no --workers flag"
                elif self.pin and len(_cpus(self.args.proxy_cpus)) < 2:
                    arm.note += f" (all workers share core(s) {self.args.proxy_cpus})"
                arms.append(arm)
            else:
                raise SystemExit(f"unknown arm {name!r}")
        like = {"saturation": (FREE, 0), "batched": (COST, 0), "per-item": (COST, 1)}
        for spec in self.args.variant:
            name, _, pairs = spec.partition(":")
            name, _, base = name.partition("@")
            base = base or "saturation"
            if base not in like:
                raise SystemExit(f"--variant {spec!r}: can be like {', '.join(like)}, not {base!r}")
            cluster, batch = like[base]
            env = dict(pair.partition("=")[::2] for pair in pairs.split(",") if "=" in pair)
            if env.get("PYTHONPATH"):
                # Our proxies run from the results folder: a relative tree would silently miss
                # and leave the variant running this checkout.
                env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in env["PYTHONPATH"].split(os.pathsep))
            arms.append(Arm(name, "proxy", cluster, batch=batch, env=env, note=f"like {base}, env {pairs}"))
        for spec in self.args.proxy:
            name, _, command = spec.partition("=")
            name, _, base = name.partition("@")
            if not name or not command.strip():
                raise SystemExit(f"--proxy needs NAME=COMMAND, got {spec!r}")
            cluster = FREE if base == "saturation" else COST
            arms.append(
                Arm(
                    name,
                    "proxy",
                    cluster,
                    batch=0,
                    env={"ENCODER_MAX_BATCH_SIZE": "0"},
                    command=command_words(shlex.split(command)),
                    note=f"`{command}`" + (", fake costs 0" if cluster == FREE else ""),
                )
            )
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise SystemExit(f"arm names must differ (each is a row of the report): {', '.join(twice)} used twice")
        return arms

    def schedule(self, round_no: int, arm_no: int) -> list[tuple[int, str]]:
        n = self.pool_size
        # Every arm sends the same measured bodies in a round; rounds walk on through the pool.
        offset = (round_no * self.requests) % n
        measured = [((offset + i) % n, f"m{round_no}.{arm_no}-{i}") for i in range(self.requests)]
        warm = [((offset + n // 2 + i) % n, f"w{round_no}.{arm_no}-{i}") for i in range(self.warmup)]
        cool = [((offset + i) % n, f"c{round_no}.{arm_no}-{i}") for i in range(self.concurrency)]
        return warm + measured + cool

    def run_unloaded(self, arm: Arm, round_no: int, arm_no: int) -> None:
        """Latency with one request in flight. Tag "u" keeps these out of the fakes' measured counts."""
        n = self.pool_size
        offset = (round_no * self.unloaded_requests) % n
        schedule = [((offset + n // 2) % n, f"w{round_no}.{arm_no}-u")]
        schedule += [((offset + i) % n, f"u{round_no}.{arm_no}-{i}") for i in range(self.unloaded_requests)]
        targets = (
            [(arm.port, arm.unloaded_ms)]
            if arm.kind == "proxy"
            else [
                (self.fake_ports[self.fake_names(COST)[1]], arm.unloaded_ms),
                # The zero-cost PD is the floor for the zero-cost proxy arms: their difference is the proxy alone.
                (self.fake_ports[self.fake_names(FREE)[1]], arm.unloaded_free_ms),
            ]
        )
        for port, sink in targets:
            results = self.clients.run(
                Block("127.0.0.1", port, API_PATHS[self.args.api], 1, schedule, stream=self.args.stream)
            )
            sink.extend((r[2] - r[1]) * 1000 for r in results if r[0].startswith("u") and r[3] == 200)
            errors = sum(1 for r in results if r[3] != 200)
            if errors:
                self.notes.append(f"{arm.name} unloaded round {round_no}: {errors} non-200 answers")

    def run_block(self, arm: Arm, round_no: int, arm_no: int) -> None:
        schedule = self.schedule(round_no, arm_no)
        target_port = arm.port if arm.kind == "proxy" else self.fake_ports[self.fake_names(arm.cluster)[1]]
        before_stats = self.stats(arm.cluster)
        proxy_pid = arm.proc.pid if arm.proc else None
        user0, sys0 = procs.tree_cpu_split(proxy_pid) if proxy_pid else (0.0, 0.0)
        gen0 = sum(procs.cpu_seconds(p) for p in self.clients.pids)
        fake0 = procs.cpu_seconds(self.fakes.pid)
        self0 = procs.cpu_seconds(os.getpid())
        cores0 = procs.core_busy()
        wall0 = time.perf_counter()
        block = Block(
            "127.0.0.1", target_port, API_PATHS[self.args.api], self.concurrency, schedule, stream=self.args.stream
        )
        # RSS while the block runs (the peak alone mostly shows the first burst of parsing).
        rss_samples: list[float] = []
        sampling = threading.Event()

        def sample_rss() -> None:
            while not sampling.wait(0.25):
                rss_samples.append(procs.rss_mb(proxy_pid))

        sampler = threading.Thread(target=sample_rss, daemon=True) if proxy_pid else None
        if sampler is not None:
            sampler.start()
        try:
            results = self.clients.run(block)
        finally:
            sampling.set()
            if sampler is not None:
                sampler.join()
        wall = time.perf_counter() - wall0
        cores1 = procs.core_busy()
        user1, sys1 = procs.tree_cpu_split(proxy_pid) if proxy_pid else (0.0, 0.0)
        cpu = (user1 - user0) + (sys1 - sys0)
        gen = sum(procs.cpu_seconds(p) for p in self.clients.pids) - gen0
        fake = procs.cpu_seconds(self.fakes.pid) - fake0
        own = procs.cpu_seconds(os.getpid()) - self0
        after_stats = self.stats(arm.cluster)
        measured = [r for r in results if r[0].startswith("m")]
        ok = [r for r in measured if r[3] == 200]
        window = max(r[2] for r in measured) - min(r[1] for r in measured)
        arm.latencies_ms.extend((r[2] - r[1]) * 1000 for r in ok)
        encoders, pd = self.fake_names(arm.cluster)

        def delta(name: str, key: str, tag: str = "m") -> int:
            return after_stats[name][key].get(tag, 0) - before_stats[name][key].get(tag, 0)

        def moved(name: str, key: str) -> int:
            """A counter the fake keeps for every phase at once."""
            return after_stats[name][key] - before_stats[name][key]

        block = {
            "round": round_no,
            "measured": len(measured),
            "errors": len(measured) - len(ok),
            "all_requests": len(results),
            "all_errors": sum(1 for r in results if r[3] != 200),
            "window_s": window,
            "wall_s": wall,
            "encoder_subrequests": sum(delta(e, "requests") for e in encoders),
            "encoder_images": sum(delta(e, "images") for e in encoders),
            # Every phase's (the cache does not know them apart): hits over items encoded.
            "encoder_cache_hits": sum(moved(e, "cache_hits") for e in encoders),
            "encoder_cache_lookups": sum(moved(e, "cache_hits") + moved(e, "cache_misses") for e in encoders),
            "pd_requests": delta(pd, "requests"),
            "proxy_rss_samples_mb": rss_samples,
            "pd_embeds": delta(pd, "images"),
            "pd_raw_images": delta(pd, "raw_images"),
            "pd_bytes": delta(pd, "bytes_in"),
            "proxy_cpu_s": cpu,
            "proxy_sys_s": sys1 - sys0,
            "loadgen_cpu_s": gen,
            "fakes_cpu_s": fake,
            "harness_cpu_s": gen + fake + own,
            "core_busy": {c: (cores1[c][0] - cores0[c][0]) / max(1e-9, cores1[c][1] - cores0[c][1]) for c in cores1},
        }
        if self.pin:
            # Busy time on a core set that none of our processes explains: other tenants, kernel work.
            # Large values mean the run was disturbed and its numbers deserve less trust.
            busy = block["core_busy"]
            proxy_cpus, harness_cpus = _cpus(self.args.proxy_cpus), _cpus(self.args.harness_cpus)
            block["other_load"] = {
                "proxy_cores": sum(busy.get(c, 0) for c in proxy_cpus) - cpu / wall,
                "harness_cores": sum(busy.get(c, 0) for c in harness_cpus) - (gen + fake + own) / wall,
            }
        arm.blocks.append(block)
        if block["all_errors"]:
            self.notes.append(f"{arm.name} round {round_no}: {block['all_errors']} non-200 answers")

    # -- profiling -------------------------------------------------------------------------------
    def start_profile(self, arm: Arm) -> None:
        import shutil

        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            self.notes.append("--profile-arm: py-spy not found (pip install py-spy)")
            return
        self.profile_raw = self.out / f"profile-{arm.name}.txt"
        cmd = [
            exe,
            "record",
            "--pid",
            str(arm.proc.pid),
            "--rate",
            "200",
            "--subprocesses",
            "--format",
            "raw",
            "--output",
            str(self.profile_raw),
        ]
        # --native must pause the process to unwind C stacks; plain sampling need not.
        cmd.append("--native" if self.args.profile_native else "--nonblocking")
        with open(self.out / "py-spy.log", "wb") as log:
            self.profile = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)

    def stop_profile(self) -> None:
        import signal

        if self.profile is None:
            return
        self.profile.send_signal(signal.SIGINT)
        try:
            self.profile.wait(30)
        except subprocess.TimeoutExpired:
            self.profile.kill()
        if self.profile_raw.exists():
            (self.out / "profile-top.md").write_text(report.summarise_profile(self.profile_raw))

    # -- main ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        if self.pin:
            os.sched_setaffinity(0, _cpus(a.harness_cpus))
        t0 = time.perf_counter()
        spec = WorkloadSpec(seed=a.seed, requests=self.pool_size)
        pool = get_pool(spec, a.cache_dir, a.api)
        self.pool_size = len(pool.bodies)
        pool_paths = {"main": str(pool.path)}
        print(
            f"workload: {len(pool.bodies)} bodies, {pool.mean_images:.2f} images/request, "
            f"{sum(pool.image_bytes) / len(pool.image_bytes) / 1024:.0f} KB/image, "
            f"{sum(map(len, pool.bodies)) / len(pool.bodies) / 1024:.0f} KB/body "
            f"(ready in {time.perf_counter() - t0:.1f} s; {pool.path})",
            flush=True,
        )
        # The floor is the chat body's: the least any door's proxy must spend on the same request.
        chat_bodies = pool.bodies if a.api == "chat" else get_pool(spec, a.cache_dir).bodies
        floor = json_floor(chat_bodies, repeat=3 if a.quick else 10)
        arms = self.build_arms()
        active = [arm for arm in arms if arm.skipped is None]
        for arm in arms:
            if arm.skipped:
                print(f"arm {arm.name}: SKIPPED ({arm.skipped})", flush=True)
        try:
            self.start_fakes()
            for arm in active:
                if arm.kind == "proxy":
                    self.start_proxy(arm)
            self.clients = ClientPool(a.clients, pool_paths)
            profiled = next((arm for arm in active if arm.name == a.profile_arm), None)
            if a.profile_arm and profiled is None:
                self.notes.append(f"--profile-arm {a.profile_arm}: no such active proxy arm")
            if profiled is not None and profiled.proc is not None:
                self.start_profile(profiled)
            for r in range(self.rounds):
                # A B C then C B A: a drift over the run hits every arm about equally.
                order = list(enumerate(active)) if r % 2 == 0 else list(reversed(list(enumerate(active))))
                for i, arm in order:
                    self.run_block(arm, r, i)
                    b = arm.blocks[-1]
                    other = b.get("other_load")
                    disturbed = (
                        (
                            f", other load on proxy/harness cores {100 * other['proxy_cores']:.0f}%/"
                            f"{100 * other['harness_cores']:.0f}%"
                        )
                        if other
                        else ""
                    )
                    print(
                        f"round {r + 1}/{self.rounds} {arm.name:>12}: {b['measured'] / b['window_s']:8.1f} req/s, "
                        f"errors {b['errors']}{disturbed}",
                        flush=True,
                    )
                if self.unloaded_requests > 0:
                    for i, arm in order:
                        self.run_unloaded(arm, r, i)
            self.stop_profile()
            peak = {arm.name: procs.peak_rss_mb(arm.proc.pid) for arm in active if arm.proc}
        finally:
            self.shutdown()
        result = report.build(self, arms, floor, peak, pool)
        report.write(self.out, result, arms, chart=not a.no_chart)
        return result

    def shutdown(self) -> None:
        if self.profile is not None and self.profile.poll() is None:
            self.profile.kill()
        if self.clients is not None:
            self.clients.close()
        for proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.children):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if real.wants_real_mode(argv):
        return real.main(argv)
    args = parse_args(argv)
    if args.workload == "tenants":
        from epd_proxy_tools.bench.tenant_bench import run_fakes

        return run_fakes(args)
    bench = Bench(args)
    result = bench.run()
    print()
    print(result["table_md"])
    print(f"results: {bench.out}")
    return 0
