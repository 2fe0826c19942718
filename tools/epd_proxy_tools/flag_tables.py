"""`python -m epd_proxy_tools.flag_tables [COMMAND]`: a command's flag table in Markdown, from its
declarations (options.py), for the docs; without COMMAND, docs/commands.md whole."""

from __future__ import annotations

import sys

from epd_proxy.config import Config
from epd_proxy.options import markdown_table
from epd_proxy_tools.bench.flags import FakeBenchOptions, RealBenchOptions
from epd_proxy_tools.local.stack import StackConfig
from epd_proxy_tools.local.up import UpRun

COMMANDS = {
    "serve": (Config,),
    "up": (StackConfig, UpRun),
    "bench": (FakeBenchOptions,),
    "bench-stack": (RealBenchOptions,),
}


def table(command: str) -> str:
    first, *rest = (markdown_table(declared) for declared in COMMANDS[command])
    # One table per command: the rows of the later declarations without their header.
    return first + "".join(text.split("\n", 2)[2] for text in rest)


def commands_page() -> str:
    """docs/commands.md: `up` and `bench`; `serve`'s own table lives with the proxy's docs."""
    return f"""# `epd-proxy up` and `epd-proxy bench`

<!-- generated from the declarations: python -m epd_proxy_tools.flag_tables > docs/commands.md -->

Both commands' options are declared once, on dataclasses (`tools/epd_proxy_tools/local/stack.py`,
`tools/epd_proxy_tools/local/up.py`, `tools/epd_proxy_tools/bench/flags.py`), like `serve`'s in
`epd_proxy/config.py`; `--help` and these tables come from the declarations.

## `epd-proxy up`

A local E+PD (or, with `--prefill`, E+P+D) stack on real vLLM behind the proxy. It checks that every
port it needs is free before it builds the tiny model, and names the ports that are taken.

{table("up")}
## `epd-proxy bench`

Against fake backends: proxies and arms interleaved on one machine.

{table("bench")}
## `epd-proxy bench --stack` (real engines)

Proxies A/B'd in front of real vLLM engines: a local stack (`--stack`) or a running deployment
(`--encode-urls URLS --decode-urls URLS`). `epd-proxy bench --help` lists these options too.

{table("bench-stack")}"""


def main(argv: list[str]) -> int:
    if not argv:
        sys.stdout.write(commands_page())
        return 0
    if argv[0] not in COMMANDS:
        sys.stderr.write(f"unknown command {argv[0]!r}; one of {', '.join(COMMANDS)}\n")
        return 2
    sys.stdout.write(table(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
