"""`epd-proxy bench --workload tenants` (fakes) and `epd-proxy bench --stack --workload tenants`
(real engines): does one tenant's flood hurt another tenant's interactive chats?

Each proxy arm runs two kinds of block per round, in a fresh proxy (and, against the fakes, fresh
fake engines, so no arm inherits another's queue): `alone`, the interactive tenant by itself, and
`flood`, the same with the flood tenant sending at `--flood-factor` times its weighted share of
the encoders' capacity; and `both`, where the interactive tenant floods too, at
`--backlogged-factor` times its share, so both are backlogged: their shares of the encoders
against their weights, and the goodput against the capacity. Our proxies get a tenants file with both tenants' key digests (the flood
tenant with `--flood-deadline-ms`); `--proxy` arms get only the keys on the requests, which a
proxy without tenants ignores. Results: `tenants.json`, `tenants.md` (tenant_report.py).
"""

from __future__ import annotations

import os
import select
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from epd_proxy_tools.bench import tenant_load, tenant_report
from epd_proxy_tools.bench.flags import FakeBenchOptions, TenantLoadOptions
from epd_proxy_tools.bench.launch import command_words, http_get, proxy_environment, stop_process, wait_ready
from epd_proxy_tools.bench.real import Arm
from epd_proxy_tools.bench.tenant_load import FLOOD, FLOOD_IMAGES, INTERACTIVE, Load, TenantSpec
from epd_proxy_tools.testing.harness import free_port

ALONE, FLOODED, BOTH = "alone", "flood", "both"
# Flood requests in flight per encoder while the capacity is measured: enough that the encoders
# never wait on the consumer (two at a time per encoder measured 26 images/s where the proxy then
# served 46 beside the flood).
CALIBRATION_IN_FLIGHT_PER_ENCODER = 4
KINDS = (ALONE, FLOODED, BOTH)
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Plan:
    """What every block of a run shares."""

    seconds: float
    warm_s: float
    rounds: int
    flood_rate: float
    capacity_rps: float
    capacity_from: str
    interactive_clients: int
    seed: int
    # The interactive tenant's own flood in `both` blocks, requests/s.
    backlog_rate: float = 0.0
    # What the capacity is in images per second: goodput is counted in images.
    capacity_images_per_s: float = 0.0


def block_seconds(options: TenantLoadOptions, quick: bool) -> float:
    return options.block_seconds or (6.0 if quick else 20.0)


def flood_rate(options: TenantLoadOptions, capacity_rps: float, tenants: tuple[TenantSpec, ...]) -> float:
    """The flood's arrivals per second: `--flood-rate`, else its weighted share of the capacity
    times `--flood-factor`."""
    if options.flood_rate:
        return options.flood_rate
    return options.flood_factor * _weight_share(tenants, FLOOD) * capacity_rps


def backlog_rate(options: TenantLoadOptions, capacity_rps: float, tenants: tuple[TenantSpec, ...]) -> float:
    """The interactive tenant's arrivals per second when it floods too (`both` blocks)."""
    return options.backlogged_factor * _weight_share(tenants, INTERACTIVE) * capacity_rps


def _weight_share(tenants: tuple[TenantSpec, ...], name: str) -> float:
    weights = {t.name: t.weight for t in tenants}
    return weights[name] / sum(weights.values())


def fake_capacity_rps(args: FakeBenchOptions, speeds: list[float]) -> float:
    """Flood requests per second the costed fake encoders sustain, one sub-request per request."""
    mean_images = sum(FLOOD_IMAGES) / 2
    cost_s = (args.encoder_ms + args.tenants_image_ms * mean_images) / 1000
    return sum(1 / (speed * cost_s) for speed in speeds) if cost_s else float("inf")


def metrics_of(base_url: str) -> dict[str, dict[str, float]]:
    """The proxy's per-tenant counters now: {metric: {"tenant/label": value}}; {} without /metrics.
    Besides the request and shed counters, any `epd_tenant_*` counter of encoder seconds or tokens
    (fair queueing's), which the report prefers to its own estimate, and the buckets of the time
    the proxy took to answer a shed ({"reason/le": count})."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = http_get(base_url + "/metrics", 5).decode()
    except OSError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == tenant_report.SHED_ANSWER_BUCKETS:
                key = f"{sample.labels['reason']}/{sample.labels['le']}"
                out.setdefault(sample.name, {})[key] = sample.value
                continue
            tenant = sample.labels.get("tenant")
            if tenant is None or not sample.name.endswith("_total"):
                continue
            wanted = sample.name in ("epd_requests_shed_total", "epd_tenant_requests_total") or (
                sample.name.startswith("epd_tenant_") and ("encoder" in sample.name or "token" in sample.name)
            )
            if wanted:
                other = [v for k, v in sorted(sample.labels.items()) if k != "tenant"]
                key = "/".join([tenant, *other])
                out.setdefault(sample.name, {})[key] = out.get(sample.name, {}).get(key, 0.0) + sample.value
    return out


def run_block(arm: Arm, kind: str, round_no: int, url: str, plan: Plan, requests, tenants) -> dict[str, Any]:
    load = Load(
        plan.seconds,
        0.0 if kind == ALONE else plan.flood_rate,
        0 if kind == BOTH else plan.interactive_clients,
        plan.backlog_rate if kind == BOTH else 0.0,
        drain_s=plan.seconds,
        seed=plan.seed + round_no,
        tenants=tenants,
    )
    flood, chats, backlog = requests
    sent = tenant_load.run(url + CHAT_PATH, load, [] if kind == ALONE else flood, chats, backlog)
    block = {"kind": kind, "round": round_no, "sent": sent, "metrics": metrics_of(url)}
    summary = tenant_report.block_line(block, plan)
    sys.stderr.write(f"[bench] round {round_no + 1} {arm.name} {kind}: {summary}\n")
    return block


def _requests(plan: Plan, model: str, tiny: bool):
    probe = Load(plan.seconds, plan.flood_rate, plan.interactive_clients)
    flood = tenant_load.requests_for(FLOOD, tenant_load.flood_count(probe), model=model, seed=plan.seed, tiny=tiny)
    chats = tenant_load.requests_for(
        INTERACTIVE, tenant_load.interactive_count(probe), model=model, seed=plan.seed, tiny=tiny
    )
    backlog = tenant_load.requests_for(
        INTERACTIVE,
        tenant_load.flood_count(probe, plan.backlog_rate),
        model=model,
        seed=plan.seed,
        tiny=tiny,
        heavy=True,
    )
    return flood, chats, backlog


def _arms(tenants_file: Path, variants: tuple[str, ...], proxies: list[Arm]) -> list[Arm]:
    ours = [sys.executable, "-m", "epd_proxy", "serve", "--tenants", str(tenants_file.resolve())]
    arms = [Arm("epd-proxy", ours, ours=True)]
    for spec in variants:
        name, _, pairs = spec.partition(":")
        name = name.partition("@")[0]
        env = dict(pair.partition("=")[::2] for pair in pairs.split(",") if "=" in pair)
        arms.append(Arm(name, ours, env, ours=True))
    arms += proxies
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise SystemExit(f"arm names must differ: {', '.join(names)}")
    return arms


def _write_tenants(out: Path, tenants: tuple[TenantSpec, ...]) -> Path:
    path = out / "tenants.toml"
    path.write_text(tenant_load.tenants_toml(tenants))
    return path


def _interleaved(arms: list[Arm], rounds: int):
    """(arm, kind, round) in the order they run: A B C, C B A; each arm's blocks one after another,
    its alone block right before its flood."""
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            for kind in KINDS:
                yield arm, kind, r


# -- against the fakes --------------------------------------------------------------------------


class FakeTenantBench:
    def __init__(self, args: FakeBenchOptions) -> None:
        from epd_proxy_tools.bench.runner import encoder_speeds

        self.args = args
        self.out: Path = args.out or Path("results") / time.strftime("tenants-%Y%m%d-%H%M%S")
        self.out.mkdir(parents=True, exist_ok=True)
        self.speeds = encoder_speeds(args)
        self.pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity")
        self.children: list[subprocess.Popen] = []

    def _cpus(self, spec: str) -> set[int]:
        return {int(c) for c in spec.split(",") if c.strip()}

    def start_fakes(self) -> tuple[subprocess.Popen, dict[str, int]]:
        a = self.args
        servers: list[dict[str, Any]] = [
            {
                "name": f"e{i}",
                "role": "encode",
                "request_ms": a.encoder_ms,
                "image_ms": a.tenants_image_ms,
                "slowdown": speed,
            }
            for i, speed in enumerate(self.speeds)
        ]
        servers.append({"name": "pd", "role": "pd", "answer_ms": a.pd_ms})
        cpus = self._cpus(a.harness_cpus)
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if self.pin else None
        proc = subprocess.Popen(
            [sys.executable, "-m", "epd_proxy_tools.testing.fake_vllm", orjson.dumps({"servers": servers})],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=preexec,
        )
        self.children.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready and proc.stdout else ""
        if not line:
            raise RuntimeError("fake backends failed to start")
        return proc, orjson.loads(line)["ports"]

    def start_proxy(self, arm: Arm, ports: dict[str, int], log_name: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        encoders = ",".join(f"http://127.0.0.1:{ports[f'e{i}']}" for i in range(len(self.speeds)))
        cmd = [*arm.command, "--host", "127.0.0.1", "--port", str(port), "--encode-servers-urls", encoders]
        cmd += ["--decode-servers-urls", f"http://127.0.0.1:{ports['pd']}"]
        env = proxy_environment(arm.ours, self.args.proxy_env, arm.env)
        cwd = None
        if arm.ours:
            cmd += ["--log-level", "WARNING"]
            cwd = self.out
        cpus = self._cpus(self.args.proxy_cpus)
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if self.pin else None
        with open(self.out / f"proxy-{log_name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, preexec_fn=preexec)
        self.children.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/v1/models", proc)
        return proc, url

    def run(self) -> dict[str, Any]:
        a = self.args
        if self.pin:
            os.sched_setaffinity(0, self._cpus(a.harness_cpus))
        tenants = tenant_load.new_tenants(a.flood_deadline_ms, a.interactive_priority)
        tenants_file = _write_tenants(self.out, tenants)
        proxies = [
            Arm(name.partition("@")[0], command_words(shlex.split(command)), {"ENCODER_MAX_BATCH_SIZE": "0"})
            for name, _, command in (spec.partition("=") for spec in a.proxy)
        ]
        arms = _arms(tenants_file, a.variant, proxies)
        cap = fake_capacity_rps(a, self.speeds)
        seconds = block_seconds(a, a.quick)
        plan = Plan(
            seconds,
            warm_s=min(2.0, seconds / 4),
            rounds=a.rounds or (1 if a.quick else 2),
            flood_rate=flood_rate(a, cap, tenants),
            capacity_rps=cap,
            capacity_from="the fake encoders' costs (one sub-request per request)",
            interactive_clients=a.interactive_clients,
            seed=a.seed,
            backlog_rate=backlog_rate(a, cap, tenants),
            capacity_images_per_s=cap * sum(FLOOD_IMAGES) / 2,
        )
        requests = _requests(plan, "bench-vlm", tiny=True)
        try:
            for arm, kind, r in _interleaved(arms, plan.rounds):
                fakes, ports = self.start_fakes()
                proxy, url = self.start_proxy(arm, ports, arm.name)
                try:
                    arm.blocks.append(run_block(arm, kind, r, url, plan, requests, tenants))
                finally:
                    stop_process(proxy)
                    stop_process(fakes)
        finally:
            for proc in self.children:
                if proc.poll() is None:
                    stop_process(proc)
        result = tenant_report.build(arms, plan, tenants, mode="fakes")
        tenant_report.write(self.out, result)
        return result


def run_fakes(args: FakeBenchOptions) -> int:
    bench = FakeTenantBench(args)
    result = bench.run()
    print(result["table_md"])
    print(f"results: {bench.out}")
    return 0


# -- against real engines ---------------------------------------------------------------------------


def run_real(bench) -> int:
    """`bench` is a real.RealBench: its engines, resets and proxy launcher."""
    from epd_proxy_tools.bench import engines as engine_metrics

    a = bench.args
    bench.start_engines()
    try:
        tenants = tenant_load.new_tenants(a.flood_deadline_ms, a.interactive_priority)
        tenants_file = _write_tenants(bench.out, tenants)
        arms = []
        for arm in bench.build_arms():
            if arm.direct_url:
                continue  # no proxy: the tenants' question is about proxies
            command = [*arm.command, "--tenants", str(tenants_file.resolve())] if arm.ours else arm.command
            arms.append(Arm(arm.name, command, arm.env, ours=arm.ours))
        seconds = block_seconds(a, a.quick)
        encoders = len(bench.urls("encode"))
        probe = Plan(seconds, 0, 1, 1.0, 1.0, "", a.interactive_clients, a.seed)
        # The fleet's capacity alone: through our proxy where it is an arm, by the tenant without a
        # deadline (none is turned away), with enough in flight to keep every engine busy.
        calibrating = next((arm for arm in arms if arm.ours), arms[0])
        in_flight = CALIBRATION_IN_FLIGHT_PER_ENCODER * encoders
        calibration = tenant_load.requests_for(FLOOD, 4 * in_flight, model=bench.model, seed=a.seed + 1, tiny=False)
        bench.reset()
        proc, url = bench.start_proxy(calibrating, "calibration")
        try:
            cap, cap_images = tenant_load.capacity(url + CHAT_PATH, tenants[1], calibration, in_flight)
        finally:
            stop_process(proc)
        plan = Plan(
            seconds,
            warm_s=min(5.0, seconds / 4),
            rounds=a.rounds,
            flood_rate=flood_rate(a, cap, tenants),
            capacity_rps=cap,
            capacity_from=f"{len(calibration)} flood requests, {in_flight} at a time while full, through {calibrating.name}",
            interactive_clients=probe.interactive_clients,
            seed=a.seed,
            backlog_rate=backlog_rate(a, cap, tenants),
            capacity_images_per_s=cap_images,
        )
        requests = _requests(plan, bench.model, tiny=False)
        for arm, kind, r in _interleaved(arms, plan.rounds):
            bench.reset()
            before = engine_metrics.scrape_all(bench.engines)
            proc, url = bench.start_proxy(arm, arm.name)
            try:
                block = run_block(arm, kind, r, url, plan, requests, tenants)
            finally:
                stop_process(proc)
            # Requests the proxy dropped may still run on the engines: let them finish, and count them.
            after = engine_metrics.settled(bench.engines)
            deltas = {name: engine_metrics.delta(before[name], after[name]) for name in after}
            answered = sum(1 for s in block["sent"] if tenant_load.answered(s))
            block["engines"] = engine_metrics.summarise(bench.engines, deltas, answered) if answered else {}
            arm.blocks.append(block)
        result = tenant_report.build(arms, plan, tenants, mode="real engines")
        tenant_report.write(bench.out, result)
    finally:
        if bench.stack is not None:
            bench.stack.stop()
    print(result["table_md"])
    print(f"results: {bench.out}")
    return 0
