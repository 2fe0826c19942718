"""The command line explains itself: help for every subcommand and flag, usage errors instead of
tracebacks, and a way forward when an optional extra is missing."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from epd_proxy import __version__
from epd_proxy.cli import add_serve_arguments, main
from epd_proxy.config import options
from epd_proxy_tools.bench.runner import build_parser as bench_parser
from epd_proxy_tools.local.up import build_parser as up_parser

ROOT = Path(__file__).resolve().parents[2]
VALID = ["serve", "--encode-servers-urls", "http://127.0.0.1:1", "--decode-servers-urls", "http://127.0.0.1:2"]


def run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "epd_proxy", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


@pytest.mark.parametrize("command", [[], ["serve"], ["up"], ["bench"]], ids=["top", "serve", "up", "bench"])
def test_every_subcommand_has_help(command):
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith(f"usage: epd-proxy {' '.join(command)}".rstrip())


def test_top_level_help_describes_the_product_and_lists_every_subcommand():
    out = run("--help").stdout
    assert "encoder-disaggregated" in out and "vLLM" in out
    listed = re.findall(r"^    (\w+) ", out, flags=re.M)
    assert listed == ["serve", "up", "bench"]


@pytest.mark.parametrize("parser", [serve_parser, up_parser, bench_parser], ids=["serve", "up", "bench"])
def test_every_flag_has_a_help_text(parser):
    undocumented = [
        action.option_strings[0]
        for action in parser()._actions
        if not isinstance(action, argparse._HelpAction) and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert undocumented == []


def test_serve_help_lists_every_environment_variable_it_reads():
    read = {declared.env for _, _, declared in options() if declared.env}
    assert {"ENCODER_MAX_BATCH_SIZE", "OPENAI_API_KEY", "ADMIN_API_KEY"} <= read
    help_text = run("serve", "--help").stdout
    assert [name for name in sorted(read) if name not in help_text] == []


def test_version_matches_the_package():
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"epd-proxy {__version__}"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


@pytest.mark.parametrize(
    "flags, complaint",
    [
        (["--log-level", "foo"], "argument --log-level: invalid choice"),
        (["--media-hash", "md5"], "argument --media-hash: invalid choice"),
        (["--probe-timeout", "0"], "argument --probe-timeout: must be > 0"),
        (["--probe-timeout", "soon"], "argument --probe-timeout: expected a number of seconds"),
        (["--probe-interval", "-1"], "argument --probe-interval: must be >= 0"),
        (["--max-connections-per-backend", "-1"], "argument --max-connections-per-backend: must be >= 0"),
        (["--max-inflight", "-5"], "argument --max-inflight: must be >= 0"),
        (["--workers", "0"], "argument --workers: must be >= 1"),
        (["--fail-threshold", "0"], "argument --fail-threshold: must be >= 1"),
        (["--consecutive-5xx", "-1"], "argument --consecutive-5xx: must be >= 0"),
        (["--encode-timeout", "-3"], "argument --encode-timeout: must be >= 0"),
        (["--port", "70000"], "argument --port: must be within 0..65535"),
        (["--decode-retries", "-5"], "argument --decode-retries: must be >= 0, got -5"),
        (["--ejection-time", "0"], "argument --ejection-time: must be > 0 seconds, got 0"),
        (["--max-ejection-percent", "101"], "argument --max-ejection-percent: must be within 0..100, got 101"),
        (["--connect-timeout", "0"], "argument --connect-timeout: must be > 0 seconds"),
        (["--ec-consumer-dp-size", "two"], "argument --ec-consumer-dp-size: expected an integer, got 'two'"),
        (
            ["--encoder-max-batch-size", "-1"],
            "argument --encoder-max-batch-size (or ENCODER_MAX_BATCH_SIZE): must be >= 0",
        ),
        (["--roster", "etcd://h:2379"], "argument --roster: must be a redis://, rediss:// or unix:// URL"),
        (["--encode-servers-urls", "localhost:8001"], "'localhost:8001' is not an http:// or https:// URL"),
        (["--decode-servers-urls", "http://d:1,d2:8002"], "'d2:8002' is not an http:// or https:// URL"),
        (["--prefill-servers-urls", "ftp://p:1"], "'ftp://p:1' is not an http:// or https:// URL"),
        (["--decode-servers-urls", "http://d:99999"], "'http://d:99999' has an invalid port"),
        # One server cannot take two roles; the registry found this only after startup, as a traceback.
        (
            ["--encode-servers-urls", "http://x:1", "--decode-servers-urls", "http://x:1/"],
            "http://x:1 is listed twice; each instance has one role",
        ),
        (["--encode-servers-urls", "http://e:1,http://e:1"], "http://e:1 is listed twice"),
    ],
)
def test_invalid_values_are_usage_errors(flags, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*VALID, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: epd-proxy serve")
    assert complaint in err


def test_bad_environment_is_a_usage_error_too(monkeypatch, capsys):
    monkeypatch.setenv("ENCODER_MAX_BATCH_SIZE", "lots")
    with pytest.raises(SystemExit) as exit_info:
        main(VALID)
    assert exit_info.value.code == 2
    assert "ENCODER_MAX_BATCH_SIZE: expected an integer, got 'lots'" in capsys.readouterr().err


def test_a_real_process_prints_a_message_not_a_traceback():
    result = run(*VALID, "--log-level", "foo")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "error: argument --log-level" in result.stderr


def test_lower_case_log_level_is_accepted():
    parsed = serve_parser().parse_args(["--log-level", "debug"])
    assert parsed.log_level == "DEBUG"


def hiding(module: str, *argv: str) -> str:
    """A program that runs the CLI as on a machine where `module` is not installed."""
    return f"import sys; sys.modules[{module!r}] = None\nfrom epd_proxy.cli import main\nraise SystemExit(main({list(argv)!r}))\n"


@pytest.mark.parametrize("command, extra", [("up", "local"), ("bench", "bench")])
def test_missing_extra_says_how_to_install_it(command, extra):
    # Hide the extra's first module, as on a machine with the tools but not their extra.
    hide = {"up": "vllm", "bench": "numpy"}[command]
    result = run(code=hiding(hide, command))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"pip install 'epd-proxy-tools[{extra}]'" in result.stderr
    assert f"missing: {hide}" in result.stderr
    # Help needs no extra.
    helped = run(code=hiding(hide, command, "--help"))
    assert helped.returncode == 0 and "usage: epd-proxy" in helped.stdout


@pytest.mark.parametrize("command, extra", [("up", "local"), ("bench", "bench")])
def test_the_proxy_alone_says_its_tools_are_a_distribution_of_their_own(command, extra):
    for argv in ([command], [command, "--help"]):
        result = run(code=hiding("epd_proxy_tools", *argv))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert (
            f"pip install 'epd-proxy-tools[{extra}]'" in result.stderr and "missing: epd_proxy_tools" in result.stderr
        )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_port_is_a_message_not_a_traceback(workers):
    """With --workers too: a worker that cannot open the port is not restarted in a loop, the
    command fails."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(*VALID, "--host", "127.0.0.1", "--port", str(port), "--probe-interval", "0", "--workers", workers)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"epd-proxy serve: cannot serve on 127.0.0.1:{port}" in result.stderr
