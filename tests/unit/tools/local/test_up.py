"""`epd-proxy up`'s declarations and the checks it makes before it builds anything (no vLLM)."""

from __future__ import annotations

import argparse
import json
import os
import socket
from contextlib import ExitStack
from pathlib import Path

import pytest

from epd_proxy.options import options, parse_into
from epd_proxy_tools.local.stack import DEFAULT_LIMITS, LocalStack, StackConfig
from epd_proxy_tools.local.supervisor import StackError
from epd_proxy_tools.local.up import COMMAND, UpRun, build_parser, ready_banner
from epd_proxy_tools.local.up import main as up_main


def parse(*argv: str, env: dict[str, str] | None = None) -> tuple[StackConfig, UpRun]:
    config, run = parse_into(build_parser(), list(argv), COMMAND, env or {})
    return config, run


def test_no_flags_is_the_declared_defaults():
    config, run = parse()
    assert config == StackConfig() and run == UpRun()
    assert (config.encoders, config.port, config.base_port, config.health_timeout) == (1, 8000, 8200, 240.0)
    assert LocalStack(config).work_dir == Path.cwd() / "work" / "local-stack"


def test_every_flag_is_a_declaration_and_none_is_read_from_the_environment():
    declared = [(name, option_) for cls in COMMAND for name, _, option_ in options(cls)]
    flags = {action.dest for action in build_parser()._actions if not isinstance(action, argparse._HelpAction)}
    assert flags == {name for name, _ in declared}
    assert [name for name, option_ in declared if option_.env] == []
    # So a variable named like a field changes nothing.
    assert parse(env={"PORT": "1", "ENCODERS": "3", "WORK_DIR": "/x"}) == parse()


def test_flags_reach_the_stack():
    config, run = parse(
        "--encoders", "3", "--prefill", "--no-lean", "--vllm-args", "--seed 'a b'", "--proxy-args", "--log-level DEBUG",
        "--work-dir", "/tmp/w", "--health-timeout", "30", "--model-kind", "audio", "--dry-run",
    )  # fmt: skip
    assert (config.encoders, config.prefill, config.lean, config.health_timeout) == (3, True, False, 30.0)
    assert config.extra_vllm_args == ("--seed", "a b") and config.proxy_args == ("--log-level", "DEBUG")
    assert config.work_dir == Path("/tmp/w") and config.model_kind == "audio" and run.dry_run


def test_help_says_each_default_from_its_declaration():
    text = build_parser().format_help()
    assert "(default: 240)" in text and "(default: 8200)" in text
    for limits in DEFAULT_LIMITS.values():
        assert limits.replace(" ", "") in text.replace(" ", "").replace("\n", "")


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["--encoders", "0"], "argument --encoders: must be >= 1, got 0"),
        (["--kv-block-size", "0"], "argument --kv-block-size: must be >= 1, got 0"),
        (["--port", "70000"], "argument --port: must be within 0..65535, got 70000"),
        (["--health-timeout", "0"], "argument --health-timeout: must be > 0 seconds, got 0"),
        (["--model-kind", "text"], "argument --model-kind: invalid choice: 'text'"),
    ],
)
def test_bad_values_are_usage_errors(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        up_main([*argv, "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: epd-proxy up") and complaint in err


def _free_ports(count: int) -> list[int]:
    """`count` consecutive free loopback ports: up's instances sit next to each other."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        start = probe.getsockname()[1]
    for base in range(start, start + 2000):
        with ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return list(range(base, base + count))
    raise RuntimeError("no free consecutive ports")


def _free_stack_argv(work_dir: Path) -> tuple[int, list[str]]:
    """`up`'s arguments with every port the default stack takes free: the proxy's, the instances'
    (next to each other from --base-port) and the PD's two KV-event ports."""
    ports = _free_ports(8)
    proxy_port, base_port, kv_port = ports[0], ports[1], ports[6]
    argv = ["--port", str(proxy_port), "--base-port", str(base_port), "--kv-events-port", str(kv_port)]
    return proxy_port, [*argv, "--work-dir", str(work_dir)]


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Every tiny-model build `up` starts; the build itself stops the run, as no vLLM is here."""
    built: list[Path] = []

    def build(stack: LocalStack) -> None:
        built.append(stack.model_dir)
        raise StackError("stopped at the model build")

    monkeypatch.setattr(LocalStack, "_build_tiny_model", build)
    return built


def test_a_taken_port_fails_before_the_model_is_built(builds, tmp_path, capsys):
    proxy_port, argv = _free_stack_argv(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", proxy_port))
        taken.listen()
        assert up_main(argv) == 1
    assert builds == []
    err = capsys.readouterr().err
    assert f"ports already in use: proxy:{proxy_port}" in err and "--base-port/--port" in err
    assert not (tmp_path / "logs").exists(), "nothing was set up for the stack"


def test_with_the_ports_free_the_model_build_comes_next(builds, tmp_path, capsys):
    """The control of the test above: the same run, no port taken, reaches the build."""
    _, argv = _free_stack_argv(tmp_path)
    assert up_main(argv) == 1
    assert builds == [tmp_path.resolve() / "tiny-vlm"]
    assert "stopped at the model build" in capsys.readouterr().err
    assert os.path.isdir(tmp_path / "logs")


def _kv_config(cmd: list[str]) -> dict | None:
    return json.loads(cmd[cmd.index("--kv-events-config") + 1]) if "--kv-events-config" in cmd else None


def test_pd_publishes_kv_events_by_default_and_the_banner_says_where():
    stack = LocalStack(StackConfig(encoders=2, baseline=True))
    configs = {m.name: _kv_config(m.cmd) for m in stack.instances}
    assert configs == {
        "encoder-0": None,
        "encoder-1": None,
        "pd": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:8300",
            "replay_endpoint": "tcp://*:8301",
        },
        "baseline": None,
    }
    banner = ready_banner(stack)
    assert (
        "KV events: pd tcp://127.0.0.1:8300, replay tcp://127.0.0.1:8301; http://127.0.0.1:8200/kv_event_sources"
        in (" ".join(banner.split()))
    )
    assert "--kv-events-config" in stack.shell_script()
    off = LocalStack(StackConfig(kv_events=False))
    assert all(_kv_config(m.cmd) is None for m in off.instances) and "KV events" not in ready_banner(off)


def test_every_prefill_and_decode_rank_publishes_on_ports_of_its_own():
    config = StackConfig(
        prefill=True, consumers=2, base_port=9000, kv_events_port=9500, extra_vllm_args=("--data-parallel-size", "2")
    )
    stack = LocalStack(config)
    configs = {m.name: _kv_config(m.cmd) for m in stack.instances if _kv_config(m.cmd)}
    assert {name: (c["endpoint"], c["replay_endpoint"]) for name, c in configs.items()} == {
        "prefill": ("tcp://*:9500", "tcp://*:9502"),
        "prefill-1": ("tcp://*:9504", "tcp://*:9506"),
        "decode": ("tcp://*:9508", "tcp://*:9510"),
    }
    # vLLM adds the rank to both ports: every rank's pair is free of every other's and of HTTP's.
    taken = [port for ports in stack.kv_event_ports().values() for port in ports.ports()]
    http = [int(m.health_url.rsplit(":", 1)[1].split("/")[0]) for m in stack.all_processes()]
    assert sorted(taken) == list(range(9500, 9512)) and not set(taken) & set(http)
    assert parse("--kv-events-port", "9500", "--no-kv-events")[0].kv_events is False


def test_a_taken_kv_event_port_fails_before_the_model_is_built(builds, tmp_path, capsys):
    # The port taken is one of those found free too: another process may hold the next one.
    proxy_port, base_port, kv_port, _ = _free_ports(4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", kv_port + 1))
        taken.listen()
        argv = ["--port", str(proxy_port), "--base-port", str(base_port), "--kv-events-port", str(kv_port)]
        assert up_main([*argv, "--work-dir", str(tmp_path)]) == 1
    assert builds == []
    assert f"pd KV events:{kv_port + 1}" in capsys.readouterr().err
