"""One real E+PD stack per test session: 2 encoders, PD, a baseline, the proxy.

The baseline is a plain vLLM instance with no EC role, started from the same
model folder and flags, so a correct proxy must reproduce its answers exactly.

Set EPD_E2E_WORK_DIR to move the stack's work folder (default: work/e2e-stack
under the repository); nothing is written to /tmp.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from epd_proxy.local.stack import LocalStack, StackConfig
from epd_proxy.local.supervisor import find_free_port_block, http_ok

from .e2e_helpers import comparable

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def stack():
    work = Path(os.environ.get("EPD_E2E_WORK_DIR", REPO / "work" / "e2e-stack"))
    # 2 encoders + PD + baseline, then the proxy right after them.
    base = find_free_port_block(5, start=int(os.environ.get("EPD_E2E_BASE_PORT", "18200")))
    cfg = StackConfig(
        encoders=2,
        baseline=True,
        work_dir=work,
        base_port=base,
        port=base + 4,
        health_timeout=float(os.environ.get("EPD_E2E_HEALTH_TIMEOUT", "240")),
        # PD's DEBUG log is the only place that says it loaded an embedding
        # from the store instead of running its own vision encoder.
        pd_debug_log=True,
        # Pin the spread so 5 images over 2 encoders are exactly 2 sub-requests.
        proxy_args=["--encode-policy", "round_robin", "--log-level", "DEBUG"],
        python=sys.executable,
    )
    st = LocalStack(cfg, progress_stream=sys.stderr)
    st.start(tty=False)
    sys.stderr.write(
        f"\n[e2e] stack ready in {st.timings.get('ready_s', 0):.1f} s "
        f"(model {st.timings.get('model_build_s', 0):.1f} s); "
        f"PSS MiB: { {k: round(v) for k, v in st.memory_report().items()} }\n"
    )
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(autouse=True)
def _pd_alive(request):
    """Bring PD back if an earlier test (the negative control) killed it."""
    if "stack" not in request.fixturenames:
        yield
        return
    st: LocalStack = request.getfixturevalue("stack")
    pd = st.by_name("pd")
    if not pd.alive() or not http_ok(pd.health_url):
        st.restart("pd")
    yield


class FidelityTable:
    """Every proxy-vs-baseline comparison, asserted and kept for the closing table
    (written to <work>/fidelity.md and printed at the end of the session)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str, bool]] = []

    def check(self, case: str, got: dict, want: dict) -> None:
        g, w = comparable(got), comparable(want)
        text = lambda c: c["choices"][0]["message"]["content"] if c["choices"] else ""  # noqa: E731
        logprobs = (
            "n/a"
            if w["choices"][0]["logprobs"] is None
            else ("same" if g["choices"][0]["logprobs"] == w["choices"][0]["logprobs"] else "DIFFERENT")
        )
        usage = "same" if g["usage"] == w["usage"] else "DIFFERENT"
        self.rows.append((case, text(w), text(g), usage, logprobs, g == w))
        assert g == w, f"{case}: proxy answer differs from the baseline"

    def record_text(self, case: str, got_text: str, want_text: str, usage_same: bool) -> None:
        self.rows.append(
            (
                case,
                want_text,
                got_text,
                "same" if usage_same else "DIFFERENT",
                "n/a",
                got_text == want_text and usage_same,
            )
        )

    def markdown(self) -> str:
        lines = ["| case | baseline | EPD via proxy | usage | logprobs | match |", "|---|---|---|---|---|---|"]
        lines += [f"| {c} | `{b}` | `{e}` | {u} | {lp} | {'yes' if m else 'NO'} |" for c, b, e, u, lp, m in self.rows]
        return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def fidelity(stack, request):
    table = FidelityTable()
    yield table
    if table.rows:
        report = table.markdown()
        (stack.work_dir / "fidelity.md").write_text(report)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(
                f"[e2e] fidelity, proxy (2 encoders + PD) vs one plain vLLM ({stack.work_dir}/fidelity.md):"
            )
            for line in report.splitlines():
                reporter.write_line(line)
