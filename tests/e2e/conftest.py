"""Real vLLM stacks for the end-to-end tests, at most one alive at a time.

- ``stack``: E+PD, 2 encoders + PD + a baseline + the proxy.
- ``prefill_stack``: E+P+D, 2 encoders + prefill + decode + a baseline + the proxy
  (KV handed from prefill to decode through a folder, vLLM's ExampleConnector).
- ``audio_stack``: E+PD on the tiny Qwen2-Audio model, 1 encoder + PD + a baseline + the proxy.
- ``two_pd_stack``: 2 encoders + 2 PDs + a baseline + the proxy, for conversations placed by prefix.
- ``mooncake_stack``: E+PD with 2 encoders pushing their output to PD over Mooncake (TCP).
- ``nixl_stack``: E+P+D with 2 encoders (folder store), decode pulling prefill's KV over NIXL.

The baseline is a plain vLLM instance with no EC or KV role, started from the
same model folder and flags, so a correct proxy must reproduce its answers exactly.

Each stack is up to six vLLM servers of ~1.5 GiB: asking for another kind stops
the live one first. Tests are run grouped by the stack they use (those needing none
first, then E+PD, E+P+D, audio), each group in file order, so a session starts each
kind once.

Set EPD_E2E_WORK_DIR to move the E+PD stack's work folder (default: work/e2e-stack
under the repository; the E+P+D stack uses the same path + "-prefill"); nothing
is written to /tmp.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from epd_proxy_tools.local.stack import LocalStack, StackConfig
from epd_proxy_tools.local.supervisor import find_free_port_block, http_ok
from epd_proxy_tools.testing.otlp_receiver import Receiver

from .e2e_helpers import AUDIO, BUSY_AT, EPD, MOONCAKE, NIXL, PREFILL, TWO_PDS, comparable

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("EPD_E2E_WORK_DIR", REPO / "work" / "e2e-stack"))


# The order the stacks are started in; tests that need none run first.
STACK_ORDER = {EPD: 1, PREFILL: 2, AUDIO: 3, TWO_PDS: 4, MOONCAKE: 5, NIXL: 6}
STACK_FIXTURES = {
    "stack": EPD,
    "prefill_stack": PREFILL,
    "audio_stack": AUDIO,
    "two_pd_stack": TWO_PDS,
    "mooncake_stack": MOONCAKE,
    "nixl_stack": NIXL,
}
# A Mooncake consumer gives up on a push it waits for after this (`push_wait_timeout_s`, 60 s by
# default): the control that waits it out on purpose costs no more.
PUSH_WAIT_S = 20


def pytest_collection_modifyitems(items):
    """Group the e2e tests by the stack they use (a stable sort: file and definition order stay
    within a group), so each stack starts once however many files use it, and run them after every
    other test: the last stack's vLLM servers live until the session ends, and the fake-backend
    tests' timing must not share the cores and memory with them."""

    def group(item) -> int:
        names = getattr(item, "fixturenames", ())
        kinds = [STACK_ORDER[kind] for name, kind in STACK_FIXTURES.items() if name in names]
        return min(kinds, default=0)

    here = Path(__file__).parent
    e2e = [i for i in items if Path(i.path).parent == here]
    if e2e:
        chosen = set(e2e)
        items[:] = [i for i in items if i not in chosen] + sorted(e2e, key=group)


# Every stack's servers export their spans to this receiver (test_e2e_tracing.py). Sampling is
# parent-based with no new traces of their own (the OTEL_TRACES_SAMPLER* variables in Stacks.get,
# which vLLM's SDK and the proxy both read): only a request whose client sent a sampled
# `traceparent` is traced, so the other tests and the benchmark run as if tracing were off.
TRACES = Receiver()


def stack_config(kind: str) -> StackConfig:
    # Encoders, PD or prefill + decode, the baseline, then the proxy right after them.
    encoders = 1 if kind == AUDIO else 2
    consumers = 2 if kind == TWO_PDS else 1
    split = kind in (PREFILL, NIXL)
    servers = encoders + consumers + (2 if split else 1)
    base = find_free_port_block(servers + 1, start=int(os.environ.get("EPD_E2E_BASE_PORT", "18200")))
    # Each PD, prefill and decode publishes its KV events on two ports, bound on every interface.
    publishers = consumers + (1 if split else 0)
    kv_events_port = find_free_port_block(2 * publishers, host="0.0.0.0", start=base + 100)
    # Each engine's Mooncake control port or NIXL side channel, also bound on every interface.
    transfer_port = find_free_port_block(encoders + consumers + 1, host="0.0.0.0", start=base + 200)
    suffix = {
        EPD: "",
        PREFILL: "-prefill",
        AUDIO: "-audio",
        TWO_PDS: "-two-pds",
        MOONCAKE: "-mooncake",
        NIXL: "-nixl",
    }[kind]
    return StackConfig(
        encoders=encoders,
        consumers=consumers,
        baseline=True,
        prefill=split,
        ec_connector="mooncake" if kind == MOONCAKE else "example",
        kv_connector="nixl" if kind == NIXL else "example",
        transfer_port=transfer_port,
        mooncake_push_wait_s=PUSH_WAIT_S,
        model_kind="audio" if kind == AUDIO else "image",
        work_dir=WORK.with_name(WORK.name + suffix),
        base_port=base,
        port=base + servers,
        kv_events_port=kv_events_port,
        health_timeout=float(os.environ.get("EPD_E2E_HEALTH_TIMEOUT", "600")),
        # PD's DEBUG log is the only place that says it loaded an embedding
        # from the store instead of running its own encoder.
        pd_debug_log=kind in (EPD, AUDIO, TWO_PDS, MOONCAKE, NIXL),
        # Pin the spread so 5 images over 2 encoders are exactly 2 sub-requests.
        proxy_args=["--encode-policy", "round_robin", "--log-level", "DEBUG"],
        # The render endpoints the proxy's exact matching asks (test_e2e_render.py); they only add routes.
        extra_vllm_args=("--enable-scale-out",) if kind == EPD else (),
        # Admission control that refuses a third unfinished request (test_e2e_took_none.py): the other
        # tests send one request at a time and never meet it.
        consumer_vllm_args=("--max-num-queued-reqs", str(BUSY_AT)) if kind == TWO_PDS else (),
        python=sys.executable,
        otlp_traces_endpoint=TRACES.grpc_url,
        extra_env={
            # Dev mode adds vLLM's cache reset endpoints, which the real-engine benchmark's smoke uses.
            "VLLM_SERVER_DEV_MODE": "1",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    )


class Stacks:
    def __init__(self) -> None:
        self.kind: str | None = None
        self.live: LocalStack | None = None
        self.failed: dict[str, str] = {}
        self.started: dict[str, LocalStack] = {}

    def get(self, kind: str) -> LocalStack:
        if self.kind == kind and self.live is not None:
            return self.live
        if kind in self.failed:
            pytest.fail(f"the {kind} stack did not start:\n{self.failed[kind]}", pytrace=False)
        self.close()
        if not TRACES.grpc_url:
            TRACES.start()
        st = LocalStack(stack_config(kind), progress_stream=sys.stderr)
        try:
            st.start(tty=False)
        except Exception as exc:
            self.failed[kind] = str(exc)
            raise
        self.kind, self.live = kind, st
        self.started[kind] = st
        sys.stderr.write(
            f"\n[e2e] {kind} stack ready in {st.timings.get('ready_s', 0):.1f} s "
            f"(model {st.timings.get('model_build_s', 0):.1f} s); "
            f"PSS MiB: { {k: round(v) for k, v in st.memory_report().items()} }\n"
        )
        return st

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
        self.kind = self.live = None


@pytest.fixture(scope="session")
def _stacks():
    stacks = Stacks()
    try:
        yield stacks
    finally:
        stacks.close()


@pytest.fixture
def stack(_stacks) -> LocalStack:
    return _stacks.get(EPD)


@pytest.fixture
def prefill_stack(_stacks) -> LocalStack:
    return _stacks.get(PREFILL)


@pytest.fixture
def audio_stack(_stacks) -> LocalStack:
    return _stacks.get(AUDIO)


@pytest.fixture
def two_pd_stack(_stacks) -> LocalStack:
    return _stacks.get(TWO_PDS)


@pytest.fixture
def mooncake_stack(_stacks) -> LocalStack:
    return _stacks.get(MOONCAKE)


@pytest.fixture
def nixl_stack(_stacks) -> LocalStack:
    return _stacks.get(NIXL)


@pytest.fixture(autouse=True)
def _pd_alive(request):
    """Bring PD back if an earlier test (a negative control) killed it."""
    name = next((n for n in ("stack", "audio_stack", "mooncake_stack") if n in request.fixturenames), None)
    if name is None:
        yield
        return
    st: LocalStack = request.getfixturevalue(name)
    pd = st.by_name("pd")
    if not pd.alive() or not http_ok(pd.health_url):
        st.restart("pd")
    yield


class FidelityTable:
    """Every proxy-vs-baseline comparison, asserted and kept for the closing table
    (written to <work>/fidelity.md and printed at the end of the session).

    ``kv`` says what decode loaded from prefill (E+P+D), so the table shows the
    handover happened and not only that the answers agree."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str, str, str, bool]] = []

    def check(self, case: str, got: dict, want: dict, path: str = EPD, kv: str = "n/a") -> None:
        g, w = comparable(got), comparable(want)
        text = lambda c: c["choices"][0]["message"]["content"] if c["choices"] else ""  # noqa: E731
        logprobs = (
            "n/a"
            if w["choices"][0]["logprobs"] is None
            else ("same" if g["choices"][0]["logprobs"] == w["choices"][0]["logprobs"] else "DIFFERENT")
        )
        usage = "same" if g["usage"] == w["usage"] else "DIFFERENT"
        self.rows.append((path, case, text(w), text(g), usage, logprobs, kv, g == w))
        assert g == w, f"{path} {case}: proxy answer differs from the baseline"

    def record_text(
        self,
        case: str,
        got_text: str,
        want_text: str,
        usage_same: bool,
        path: str = EPD,
        kv: str = "n/a",
        logprobs: str = "n/a",
    ) -> None:
        match = got_text == want_text and usage_same and logprobs in ("n/a", "same")
        self.rows.append((path, case, want_text, got_text, "same" if usage_same else "DIFFERENT", logprobs, kv, match))

    def markdown(self) -> str:
        lines = [
            "| path | case | baseline | via proxy | usage | logprobs | decode loaded from prefill | match |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {p} | {c} | `{b}` | `{e}` | {u} | {lp} | {kv} | {'yes' if m else 'NO'} |"
            for p, c, b, e, u, lp, kv, m in self.rows
        ]
        return "\n".join(lines) + "\n"


# Lines for the end-of-session summary. Printed from pytest_terminal_summary: output written
# while a fixture tears down is captured like the test's own and would be lost.
_SUMMARY: list[str] = []


@pytest.fixture(scope="session")
def fidelity(_stacks):
    table = FidelityTable()
    yield table
    if table.rows:
        report = table.markdown()
        WORK.mkdir(parents=True, exist_ok=True)
        (WORK / "fidelity.md").write_text(report)
        _SUMMARY.append(f"[e2e] fidelity, proxy (encoders + PD or P + D) vs one plain vLLM ({WORK}/fidelity.md):")
        _SUMMARY.extend(report.splitlines())
    for kind, st in _stacks.started.items():
        try:
            timings = json.loads((st.work_dir / "timings.json").read_text())
        except (OSError, ValueError):
            continue
        _SUMMARY.append(f"[e2e] {kind} stack start-up and memory: {json.dumps(timings)}")


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)
