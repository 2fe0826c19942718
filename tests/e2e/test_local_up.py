"""`epd-proxy up` planning, without starting servers."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from epd_proxy_tools.local.stack import LocalStack, StackConfig, assign_cores
from epd_proxy_tools.local.up import main as up_main


def test_cores_two_cpu_box():
    got = assign_cores(2, True, [0, 1])
    assert got == {"encoder-0": "0", "encoder-1": "0", "pd": "1", "baseline": "1"}


def test_cores_two_cpu_box_prefill():
    got = assign_cores(2, True, [0, 1], prefill=True)
    # Decode streams tokens: it keeps a core; prefill runs between encoding and decode.
    assert got == {"encoder-0": "0", "encoder-1": "0", "prefill": "0", "decode": "1", "baseline": "1"}
    assert assign_cores(1, False, list(range(6)), prefill=True) == {
        "encoder-0": "0-1",
        "prefill": "2-3",
        "decode": "4-5",
    }


def test_cores_spread_when_plenty():
    got = assign_cores(1, False, list(range(8)))
    assert got == {"encoder-0": "0-3", "pd": "4-7"}


def test_dry_run_is_shell(capsys):
    work = Path("/nonexistent-epd-dry-run/w")
    rc = up_main(
        ["--encoders", "2", "--baseline", "--dry-run", "--work-dir", str(work), "--port", "8123", "--base-port", "8300"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert not work.exists(), "dry run must not touch the disk"
    # Every line must parse as shell.
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)
    lines = [ln for ln in out.splitlines() if "vllm.entrypoints.openai.api_server" in ln]
    assert len(lines) == 4
    roles = []
    for ln in lines:
        argv = shlex.split(ln)
        cfg = argv[argv.index("--ec-transfer-config") + 1] if "--ec-transfer-config" in argv else None
        roles.append(json.loads(cfg)["ec_role"] if cfg else None)
        assert "--trust-request-mm-kwargs" in argv and "--enforce-eager" in argv
        assert argv[argv.index("--served-model-name") + 1] == "tiny-vlm"
    assert roles == ["ec_producer", "ec_producer", "ec_consumer", None]
    proxy = [ln for ln in out.splitlines() if "epd_proxy serve" in ln]
    assert len(proxy) == 1
    argv = shlex.split(proxy[0])
    assert argv[argv.index("--encode-servers-urls") + 1] == "http://127.0.0.1:8301,http://127.0.0.1:8302"
    assert argv[argv.index("--decode-servers-urls") + 1] == "http://127.0.0.1:8300"
    assert "TMPDIR=" in out and "VLLM_CPU_OMP_THREADS_BIND=1" in out


def _vllm_lines(out: str) -> dict[str, list[str]]:
    """Instance name -> argv of its vLLM command in a dry-run script."""
    names = [ln[2:].split(":")[0] for ln in out.splitlines() if ln.startswith("# ") and "/health" in ln]
    lines = [shlex.split(ln) for ln in out.splitlines() if "vllm.entrypoints.openai.api_server" in ln]
    return dict(zip(names, lines))


def _json_flag(argv: list[str], flag: str):
    return json.loads(argv[argv.index(flag) + 1]) if flag in argv else None


def test_dry_run_prefill_is_e_p_d(capsys):
    work = Path("/nonexistent-epd-dry-run/p")
    rc = up_main(
        ["--prefill", "--encoders", "2", "--baseline", "--dry-run", "--work-dir", str(work), "--base-port", "8300"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert not work.exists(), "dry run must not touch the disk"
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)
    servers = _vllm_lines(out)
    assert list(servers) == ["encoder-0", "encoder-1", "prefill", "decode", "baseline"]
    ec = {n: (_json_flag(a, "--ec-transfer-config") or {}).get("ec_role") for n, a in servers.items()}
    kv = {n: _json_flag(a, "--kv-transfer-config") for n, a in servers.items()}
    assert ec == {
        "encoder-0": "ec_producer",
        "encoder-1": "ec_producer",
        "prefill": "ec_consumer",
        # decode recomputes the prompt's last block, which may hold image tokens
        "decode": "ec_consumer",
        "baseline": None,
    }
    assert kv["prefill"]["kv_role"] == "kv_producer" and kv["decode"]["kv_role"] == "kv_consumer"
    assert kv["encoder-0"] is None and kv["baseline"] is None
    assert {kv[n]["kv_connector"] for n in ("prefill", "decode")} == {"ExampleConnector"}
    store = {kv[n]["kv_connector_extra_config"]["shared_storage_path"] for n in ("prefill", "decode")}
    assert store == {str(work / "kv_store")}
    # Whole blocks move: prefill, decode and the baseline share a small block size.
    blocks = {n: a[a.index("--block-size") + 1] if "--block-size" in a else None for n, a in servers.items()}
    assert blocks == {"encoder-0": None, "encoder-1": None, "prefill": "32", "decode": "32", "baseline": "32"}
    ports = {n: a[a.index("--port") + 1] for n, a in servers.items()}
    assert ports == {"decode": "8300", "encoder-0": "8301", "encoder-1": "8302", "prefill": "8303", "baseline": "8304"}
    (proxy,) = [shlex.split(ln) for ln in out.splitlines() if "epd_proxy serve" in ln]
    assert proxy[proxy.index("--prefill-servers-urls") + 1] == "http://127.0.0.1:8303"
    assert proxy[proxy.index("--decode-servers-urls") + 1] == "http://127.0.0.1:8300"
    mkdir = [ln for ln in out.splitlines() if ln.startswith("mkdir -p ")]
    assert str(work / "kv_store") in mkdir[0], "the KV store folder is created up front"


def test_dry_run_without_prefill_has_no_kv_role(capsys):
    assert up_main(["--dry-run", "--work-dir", "/nonexistent-epd-dry-run/q"]) == 0
    out = capsys.readouterr().out
    assert "--kv-transfer-config" not in out and "--prefill-servers-urls" not in out
    # Prefix reuse counts whole blocks: the PD gets small ones, the encoder (no KV to reuse) none.
    blocks = {n: a[a.index("--block-size") + 1] if "--block-size" in a else None for n, a in _vllm_lines(out).items()}
    assert blocks == {"encoder-0": None, "pd": "32"}


def test_dry_run_with_several_pds_serves_them_all_each_on_a_core(capsys):
    argv = ["--encoders", "2", "--pds", "2", "--dry-run", "--work-dir", "/nonexistent-epd-dry-run/m"]
    assert up_main([*argv, "--base-port", "8300"]) == 0
    out = capsys.readouterr().out
    servers = _vllm_lines(out)
    assert list(servers) == ["encoder-0", "encoder-1", "pd", "pd-1"]
    ports = {n: a[a.index("--port") + 1] for n, a in servers.items()}
    assert ports == {"pd": "8300", "encoder-0": "8301", "encoder-1": "8302", "pd-1": "8303"}
    (proxy,) = [shlex.split(ln) for ln in out.splitlines() if "epd_proxy serve" in ln]
    assert proxy[proxy.index("--decode-servers-urls") + 1] == "http://127.0.0.1:8300,http://127.0.0.1:8303"
    assert assign_cores(2, False, [0, 1], consumers=2) == {"encoder-0": "0", "encoder-1": "1", "pd": "1", "pd-1": "0"}
    with pytest.raises(SystemExit) as refused:
        up_main(["--pds", "0", "--dry-run", "--work-dir", "/nonexistent-epd-dry-run/m"])
    assert refused.value.code == 2


def test_several_prefills_share_one_decode():
    cfg = StackConfig(encoders=1, prefill=True, consumers=2, base_port=9000, work_dir=Path("/nonexistent/w"))
    st = LocalStack(cfg)
    assert [m.name for m in st.instances] == ["encoder-0", "prefill", "prefill-1", "decode"]
    assert st.consumer_urls == ["http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    assert st.proxy.cmd[st.proxy.cmd.index("--prefill-servers-urls") + 1] == ",".join(st.consumer_urls)


def test_local_package_imports_without_torch():
    code = (
        "import sys, epd_proxy_tools.local.up, epd_proxy_tools.local.stack, epd_proxy_tools.local.tiny_model, "
        "epd_proxy_tools.local.fix_vllm_cpu; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_stack_urls():
    st = LocalStack(StackConfig(encoders=3, baseline=True, base_port=9000, port=9100, work_dir=Path("/nonexistent/w")))
    assert st.pd_url == "http://127.0.0.1:9000"
    assert st.encoder_urls == [f"http://127.0.0.1:{p}" for p in (9001, 9002, 9003)]
    assert st.baseline_url == "http://127.0.0.1:9004"
    assert st.proxy_url == "http://127.0.0.1:9100"
    assert st.prefill_url is None


def test_stack_urls_prefill():
    cfg = StackConfig(encoders=2, prefill=True, baseline=True, base_port=9000, work_dir=Path("/nonexistent/w"))
    st = LocalStack(cfg)
    assert st.decode_url == st.pd_url == "http://127.0.0.1:9000"
    assert st.encoder_urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert st.prefill_url == "http://127.0.0.1:9003"
    assert st.baseline_url == "http://127.0.0.1:9004"
    assert [m.name for m in st.instances] == ["encoder-0", "encoder-1", "prefill", "decode", "baseline"]


def test_up_traces_the_whole_stack():
    from epd_proxy.options import parse_into
    from epd_proxy_tools.local.up import COMMAND, build_parser

    argv = ["--prefill", "--otlp-traces-endpoint", "http://127.0.0.1:4317"]
    config, _ = parse_into(build_parser(), argv, COMMAND, {})
    st = LocalStack(config)
    for managed in [*st.instances, st.proxy]:
        cmd = managed.cmd
        assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4317", managed.name
    assert "--otlp-traces-endpoint" not in LocalStack(StackConfig(work_dir=Path("/nonexistent/w"))).proxy.cmd


def test_extra_environment_reaches_every_server_and_not_this_process():
    st = LocalStack(StackConfig(work_dir=Path("/nonexistent/w"), extra_env={"EPD_TEST_ONLY": "1"}))
    assert st.common_env()["EPD_TEST_ONLY"] == "1"
    assert "EPD_TEST_ONLY" not in os.environ


def test_ready_banner_examples_are_runnable():
    from epd_proxy_tools.local.up import ready_banner, tiny_png_data_url

    st = LocalStack(StackConfig(encoders=1, port=8123, work_dir=Path("/nonexistent/w")))
    st.timings["ready_s"] = 1.0
    text = ready_banner(st)
    curl = [ln for ln in text.splitlines() if ln.strip().startswith("-d ")][0]
    body = json.loads(shlex.split(curl.strip())[1])
    assert body["model"] == "tiny-vlm"
    assert body["messages"][0]["content"][1]["image_url"]["url"] == tiny_png_data_url()
    assert body["temperature"] == 0 and "allowed_token_ids" not in body
    assert 'model="tiny-vlm", max_tokens=16, temperature=0,' in text
    assert 'base_url="http://127.0.0.1:8123/v1"' in text
    assert "E+PD stack ready" in text and "pd:" in text and "KV store" not in text


def test_ready_banner_prefill_names_both_instances():
    from epd_proxy_tools.local.up import ready_banner

    st = LocalStack(StackConfig(encoders=1, prefill=True, base_port=9000, work_dir=Path("/nonexistent/w")))
    text = ready_banner(st)
    assert "E+P+D stack ready" in text
    assert "prefill:  http://127.0.0.1:9002" in text and "decode:   http://127.0.0.1:9000" in text
    assert "KV store: /nonexistent/w/kv_store" in text


def test_work_dir_of_a_live_stack_is_not_taken_over():
    import pytest

    from epd_proxy_tools.local.stack import STATE_FILE
    from epd_proxy_tools.local.supervisor import StackError

    repo = Path(__file__).resolve().parents[2]
    work = repo / "work" / "busy-test"
    work.mkdir(parents=True, exist_ok=True)
    # pid 1 stands for a supervisor that is still running
    (work / STATE_FILE).write_text(json.dumps({"owner_pid": 1, "processes": []}))
    try:
        with pytest.raises(StackError, match="in use"):
            LocalStack(StackConfig(work_dir=work))._reap_stale()
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def test_stale_groups_from_a_killed_run_are_stopped():
    import os
    import time

    from epd_proxy_tools.local.stack import STATE_FILE
    from epd_proxy_tools.local.supervisor import group_alive

    repo = Path(__file__).resolve().parents[2]
    work = repo / "work" / "reap-test"
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "import time; time.sleep(300)"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        time.sleep(0.3)
        (work / STATE_FILE).write_text(
            json.dumps(
                {
                    "processes": [
                        {"name": "pd", "pgid": proc.pid, "cmd": cmd},
                        # not ours: command differs, must be left alone
                        {"name": "x", "pgid": os.getpid(), "cmd": ["nope"]},
                    ]
                }
            )
        )
        st = LocalStack(StackConfig(work_dir=work, stop_grace=2.0), progress_stream=open(os.devnull, "w"))
        st._reap_stale()
        assert proc.wait(timeout=5) is not None
        assert not group_alive(proc.pid)
        assert not (work / STATE_FILE).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def test_dry_run_audio_builds_and_serves_the_audio_model(capsys):
    work = Path("/nonexistent-epd-dry-run/a")
    assert up_main(["--model-kind", "audio", "--baseline", "--dry-run", "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert f"epd_proxy_tools.local.tiny_model {work / 'tiny-alm'} --kind audio" in out
    servers = _vllm_lines(out)
    assert list(servers) == ["encoder-0", "pd", "baseline"]
    for argv in servers.values():
        assert argv[argv.index("--served-model-name") + 1] == "tiny-alm"
        assert _json_flag(argv, "--limit-mm-per-prompt") == {"audio": 8}
    assert up_main(["--model-kind", "video", "--dry-run", "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "--kind vision" in out and '{"image": 16, "video": 4}' in out


def test_ready_banner_for_video_and_audio_points_at_a_written_request(tmp_path):
    from epd_proxy_tools.local.up import ready_banner, write_example

    for kind, part_type in (("video", "video_url"), ("audio", "input_audio")):
        st = LocalStack(StackConfig(encoders=1, port=8123, work_dir=tmp_path / kind, model_kind=kind))
        st.work_dir.mkdir(parents=True)
        write_example(st)
        text = ready_banner(st)
        path = st.work_dir / f"example-{kind}.json"
        assert f"-d @{path}" in text and f"json.load(open({str(path)!r}))" in text
        body = json.loads(path.read_text())
        assert body["model"] == ("tiny-alm" if kind == "audio" else "tiny-vlm")
        assert body["messages"][0]["content"][1]["type"] == part_type
        assert body["temperature"] == 0 and "allowed_token_ids" not in body
        assert "temperature=0" in text
