"""Options declared once, on the fields of a dataclass: each field's `option(...)` says its flag,
environment variable, kind and help, and the command line, the environment, the checks, `--help`
and the Markdown flag table all come from that. `serve` (config.py), `up` (tools/local) and
`bench` (tools/bench) declare theirs this way.

A value is checked once, when the dataclass is built, whichever way it arrived: the command line
only turns text into values, so a flag out of its limits and a field set out of its limits in code
fail with the same message.
"""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A configuration that cannot run; raised at startup, never per request."""


class Kind:
    """What an option's text means (`parse`, which raises ValueError on text that is not of the
    kind) and which values it takes (`problem`, None when the value is fine)."""

    # Text is taken as written (a key may hold spaces); other kinds strip it, and an empty
    # environment variable counts as unset.
    verbatim: ClassVar[bool] = False
    # Given again, the flag adds one more value to a list.
    repeatable: ClassVar[bool] = False

    @property
    def metavar(self) -> str:
        """`--help`'s name for the value; a kind overrides it with a constant or a property."""
        return "TEXT"

    def parse(self, text: str) -> Any:
        return text

    def problem(self, value: Any) -> str | None:
        return None


@dataclass(frozen=True)
class Text(Kind):
    # When set, a non-empty value must be a URL with one of these schemes.
    schemes: tuple[str, ...] = ()
    verbatim: ClassVar[bool] = True

    def problem(self, value: str | None) -> str | None:
        if value and self.schemes and value.split("://", 1)[0] not in self.schemes:
            names = [f"{scheme}://" for scheme in self.schemes]
            return f"must be a {', '.join(names[:-1])} or {names[-1]} URL, got {value!r}"
        return None


@dataclass(frozen=True)
class Texts(Kind):
    """A flag given once per value; the field holds them in order."""

    repeatable: ClassVar[bool] = True


@dataclass(frozen=True)
class Words(Kind):
    """One shell-quoted string: the field holds its words."""

    metavar: ClassVar[str] = "ARGS"

    def parse(self, text: str) -> tuple[str, ...]:
        import shlex

        return tuple(shlex.split(text))


@dataclass(frozen=True)
class Folder(Kind):
    metavar: ClassVar[str] = "DIR"

    def parse(self, text: str) -> Path:
        return Path(text)


@dataclass(frozen=True)
class Switch(Kind):
    """A flag without a value: giving it sets the field to `value`."""

    value: bool = True


@dataclass(frozen=True)
class Count(Kind):
    minimum: int = 0
    maximum: int | None = None
    metavar: ClassVar[str] = "N"

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None

    def problem(self, value: int) -> str | None:
        if self.maximum is not None and not self.minimum <= value <= self.maximum:
            return f"must be within {self.minimum}..{self.maximum}, got {value}"
        if value < self.minimum:
            return f"must be >= {self.minimum}, got {value}"
        return None


def _number(text: str, what: str) -> float:
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if math.isnan(number):
        raise ValueError(f"expected {what}, got {text!r}")
    return number


@dataclass(frozen=True)
class Real(Kind):
    """A number in some unit other than seconds (milliseconds, a share, a factor); `unit` is its
    metavar."""

    unit: str = "X"
    minimum: float | None = None
    # The minimum itself is refused.
    exclusive: bool = False
    # Set with a minimum: the value lies between the two (a share from 0 to 1).
    maximum: float | None = None

    @property
    def metavar(self) -> str:
        return self.unit

    def parse(self, text: str) -> float:
        return _number(text, "a number")

    def problem(self, value: float) -> str | None:
        if self.minimum is None:
            return None
        if self.maximum is not None and not self.minimum <= value <= self.maximum:
            return f"must be within {self.minimum:g}..{self.maximum:g}, got {value:g}"
        if value < self.minimum or (self.exclusive and value == self.minimum):
            return f"must be {'>' if self.exclusive else '>='} {self.minimum:g}, got {value:g}"
        return None


@dataclass(frozen=True)
class Number(Kind):
    """Seconds, any value: what a negative one means is the option's to say."""

    metavar: ClassVar[str] = "SECONDS"

    def parse(self, text: str) -> float:
        return _number(text, "a number of seconds")


@dataclass(frozen=True)
class Seconds(Kind):
    # 0 refused; with `zero_is_none`, a 0 on the command line means no limit (None).
    positive: bool = False
    zero_is_none: bool = False
    metavar: ClassVar[str] = "SECONDS"

    def parse(self, text: str) -> float | None:
        number = _number(text, "a number of seconds")
        return None if self.zero_is_none and number == 0 else number

    def problem(self, value: float | None) -> str | None:
        if value is None:  # no limit: only a kind that has one in `zero_is_none` takes it
            return None if self.zero_is_none else "must be a number of seconds, got None"
        if self.zero_is_none:
            if value > 0:
                return None
            if value == 0:
                return "must be > 0 seconds, or None for no limit, got 0"
            return f"must be >= 0 seconds (0 = none), got {value:g}"
        if value < 0 or (value == 0 and self.positive):
            return f"must be {'> 0' if self.positive else '>= 0'} seconds, got {value:g}"
        return None


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...]
    upper: bool = False  # any case on the command line

    @property
    def metavar(self) -> str:
        return "{" + ",".join(self.choices) + "}"

    def parse(self, text: str) -> str:
        return text.upper() if self.upper else text

    def problem(self, value: str) -> str | None:
        if value not in self.choices:
            return f"invalid choice: {value!r} (choose from {', '.join(self.choices)})"
        return None


@dataclass(frozen=True)
class Choices(Kind):
    """A comma list of some of `choices`; empty is none."""

    choices: tuple[str, ...]

    @property
    def metavar(self) -> str:
        return "{" + ",".join(self.choices) + "},..."

    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(word for word in (w.strip() for w in text.split(",")) if word)

    def problem(self, value: tuple[str, ...]) -> str | None:
        unknown = [word for word in value if word not in self.choices]
        if unknown:
            return f"invalid choice: {unknown[0]!r} (choose from {', '.join(self.choices)})"
        return None


@dataclass(frozen=True, slots=True)
class Option:
    kind: Kind
    # Markdown, for the flag tables; `--help` shows it without the markup.
    help: str
    flag: str | None = None
    env: str | None = None
    # The `--help` section; None: the parser's own options.
    group: str | None = None
    metavar: str | None = None
    # How the default reads, when not as the value itself: a value, or a sentence with spaces.
    shown: str | None = None

    @property
    def label(self) -> str:
        """How an error names the option."""
        if self.flag and self.env:
            return f"argument {self.flag} (or {self.env})"
        return f"argument {self.flag}" if self.flag else self.env or ""


def option(default: Any, kind: Kind, help: str, **declaration: Any) -> Any:
    return field(default=default, metadata={"option": Option(kind, help, **declaration)})


def options(declared: type) -> list[tuple[str, Any, Option]]:
    """A dataclass's options as (field name, default, declaration), in the order of its fields;
    fields without one (settings only code sets) are left out."""
    return [
        (item.name, item.default, item.metadata["option"]) for item in fields(declared) if "option" in item.metadata
    ]


def check(instance: Any) -> None:
    """Every option's own limits; a None where the default is None means unset."""
    for name, default, declared in options(type(instance)):
        value = getattr(instance, name)
        if value is None and default is None:
            continue
        if problem := declared.kind.problem(value):
            raise ConfigError(f"{declared.label}: {problem}")


def from_sources(declared: type, given: Mapping[str, Any], env: Mapping[str, str]) -> Any:
    """An instance of `declared` from a command line: `given` (field name to value, other names
    ignored) wins over an option's environment variable, which wins over its default."""
    names = {item.name for item in fields(declared)}
    values = {name: value for name, value in given.items() if name in names}
    for name, _, option_ in options(declared):
        if name in values or option_.env is None or (text := env.get(option_.env)) is None:
            continue
        if not option_.kind.verbatim:
            text = text.strip()
            if not text:
                continue
        try:
            parsed = option_.kind.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{option_.env}: {exc}") from None
        values[name] = (parsed,) if option_.kind.repeatable else parsed
    return declared(**values)


def shown_default(default: Any, declared: Option) -> tuple[str, bool]:
    """How an option's default reads, and whether that is a literal value (set in code in a table)."""
    if declared.shown is not None:
        # A value (`none`, a path) is code; a sentence is not.
        return declared.shown, " " not in declared.shown
    if isinstance(declared.kind, Switch):
        return "off", False
    if declared.kind.repeatable and default == ():
        return "none", False
    if default in ("", ()):
        return "empty", False
    if default is None:
        return "none", False
    if isinstance(default, float) and default.is_integer():
        return str(int(default)), True
    return str(default), True


def plain(markdown: str) -> str:
    """An option's help without its Markdown: links keep their text, code loses its backticks."""
    return re.sub(r"\[([^]]+)\]\([^)]*\)", r"\1", markdown).replace("`", "")


def flag_help(default: Any, declared: Option) -> str:
    text = plain(declared.help)
    if not isinstance(declared.kind, Switch):
        shown = plain(shown_default(default, declared)[0])
        text += f" (default: ${declared.env} or {shown})" if declared.env else f" (default: {shown})"
    return text.replace("%", "%%")


def _argument_type(kind: Kind):
    """The option's own parse, its complaint shown as argparse shows a bad value."""

    def parse(text: str) -> Any:
        try:
            return kind.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_arguments(parser: argparse.ArgumentParser, declared: Iterable[type], groups: Iterable[str] = ()) -> None:
    """One flag per declared option, in `groups` (made in this order) or on the parser. A flag
    not given stays out of the namespace, so that its environment variable, then its default,
    apply (from_sources)."""
    sections: dict[str | None, Any] = {title: parser.add_argument_group(title) for title in groups}
    sections[None] = parser
    for cls in declared:
        for name, default, option_ in options(cls):
            if option_.flag is None:
                continue
            common = {"dest": name, "default": argparse.SUPPRESS, "help": flag_help(default, option_)}
            if option_.group not in sections:
                sections[option_.group] = parser.add_argument_group(option_.group)
            section = sections[option_.group]
            if isinstance(option_.kind, Switch):
                section.add_argument(option_.flag, action="store_const", const=option_.kind.value, **common)
                continue
            metavar = option_.metavar or option_.kind.metavar
            action = "append" if option_.kind.repeatable else "store"
            section.add_argument(
                option_.flag, action=action, type=_argument_type(option_.kind), metavar=metavar, **common
            )


def parse_into(
    parser: argparse.ArgumentParser, argv: list[str] | None, declared: Iterable[type], env: Mapping[str, str]
) -> list[Any]:
    """`argv` parsed into one instance of each class; a value their checks refuse is a usage
    error of the command (exit 2), shown with its usage."""
    given = vars(parser.parse_args(argv))
    try:
        return [from_sources(cls, given, env) for cls in declared]
    except ConfigError as exc:
        parser.error(str(exc))


def environment_help(declared: type) -> str:
    """The variables a command reads, for the end of its --help."""
    lines = ["environment:"]
    for _, default, option_ in options(declared):
        if option_.env is None:
            continue
        if option_.flag:
            text = f"{option_.flag} when the flag is not given"
        else:
            text = f"{plain(option_.help)} (default: {shown_default(default, option_)[0]})"
        first, *rest = textwrap.wrap(text, 64)
        lines.append(f"  {option_.env:<30}{first}")
        lines.extend(" " * 32 + line for line in rest)
    return "\n".join(lines)


def markdown_table(declared: type) -> str:
    """A command's options as a Markdown table."""
    rows = ["| Flag / env | Default | Meaning |", "|---|---|---|"]
    for _, default, option_ in options(declared):
        names = [f"`{option_.flag}`"] if option_.flag else []
        if option_.env:
            names.append(f"env `{option_.env}`")
        text, literal = shown_default(default, option_)
        meaning = option_.help + ("; the flag wins over the env" if option_.flag and option_.env else "")
        rows.append(f"| {', '.join(names)} | {f'`{text}`' if literal else text} | {meaning} |")
    return "\n".join(rows) + "\n"
