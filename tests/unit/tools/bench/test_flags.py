"""`epd-proxy bench`'s declarations: both modes, their defaults said once, and one --help."""

from __future__ import annotations

import argparse

import pytest

from epd_proxy.cli import main as cli_main
from epd_proxy.options import options, parse_into
from epd_proxy_tools.bench import real, runner
from epd_proxy_tools.bench.flags import (
    CACHE_DIR,
    PRESETS,
    REAL_QUICK,
    SEED,
    FakeBenchOptions,
    RealBenchOptions,
)


def parse_real(*argv: str) -> RealBenchOptions:
    (parsed,) = parse_into(real.build_parser(), list(argv), [RealBenchOptions], {})
    return parsed


def test_no_flags_is_the_declared_defaults_in_both_modes():
    fake, stack = runner.parse_args([]), parse_real("--stack")
    assert fake == FakeBenchOptions() and stack == RealBenchOptions(stack=True)
    assert (fake.seed, fake.cache_dir) == (stack.seed, stack.cache_dir) == (SEED, CACHE_DIR)
    assert (fake.encoders, stack.encoders, stack.base_port) == (4, 2, 18600)


@pytest.mark.parametrize(
    "declared, parser", [(FakeBenchOptions, runner.build_parser), (RealBenchOptions, real.build_parser)]
)
def test_every_flag_is_a_declaration_and_none_is_read_from_the_environment(declared, parser):
    flags = {action.dest for action in parser()._actions if not isinstance(action, argparse._HelpAction)}
    assert flags == {name for name, _, _ in options(declared)}
    assert [name for name, _, option_ in options(declared) if option_.env] == []


def test_bench_help_shows_the_real_engine_mode(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: epd-proxy bench")
    fake_part, real_part = out.split("real-engine mode", 1)
    assert "--pool-size" in fake_part and "--stack" not in fake_part
    for flag in ("--stack", "--encode-urls", "--decode-urls", "--conversations", "--stack-dir", "--no-reset"):
        assert flag in real_part, flag


def test_preset_counts_are_the_defaults_a_flag_overrides(tmp_path):
    quick = runner.Bench(runner.parse_args(["--quick", "--out", str(tmp_path)]))
    assert (
        (quick.pool_size, quick.requests, quick.warmup)
        == (24, 48, 16)
        == tuple(getattr(PRESETS["quick"], name) for name in ("pool_size", "requests", "warmup"))
    )
    chosen = runner.Bench(runner.parse_args(["--quick", "--pool-size", "5", "--warmup", "0", "--out", str(tmp_path)]))
    assert (chosen.pool_size, chosen.warmup) == (5, 0)
    assert "(default: quick 24, full 128)" in runner.build_parser().format_help()


def test_real_quick_sets_its_counts_whatever_else_is_given(tmp_path):
    bench = real.RealBench(parse_real("--stack", "--quick", "--rounds", "5", "--out", str(tmp_path)))
    assert {name: getattr(bench.args, name) for name in REAL_QUICK} == REAL_QUICK
    assert real.RealBench(parse_real("--stack", "--rounds", "5", "--out", str(tmp_path))).args.rounds == 5


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["--encoders", "0"], "argument --encoders: must be >= 1, got 0"),
        (["--encoder-ms", "-1"], "argument --encoder-ms: must be >= 0, got -1"),
        (["--pool-size", "many"], "argument --pool-size: expected an integer, got 'many'"),
    ],
)
def test_bad_values_are_usage_errors(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        runner.parse_args(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_repeated_flags_collect_in_order():
    parsed = runner.parse_args(["--proxy-env", "A=1", "--proxy-env", "B=2", "--variant", "v:X=1"])
    assert list(parsed.proxy_env) == ["A=1", "B=2"] and list(parsed.variant) == ["v:X=1"]
    assert list(parse_real("--stack", "--proxy", "a=epd-proxy serve", "--proxy", "b=python x.py").proxy) == [
        "a=epd-proxy serve",
        "b=python x.py",
    ]
