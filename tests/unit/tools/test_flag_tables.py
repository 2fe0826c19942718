"""Every command's flag table is generated from its declarations, and the docs hold what is generated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from epd_proxy_tools.flag_tables import COMMANDS, commands_page, table

ROOT = Path(__file__).resolve().parents[3]


def test_docs_commands_page_is_the_declarations():
    assert (ROOT / "docs" / "commands.md").read_text() == commands_page(), (
        "regenerate it with: python -m epd_proxy_tools.flag_tables > docs/commands.md"
    )


def test_each_table_has_a_row_per_flag():
    from epd_proxy.options import options

    for command, declared in COMMANDS.items():
        rows = table(command).splitlines()[2:]
        assert len(rows) == sum(len(options(cls)) for cls in declared), command


def test_the_command_line_prints_one_table_or_refuses_an_unknown_command():
    run = [sys.executable, "-m", "epd_proxy_tools.flag_tables"]
    up = subprocess.run([*run, "up"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert up.returncode == 0 and up.stdout == table("up")
    unknown = subprocess.run([*run, "down"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert unknown.returncode == 2 and "unknown command 'down'" in unknown.stderr
