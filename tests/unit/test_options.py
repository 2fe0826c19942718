"""The option machinery on a made-up command, apart from any real one's declarations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from epd_proxy.options import (
    Choice,
    Choices,
    ConfigError,
    Count,
    Folder,
    Real,
    Seconds,
    Switch,
    Text,
    Texts,
    Words,
    add_arguments,
    check,
    environment_help,
    from_sources,
    markdown_table,
    option,
    options,
    parse_into,
    shown_default,
)

SECTION = "tuning"


@dataclass(frozen=True)
class Made:
    size: int = option(3, Count(1, 9), "how many", flag="--size", env="MADE_SIZE")
    colour: str = option("red", Choice(("red", "blue")), "which `colour`", flag="--colour", group=SECTION)
    shades: tuple[str, ...] = option((), Choices(("red", "blue")), "some colours", flag="--shades")
    share: float = option(0.5, Real("SHARE", 0, exclusive=True, maximum=1), "a share", flag="--share", group=SECTION)
    wait_s: float | None = option(None, Seconds(), "seconds", flag="--wait", shown="forever")
    loud: bool = option(False, Switch(), "say more", flag="--loud")
    quiet: bool = option(True, Switch(False), "say less", flag="--no-quiet")
    tags: tuple[str, ...] = option((), Texts(), "a tag (repeatable)", flag="--tag", env="MADE_TAG")
    words: tuple[str, ...] = option((), Words(), "extra words", flag="--words")
    home: Path = option(Path("work/made"), Folder(), "a folder", flag="--home")
    secret: str = option("", Text(), "read only from the environment", env="MADE_SECRET")
    unflagged: int = 7  # set only in code: no option

    def __post_init__(self) -> None:
        check(self)


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="made")
    add_arguments(made, [Made], [SECTION])
    return made


def parse(*argv: str, env: dict[str, str] | None = None) -> Made:
    (made,) = parse_into(parser(), list(argv), [Made], env or {})
    return made


def test_only_declared_fields_are_options_in_field_order():
    names = [name for name, _, _ in options(Made)]
    assert names == ["size", "colour", "shades", "share", "wait_s", "loud", "quiet", "tags", "words", "home", "secret"]


def test_nothing_given_is_every_default():
    assert parse() == Made()


def test_flag_wins_over_env_which_wins_over_default():
    assert parse(env={"MADE_SIZE": "5"}).size == 5
    assert parse("--size", "6", env={"MADE_SIZE": "5"}).size == 6
    assert parse(env={"MADE_SIZE": "  "}).size == 3, "an empty variable is unset"
    assert parse(env={"MADE_SECRET": " k "}).secret == " k ", "text is taken as written"
    assert parse(env={"MADE_TAG": "a"}).tags == ("a",), "a repeatable flag's variable is one value"
    assert parse("--tag", "b", env={"MADE_TAG": "a"}).tags == ["b"]


def test_every_kind_parses_its_text():
    made = parse(
        "--colour", "blue", "--shades", "blue, red", "--share", "0.25", "--wait", "1.5", "--loud", "--no-quiet",
        "--tag", "a", "--tag", "b", "--words", "-x 'two words'", "--home", "/tmp/h",
    )  # fmt: skip
    assert (made.colour, made.share, made.wait_s, made.loud, made.quiet) == ("blue", 0.25, 1.5, True, False)
    assert made.shades == ("blue", "red") and parse("--shades", "").shades == ()
    assert made.tags == ["a", "b"] and made.words == ("-x", "two words") and made.home == Path("/tmp/h")


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["--size", "0"], "argument --size (or MADE_SIZE): must be within 1..9, got 0"),
        (["--share", "0"], "argument --share: must be > 0, got 0"),
        (["--share", "1.5"], "argument --share: must be within 0..1, got 1.5"),
        (["--share", "half"], "argument --share: expected a number, got 'half'"),
        (["--colour", "green"], "argument --colour: invalid choice: 'green' (choose from red, blue)"),
        (["--shades", "red,green"], "argument --shades: invalid choice: 'green' (choose from red, blue)"),
        (["--wait", "-1"], "argument --wait: must be >= 0 seconds, got -1"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_flag(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: made") and complaint in err


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="MADE_SIZE: expected an integer, got 'many'"):
        from_sources(Made, {}, {"MADE_SIZE": "many"})


def test_values_set_in_code_are_checked_as_flags_are():
    with pytest.raises(ConfigError, match="argument --size"):
        Made(size=10)
    assert Made(wait_s=None).wait_s is None, "None stays the unset default"


def test_no_limit_in_code_for_seconds_that_have_one_is_a_clear_error():
    """None where the default is a number of seconds: a ConfigError that says so, not a TypeError."""

    @dataclass(frozen=True)
    class Timed:
        wait_s: float = option(5.0, Seconds(), "seconds", flag="--wait")

        def __post_init__(self) -> None:
            check(self)

    with pytest.raises(ConfigError, match="argument --wait: must be a number of seconds, got None"):
        Timed(wait_s=None)


def test_help_shows_each_default_once_in_its_section():
    text = parser().format_help()
    assert "how many (default: $MADE_SIZE or 3)" in text
    assert "seconds (default: forever)" in text
    assert "which colour (default: red)" in text, "Markdown is dropped in --help"
    assert "say more\n" in text and "(default: off)" not in text, "a switch shows no default"
    own, tuning = text[text.index("options:") :].split("tuning:")
    assert "--size" in own and "--colour" in tuning and "--share" in tuning and "--colour" not in own
    assert "--secret" not in text and "--unflagged" not in text


def test_shown_defaults():
    declared = {name: (default, option_) for name, default, option_ in options(Made)}
    assert shown_default(*declared["tags"]) == ("none", False)
    assert shown_default(*declared["wait_s"]) == ("forever", True), "a one-word default reads as a value"
    assert shown_default(*declared["words"]) == ("empty", False)
    assert shown_default(*declared["home"]) == ("work/made", True)
    assert shown_default(*declared["loud"]) == ("off", False)


def test_markdown_table_and_environment_help():
    table = markdown_table(Made).splitlines()
    assert table[:2] == ["| Flag / env | Default | Meaning |", "|---|---|---|"]
    assert table[2] == "| `--size`, env `MADE_SIZE` | `3` | how many; the flag wins over the env |"
    assert "| env `MADE_SECRET` | empty | read only from the environment |" in table
    assert len(table) == 2 + len(options(Made))
    env = environment_help(Made)
    assert "MADE_SIZE" in env and "--size when the flag is not given" in env and "MADE_SECRET" in env
