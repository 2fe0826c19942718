"""The server uses aiohttp (and every other dependency) through public names only, so any release
the pin allows works without a code review: no private module, no private attribute."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
SERVER = [ROOT / "epd_proxy/http" / name for name in ("server.py", "guard.py", "routes.py", "limits.py")]


def private_uses(path: Path) -> list[str]:
    """Imports of a private module, and private attributes read on anything but self."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("epd_proxy"):
            if node.module.startswith("aiohttp.") or any(
                p.startswith("_") and not p.startswith("__") for p in node.module.split(".")
            ):
                found.append(f"from {node.module} import")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_server_reads_no_private_name_of_a_dependency():
    assert {path.name: private_uses(path) for path in SERVER} == {path.name: [] for path in SERVER}


def test_the_checker_sees_a_private_import_and_a_private_attribute(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from aiohttp.web_protocol import RequestHandler\nx = handler._messages\ny = self._own\n")
    assert private_uses(sample) == ["from aiohttp.web_protocol import", "line 2: ._messages"]


def test_pyproject_allows_the_next_minor_releases_of_aiohttp():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = (Requirement(d) for d in dependencies if Requirement(d).name == "aiohttp")
    assert requirement.specifier.contains("3.14.5") and requirement.specifier.contains("3.20.0")
    assert not requirement.specifier.contains("4.0.0") and not requirement.specifier.contains("3.14.3")
