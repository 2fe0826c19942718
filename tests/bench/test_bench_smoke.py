"""The benchmark runs end to end with tiny counts, writes its results, and sees batching work.

No timing assertions: CI machines are shared and noisy. Sub-request counts are exact, because the
fakes count only requests whose id marks them as measured (a sub-request shared by several
requests counts for the first of them), but how many there are depends on the encoders' queues.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

# One round of 8 measured requests over 4 bodies, 4 at a time, no chart.
EIGHT_REQUESTS = (
    "--no-chart",
    "--pool-size",
    "4",
    "--requests",
    "8",
    "--rounds",
    "1",
    "--warmup",
    "2",
    "--concurrency",
    "4",
)


def run_quick_bench(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path, dict[str, dict]]:
    """`epd-proxy bench --quick` with `flags`; the run, its results folder and its arms by name."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "epd_proxy_tools.bench", "--quick", "--out", str(out)]
    cmd += ["--cache-dir", str(tmp_path / "cache"), *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    arms = {a["name"]: a for a in json.loads((out / "results.json").read_text())["arms"]}
    return run, out, arms


def test_quick_bench_writes_results_and_batching_sends_fewer_subrequests(tmp_path: Path) -> None:
    run, out, arms = run_quick_bench(
        tmp_path,
        "--pool-size",
        "8",
        "--requests",
        "16",
        "--rounds",
        "2",
        "--warmup",
        "4",
        "--concurrency",
        "4",
        "--arms",
        "batched,per-item,direct",
        # Any proxy with the reference's command line gets an arm; ours has that command line too.
        "--proxy",
        f"again={sys.executable} -m epd_proxy serve",
    )
    for name in ("results.json", "table.md", "chart.png", "latencies.json"):
        assert (out / name).stat().st_size > 0, name
    assert set(arms) == {"batched", "per-item", "direct", "again"}
    for arm in arms.values():
        assert arm["errors"] == 0
        assert arm["measured"] == 32
        # Every measured request reached PD exactly once, whichever path it took.
        assert arm["pd_requests_per_round"] == 16

    batched, per_item = arms["batched"], arms["per-item"]
    assert batched["encoder_subrequests_per_round"] < per_item["encoder_subrequests_per_round"]
    # Per-item sends one image per sub-request; batching packs several into some of them.
    assert per_item["images_per_subrequest"] == 1.0
    assert batched["images_per_subrequest"] > 1.0
    # Through the proxy PD gets an image the proxy has not seen encoded as a reference; the pool
    # repeats, and one it saw in an earlier pass goes raw under its name, loaded from the EC store.
    for arm in (batched, per_item):
        assert 0 < arm["pd_raw_images"] < arms["direct"]["pd_raw_images"]
    assert arms["direct"]["encoder_subrequests_per_round"] == 0
    # The --proxy arm ran at the batched arm's load and batched too (ENCODER_MAX_BATCH_SIZE=0); how
    # many sub-requests each sends depends on the encoders' queues (load-adaptive fan-out).
    assert arms["again"]["images_per_subrequest"] > 1.0
    assert arms["again"]["encoder_subrequests_per_round"] < per_item["encoder_subrequests_per_round"]
    assert arms["again"]["proxy_cpu_ms_per_request"] > 0
    assert "| batched |" in (out / "table.md").read_text()
    assert "| batched |" in run.stdout
    floor = json.loads((out / "results.json").read_text())["floor"]
    for name in ("sha256_urls_ms_per_request", "blake3_urls_ms_per_request", "splice_read_ms_per_request"):
        assert floor[name] > 0, name
    assert "Splice's read (lift, strict base64 check, skeleton parse)" in run.stdout


def test_quick_streaming_bench_relays_every_stream_and_samples_rss(tmp_path: Path) -> None:
    _, _, arms = run_quick_bench(
        tmp_path,
        "--stream",
        *EIGHT_REQUESTS,
        "--pd-ms",
        "300",
        "--arms",
        "batched",
        "--variant",
        "again@batched:EPD_UNUSED=1",
    )
    assert set(arms) == {"batched", "again"}
    for arm in arms.values():
        # Each streamed answer (chunked by the proxy) was read to its end and counted.
        assert arm["errors"] == 0 and arm["measured"] == 8 and arm["pd_requests_per_round"] == 8
        assert arm["proxy_rss_under_load_mb"] > 0
    for arm in arms.values():
        assert arm["encoder_subrequests_per_round"] > 0 and arm["images_per_subrequest"] >= 1.0


def test_two_arms_cannot_share_a_name(tmp_path: Path) -> None:
    from epd_proxy_tools.bench.runner import Bench, parse_args

    args = parse_args(["--quick", "--out", str(tmp_path), "--proxy", "ref=true", "--proxy", "ref@saturation=true"])
    with pytest.raises(SystemExit, match="ref used twice"):
        Bench(args).build_arms()


def test_a_proxy_arms_python_is_this_environment_and_a_variant_tree_is_absolute(tmp_path: Path) -> None:
    """Proxies run from the results folder with this venv's packages: a bare `python` on PATH may
    lack the reference's, and a relative PYTHONPATH would quietly run this checkout instead."""
    from epd_proxy_tools.bench.runner import Bench, parse_args

    argv = [
        "--quick",
        "--out",
        str(tmp_path),
        "--proxy",
        "ref=python ref.py --x",
        "--variant",
        "old@batched:PYTHONPATH=work/old",
    ]
    arms = {arm.name: arm for arm in Bench(parse_args(argv)).build_arms()}
    assert arms["ref"].command == [sys.executable, "ref.py", "--x"]
    assert arms["old"].env["PYTHONPATH"] == str(Path("work/old").resolve())


@pytest.mark.parametrize("server", ["aiohttp", "bare"])
def test_sink_servers_read_a_chat_request_and_answer(server: str) -> None:
    """The server-only arms (`python -m epd_proxy_tools.bench.sink`) take the reference's command line."""
    from epd_proxy_tools.testing.harness import free_port
    from epd_proxy_tools.testing.polling import eventually_sync

    port = free_port()
    cmd = [sys.executable, "-m", "epd_proxy_tools.bench.sink", "--server", server, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:1"])
    try:
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            assert proc.poll() is None, "the sink exited"
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                return resp.status == 200

        eventually_sync(answers, timeout=30, interval=0.05, what="the sink did not start", ignoring=(OSError,))
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300_000}]}).encode()
        request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST")
        for _ in range(2):  # the same connection-level state serves the next request too
            with urllib.request.urlopen(request, timeout=10) as resp:
                assert resp.status == 200
                assert json.loads(resp.read())["choices"][0]["message"]["content"] == "ok"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_quick_bench_drives_the_agent_doors(tmp_path: Path, api: str) -> None:
    """`--api` sends the same mix through another door: every answer 200, embeddings from the
    encoders (the consumer decodes the raw images itself but loads their embeddings)."""
    _, _, arms = run_quick_bench(
        tmp_path,
        "--api",
        api,
        *EIGHT_REQUESTS,
        "--arms",
        "batched,direct",
    )
    for arm in arms.values():
        assert arm["errors"] == 0 and arm["measured"] == 8 and arm["pd_requests_per_round"] == 8
    assert arms["batched"]["encoder_subrequests_per_round"] > 0
    assert arms["direct"]["encoder_subrequests_per_round"] == 0


def test_the_agent_doors_pools_are_the_chat_mix_converted(tmp_path: Path) -> None:
    from epd_proxy_tools.bench.workload import WorkloadSpec, get_pool

    spec = WorkloadSpec(requests=3, tiny=True)
    chat = get_pool(spec, tmp_path)
    for api, key in (("responses", "input"), ("messages", "messages")):
        pool = get_pool(spec, tmp_path, api)
        assert pool.images_per_request == chat.images_per_request
        for body, original in zip(pool.bodies, chat.bodies):
            urls = [p["image_url"]["url"] for p in json.loads(original)["messages"][0]["content"] if "image_url" in p]
            parts = json.loads(body)[key][0]["content"]
            if api == "responses":
                got = [p["image_url"] for p in parts if p["type"] == "input_image"]
            else:
                got = [
                    f"data:{p['source']['media_type']};base64,{p['source']['data']}"
                    for p in parts
                    if p["type"] == "image"
                ]
            assert got == urls
