"""`epd-proxy bench`'s options, each declared once (options.py): `FakeBenchOptions` against fake
backends (runner.py), `RealBenchOptions` against real vLLM engines (real.py, `--stack` or a running
deployment's URLs)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from epd_proxy.options import Choice, Count, Folder, Real, Switch, Text, Texts, check, option
from epd_proxy_tools.bench.workload import API_PATHS
from epd_proxy_tools.local.stack import StackConfig

SEED = 1234
CACHE_DIR = Path("work/bench-cache")
ARMS = ("batched", "per-item", "direct", "saturation", "workers")
OUR_COMMAND = "epd-proxy serve"


@dataclass(frozen=True)
class Preset:
    pool_size: int
    concurrency: int
    requests: int  # measured requests per block (one "round" of an arm)
    rounds: int
    warmup: int
    unloaded_requests: int  # per arm per round, one at a time


PRESETS = {
    "quick": Preset(pool_size=24, concurrency=16, requests=48, rounds=2, warmup=16, unloaded_requests=8),
    "full": Preset(pool_size=128, concurrency=96, requests=768, rounds=4, warmup=96, unloaded_requests=64),
}


TENANTS_GROUP = "tenants workload (`--workload tenants`)"


@dataclass(frozen=True)
class TenantLoadOptions:
    """`--workload tenants` in both modes (tenant_bench.py): a flooding tenant and an interactive one."""

    flood_factor: float = option(
        10.0,
        Real("X", 0),
        "the flood tenant's arrival rate as a multiple of its weighted share of the encoders' capacity",
        flag="--flood-factor",
        group=TENANTS_GROUP,
    )
    flood_rate: float | None = option(
        None,
        Real("RPS", 0),
        "the flood tenant's arrival rate in requests/s, instead of `--flood-factor` times its share",
        flag="--flood-rate",
        group=TENANTS_GROUP,
        shown="from --flood-factor",
    )
    flood_deadline_ms: int = option(
        1000,
        Count(1, 3_600_000),
        "the flood tenant's `deadline_ms` in the tenants file the bench gives its own proxies",
        flag="--flood-deadline-ms",
        group=TENANTS_GROUP,
        metavar="MS",
    )
    backlogged_factor: float = option(
        1.5,
        Real("X", 0),
        "in the third block (`both`), the interactive tenant floods too, at this multiple of its weighted "
        "share: both tenants backlogged, for their shares of the encoders against their weights, and goodput",
        flag="--backlogged-factor",
        group=TENANTS_GROUP,
    )
    interactive_clients: int = option(
        2,
        Count(1),
        "chat clients of the interactive tenant, each sending one-image questions with a pause between",
        flag="--interactive-clients",
        group=TENANTS_GROUP,
    )
    interactive_priority: int = option(
        0,
        Count(-1_000_000, 1_000_000),
        "the interactive tenant's vLLM `priority` (its range in the tenants file, an objective class): "
        "other than 0 needs engines with `--scheduling-policy priority` (`--vllm-args`)",
        flag="--interactive-priority",
        group=TENANTS_GROUP,
    )
    block_seconds: float | None = option(
        None,
        Real("S", 1),
        "how long each block sends",
        flag="--block-seconds",
        group=TENANTS_GROUP,
        shown="quick 6, full 20",
    )
    tenants_image_ms: float = option(
        50.0,
        Real("MS", 0),
        "the costed fake encoders' cost per image with `--workload tenants` (in place of `--encoder-image-ms`), "
        "so that a flood is tens of requests per second",
        flag="--tenants-image-ms",
        group=TENANTS_GROUP,
    )


def _preset(name: str) -> str:
    """How an option left to the preset reads in --help."""
    return ", ".join(f"{preset} {getattr(values, name)}" for preset, values in PRESETS.items())


@dataclass(frozen=True)
class FakeBenchOptions(TenantLoadOptions):
    quick: bool = option(False, Switch(), "small counts, < 60 s, for CI smoke tests", flag="--quick")
    out: Path | None = option(None, Folder(), "results folder", flag="--out", shown="./results/bench-<timestamp>")
    cache_dir: Path = option(CACHE_DIR, Folder(), "request-pool cache", flag="--cache-dir")
    seed: int = option(SEED, Count(0), "seed for the request pool and arm order", flag="--seed")
    pool_size: int | None = option(
        None, Count(1), "distinct request bodies", flag="--pool-size", shown=_preset("pool_size")
    )
    concurrency: int | None = option(
        None, Count(1), "closed-loop connections", flag="--concurrency", shown=_preset("concurrency")
    )
    requests: int | None = option(
        None, Count(1), "measured requests per arm per round", flag="--requests", shown=_preset("requests")
    )
    rounds: int | None = option(
        None, Count(1), "interleaved rounds (A B C, C B A, ...)", flag="--rounds", shown=_preset("rounds")
    )
    warmup: int | None = option(
        None, Count(0), "unmeasured requests before each block", flag="--warmup", shown=_preset("warmup")
    )
    encoders: int = option(4, Count(1), "fake encoder servers", flag="--encoders")
    encoder_ms: float = option(2.0, Real("MS", 0), "fake encoder cost per sub-request", flag="--encoder-ms")
    encoder_image_ms: float = option(1.5, Real("MS", 0), "fake encoder cost per image", flag="--encoder-image-ms")
    encoder_speeds: str | None = option(
        None,
        Text(),
        "cost multiplier of each costed fake encoder, one per `--encoders` (e.g. 1,1,1,3: the last three times slower)",
        flag="--encoder-speeds",
        metavar="F,F,...",
        shown="all 1",
    )
    encoder_repeat_factor: float = option(
        1.0,
        Real("FACTOR", 0),
        "cost of an image a fake encoder saw recently (among its last `--encoder-cache-items`), as a share of a "
        "fresh one's; real vLLM: about 0.4",
        flag="--encoder-repeat-factor",
    )
    encoder_cache_items: int = option(
        256,
        Count(0),
        "images each fake encoder remembers for `--encoder-repeat-factor` (least recently used out)",
        flag="--encoder-cache-items",
    )
    pd_ms: float = option(5.0, Real("MS", 0), "fake PD answer time", flag="--pd-ms")
    arms: str = option(
        ",".join(ARMS), Text(), f"comma-separated subset of {', '.join(ARMS)}", flag="--arms", metavar="ARMS"
    )
    workers: int = option(2, Count(1), "proxy processes in the workers arm", flag="--workers")
    clients: int = option(1, Count(1), "load generator processes", flag="--clients")
    proxy_cpus: str = option("0", Text(), "cores the proxies are pinned to", flag="--proxy-cpus", metavar="CPUS")
    harness_cpus: str = option(
        "1", Text(), "cores for fakes and load generators", flag="--harness-cpus", metavar="CPUS"
    )
    no_pin: bool = option(False, Switch(), "do not pin processes to cores", flag="--no-pin")
    unloaded_requests: int | None = option(
        None,
        Count(0),
        "requests per arm per round sent one at a time for unloaded latency (0 = skip)",
        flag="--unloaded-requests",
        shown=_preset("unloaded_requests"),
    )
    profile_arm: str | None = option(
        None,
        Text(),
        "record this arm's proxy with py-spy (needs py-spy); writes a flame graph and top frames",
        flag="--profile-arm",
        metavar="ARM",
    )
    profile_native: bool = option(False, Switch(), "py-spy `--native`: include C frames", flag="--profile-native")
    proxy_env: tuple[str, ...] = option(
        (),
        Texts(),
        "extra environment for the proxies (repeatable), e.g. to try interpreter settings",
        flag="--proxy-env",
        metavar="KEY=VALUE",
    )
    variant: tuple[str, ...] = option(
        (),
        Texts(),
        "one more arm like ARM (saturation, batched or per-item; default saturation) whose proxy gets this "
        "environment, interleaved with the others: A/B a change against ARM in one run, e.g. another checkout's "
        "code with PYTHONPATH (repeatable)",
        flag="--variant",
        metavar="NAME[@ARM]:KEY=VALUE[,KEY=VALUE]",
    )
    stream: bool = option(
        False,
        Switch(),
        'send `"stream": true`; the PD fakes then answer a first token at once and the rest after `--pd-ms`',
        flag="--stream",
    )
    proxy: tuple[str, ...] = option(
        (),
        Texts(),
        "one more arm at the batched arm's (equal, encoder-bound) load for any proxy with the reference's "
        "command line, e.g. NAME='python disagg_epd_proxy.py': the bench appends `--host`, `--port`, "
        "`--encode-servers-urls` and `--decode-servers-urls` and sets `ENCODER_MAX_BATCH_SIZE=0` (repeatable); "
        "NAME@saturation=... runs it against the zero-cost fakes instead",
        flag="--proxy",
        metavar="NAME=COMMAND",
    )
    api: str = option(
        "chat",
        Choice(tuple(API_PATHS)),
        "the door every arm is driven through: the same mix as chat completions, OpenAI Responses or Anthropic "
        "Messages",
        flag="--api",
    )
    workload: str = option(
        "mix",
        Choice(("mix", "tenants")),
        "`mix`: the chat mix through every arm; `tenants`: a flooding tenant and an interactive one through "
        "each proxy arm (see the tenants workload options)",
        flag="--workload",
    )
    no_chart: bool = option(False, Switch(), "skip the matplotlib chart", flag="--no-chart")

    def __post_init__(self) -> None:
        check(self)


ENGINES = "engines (one of)"
LOCAL_STACK = "local stack (--stack)"
ARM_GROUP = "arms"
LOAD = "load"
REAL_GROUPS = (ENGINES, LOCAL_STACK, ARM_GROUP, LOAD)
# What `--quick` sets in the real-engine mode, whatever else the command line says.
REAL_QUICK = {"rounds": 1, "conversations": 3, "warmup": 1}


def _stack_option(name: str) -> Any:
    """`epd-proxy up`'s option of that field, declared once in StackConfig, under the bench's
    local-stack heading."""
    (declared,) = [item for item in fields(StackConfig) if item.name == name]
    return field(default=declared.default, metadata={"option": replace(declared.metadata["option"], group=LOCAL_STACK)})


@dataclass(frozen=True)
class RealBenchOptions(TenantLoadOptions):
    stack: bool = option(
        False,
        Switch(),
        "start the local real stack (`--encoders` encoders, PD or `--prefill`'s prefill and decode, and a baseline)",
        flag="--stack",
        group=ENGINES,
    )
    encode_urls: str = option(
        "",
        Text(),
        "comma-separated encoder URLs of a running deployment",
        flag="--encode-urls",
        group=ENGINES,
        metavar="URLS",
    )
    decode_urls: str = option(
        "", Text(), "PD (E+PD) or decode (E+P+D) URLs", flag="--decode-urls", group=ENGINES, metavar="URLS"
    )
    prefill_urls: str = option("", Text(), "prefill URLs: E+P+D", flag="--prefill-urls", group=ENGINES, metavar="URLS")
    baseline_url: str = option(
        "",
        Text(),
        "a plain vLLM instance of the same model, for answers",
        flag="--baseline-url",
        group=ENGINES,
        metavar="URL",
    )
    ec_store: Path | None = option(
        None, Folder(), "EC store folder to empty between blocks", flag="--ec-store", group=ENGINES
    )
    model: str | None = option(
        None,
        Text(),
        "model name to send",
        flag="--model",
        group=ENGINES,
        metavar="NAME",
        shown="the decode's /v1/models",
    )
    encoders: int = option(2, Count(1), "encoder instances", flag="--encoders", group=LOCAL_STACK)
    prefill: bool = option(
        False, Switch(), "E+P+D: a prefill and a decode instead of PD", flag="--prefill", group=LOCAL_STACK
    )
    pds: int = option(1, Count(1), "PD instances (prefill instances with `--prefill`)", flag="--pds", group=LOCAL_STACK)
    # The default KV blocks (65,536 tokens, 32 MiB for the tiny
    # model): the tests' 128 (4,096 tokens) holds two long prompts, so at concurrency 16 the language
    # model would queue for KV space and evict every conversation's prefix between its turns, which a
    # GPU's cache of hundreds of thousands of tokens does not; prefix reuse is measured on a cache that
    # holds the load's conversations, as a real one would.
    kv_blocks: int = option(
        2048,
        Count(1),
        "KV blocks of every PD, prefill, decode and the baseline (vLLM `--num-gpu-blocks-override`); few enough "
        "blocks evict sessions between their turns",
        flag="--kv-blocks",
        group=LOCAL_STACK,
    )
    max_model_len: int = option(
        2048, Count(1), "vLLM `--max-model-len` of every server", flag="--max-model-len", group=LOCAL_STACK
    )
    render: bool = option(
        False,
        Switch(),
        "also start a vLLM render server; `{render}` in a `--proxy` command is its URL (e.g. "
        "`--render-urls {render}`), and each block reports its CPU per request",
        flag="--render",
        group=LOCAL_STACK,
    )
    restart_after: float | None = option(
        None,
        Real("S", 0),
        "stop one consumer (`--restart-name`) this many seconds into every measured proxy block and start it "
        "again on its port; the block goes on meanwhile",
        flag="--restart-after",
        group=LOCAL_STACK,
        shown="no restart",
    )
    restart_name: str | None = option(
        None,
        Text(),
        "the instance `--restart-after` restarts",
        flag="--restart-name",
        group=LOCAL_STACK,
        metavar="NAME",
        shown="the last PD (prefill with `--prefill`)",
    )
    vllm_args: tuple[str, ...] = _stack_option("extra_vllm_args")
    ec_connector: str = _stack_option("ec_connector")
    kv_connector: str = _stack_option("kv_connector")
    stack_dir: Path = option(
        Path("work/bench-stack"), Folder(), "the stack's work folder", flag="--stack-dir", group=LOCAL_STACK
    )
    base_port: int = option(
        18600, Count(0, 65535), "first vLLM port", flag="--base-port", group=LOCAL_STACK, metavar="PORT"
    )
    proxy: tuple[str, ...] = option(
        (),
        Texts(),
        "a proxy arm (repeatable)",
        flag="--proxy",
        group=ARM_GROUP,
        metavar="NAME=[KEY=VALUE ...] COMMAND",
        shown=f"one arm `epd-proxy={OUR_COMMAND}`",
    )
    variant: tuple[str, ...] = option(
        (), Texts(), "epd-proxy with env", flag="--variant", group=ARM_GROUP, metavar="NAME:KEY=VALUE[,...]"
    )
    no_single_instance: bool = option(
        False, Switch(), "leave out the single-instance arm", flag="--no-single-instance", group=ARM_GROUP
    )
    concurrency: str = option(
        "8",
        Text(),
        "closed-loop levels, comma-separated ('' for none)",
        flag="--concurrency",
        group=LOAD,
        metavar="LEVELS",
    )
    rate: str = option(
        "",
        Text(),
        "open-loop levels in requests/s (Poisson), comma-separated",
        flag="--rate",
        group=LOAD,
        metavar="LEVELS",
    )
    conversations: int = option(24, Count(1), "measured conversations per block", flag="--conversations", group=LOAD)
    warmup: int = option(4, Count(0), "warm-up conversations per block (other images)", flag="--warmup", group=LOAD)
    rounds: int = option(3, Count(1), "interleaved rounds per level", flag="--rounds", group=LOAD)
    seed: int = option(SEED, Count(0), "workload and arrival seed", flag="--seed", group=LOAD)
    multi_turn_share: float = option(
        0.3, Real("SHARE", 0), "share of multi-turn conversations", flag="--multi-turn-share", group=LOAD
    )
    popular_share: float = option(
        0.25, Real("SHARE", 0), "share of image slots from popular images", flag="--popular-share", group=LOAD
    )
    max_images: int = option(12, Count(1), "most images in one request", flag="--max-images", group=LOAD)
    steps: int | None = option(
        None,
        Count(1),
        "`--workload agent`: steps in every session",
        flag="--steps",
        group=LOAD,
        shown="6-10, drawn per session",
    )
    preamble_chars: int = option(
        0,
        Count(0),
        "`--workload agent`: a system prompt with tool definitions of this many characters that every session "
        "opens with (the tiny model makes about a token of each)",
        flag="--preamble-chars",
        group=LOAD,
        shown="a one-line system prompt",
    )
    shared_screens: int = option(
        0,
        Count(0),
        "`--workload agent`: each session's first screenshot is one of this many that every session draws from",
        flag="--shared-screens",
        group=LOAD,
        shown="every screenshot new",
    )
    workload: str = option(
        "mix",
        Choice(("mix", "agent", "tenants")),
        "`mix`: MUIRBench-like chats; `agent`: sessions of 6-10 steps (`--steps`), each adding one screenshot and re-sending "
        "the history; `tenants`: a flooding tenant and an interactive one (see the tenants workload options)",
        flag="--workload",
        group=LOAD,
    )
    think_ms: str | None = option(
        None,
        Text(),
        "pause between a conversation's turns in milliseconds, drawn per turn from LO-HI",
        flag="--think-ms",
        group=LOAD,
        metavar="LO-HI",
        shown="100-400 with `--workload agent`, none for `mix`",
    )
    quick: bool = option(
        False,
        Switch(),
        "a smoke: " + ", ".join(f"`--{name} {value}`" for name, value in REAL_QUICK.items()),
        flag="--quick",
        group=LOAD,
    )
    proxy_cpus: str | None = option(
        None,
        Text(),
        "cores for proxies and this harness",
        flag="--proxy-cpus",
        metavar="CPUS",
        shown="the encoders'",
    )
    no_pin: bool = option(False, Switch(), "do not pin proxies and the harness", flag="--no-pin")
    no_reset: bool = option(False, Switch(), "keep engine caches between blocks", flag="--no-reset")
    out: Path | None = option(None, Folder(), "results folder", flag="--out", shown="./results/real-<timestamp>")
    cache_dir: Path = option(CACHE_DIR, Folder(), "workload cache", flag="--cache-dir")
    no_chart: bool = option(False, Switch(), "skip the chart", flag="--no-chart")

    def __post_init__(self) -> None:
        check(self)
