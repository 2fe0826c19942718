"""The house as the docs draw it: every serving module named on its floor in docs/architecture.md
and in README.md's module map, and no import circle in the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "epd_proxy"


def serving_modules() -> list[Path]:
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") and "tools" not in path.relative_to(PACKAGE).parts
    )


def floor_section(doc: str, floor: str) -> str:
    """The text under docs/architecture.md's heading for one floor (`top` for epd_proxy/ itself)."""
    heading = "### Top: `epd_proxy/`" if floor == "top" else f"### `{floor}/`"
    start = doc.index(heading)
    end = doc.find("\n### ", start + len(heading))
    return doc[start : end if end >= 0 else len(doc)]


def test_every_serving_module_has_a_row_on_its_floor_in_the_architecture_page():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in serving_modules():
        parts = path.relative_to(PACKAGE).parts
        floor = "top" if len(parts) == 1 else parts[0]
        if f"| `{path.name}` |" not in floor_section(doc, floor):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"docs/architecture.md has no row for: {missing}"


def test_the_readme_module_map_names_every_serving_module_on_its_floor():
    readme = (ROOT / "README.md").read_text()
    drawing = readme[readme.index("The module map") :]
    drawing = drawing[: drawing.index("\n```\n", drawing.index("```") + 3)]
    rows = drawing.splitlines()
    missing = []
    for path in serving_modules():
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            found = path.name in drawing
        else:
            at = next((i for i, row in enumerate(rows) if f"{parts[0]}/" in row), None)
            # A floor's list may wrap onto the line after its name.
            text = " ".join(rows[at : at + 2]) if at is not None else ""
            found = re.search(rf"\b{path.stem}\b", text) is not None
        if not found:
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"README.md's module map does not name: {missing}"


def imports_of(path: Path, names: set[str]) -> set[str]:
    """The package modules `path` imports anywhere: inside a function or under TYPE_CHECKING
    counts too, as a circle hidden there is a circle still."""
    here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            candidates = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in names and c != here)
    return found


def test_the_package_has_no_import_circle():
    paths = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")
    }
    graph = {name: imports_of(path, set(paths)) for name, path in paths.items()}
    circles = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circles.append(path[path.index(name) :] + [name])
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
