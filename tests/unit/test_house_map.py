"""The house as the docs draw it: every serving module named on its floor in docs/architecture.md
and in README.md's module map, each row's imports the ones the code makes, and no import circle in
the package."""

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
            # A floor's list may wrap onto the lines after its name, up to the next floor's arrow.
            text = ""
            if at is not None:
                end = next((i for i in range(at + 1, len(rows)) if "▶" in rows[i]), len(rows))
                text = " ".join(rows[at:end])
            found = re.search(rf"\b{path.stem}\b", text) is not None
        if not found:
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"README.md's module map does not name: {missing}"


def imported(node: ast.AST, names: set[str]) -> set[str]:
    """The package modules one import statement names: `from epd_proxy.fleet import backends` and
    `from epd_proxy.fleet.backends import Instance` both name epd_proxy.fleet.backends."""
    if isinstance(node, ast.ImportFrom) and node.module:
        candidates = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    elif isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        return set()
    return {c for c in candidates if c in names}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports_of(path: Path, names: set[str]) -> set[str]:
    """The package modules `path` imports anywhere: inside a function or under TYPE_CHECKING
    counts too, as a circle hidden there is a circle still."""
    found = set().union(*(imported(node, names) for node in ast.walk(ast.parse(path.read_text()))))
    return found - {module_name(path)}


def loaded_and_deferred(path: Path, names: set[str]) -> tuple[set[str], set[str]]:
    """The package modules `path` imports when it is loaded, and those it imports only later: inside
    a function, or under `if TYPE_CHECKING:` (for the type checker alone)."""
    loaded: set[str] = set()
    deferred: set[str] = set()

    def visit(node: ast.AST, later: bool) -> None:
        (deferred if later else loaded).update(imported(node, names))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, later)
            return
        inner = later or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    here = module_name(path)
    return loaded - {here}, deferred - loaded - {here}


def page_notation(module: str) -> str:
    """A module as the architecture page writes it: `errors`, `journey/extract`, `tools/local/up`."""
    return module.removeprefix("epd_proxy.").replace(".", "/")


def imports_cell(row: str) -> tuple[set[str], set[str]]:
    """A row's Imports column: the modules outside brackets and those in brackets; `—` is none."""
    cell = re.split(r"(?<!\\)\|", row.strip().strip("|"))[-1]
    deferred = {name for group in re.findall(r"\[([^\]]*)\]", cell) for name in group.split(",")}
    loaded = re.sub(r"\[[^\]]*\]", "", cell).split(",")

    def clean(names) -> set[str]:
        return {name.strip() for name in names} - {"", "—"}

    return clean(loaded), clean(deferred)


def test_every_row_names_the_package_modules_its_module_imports():
    """The Imports column, checked against the code: a module imported at load time outside the
    brackets, one imported only inside a function or under TYPE_CHECKING inside them."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    names = {module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    wrong = []
    for path in serving_modules():
        parts = path.relative_to(PACKAGE).parts
        section = floor_section(doc, "top" if len(parts) == 1 else parts[0])
        row = next((line for line in section.splitlines() if line.startswith(f"| `{path.name}` |")), None)
        if row is None:
            continue  # the test above names a missing row
        loaded, deferred = (set(map(page_notation, found)) for found in loaded_and_deferred(path, names))
        said_loaded, said_deferred = imports_cell(row)
        if (said_loaded, said_deferred) != (loaded, deferred):
            later = f" [{', '.join(sorted(deferred))}]" if deferred else ""
            extra = sorted((said_loaded - loaded) | (said_deferred - deferred))
            missing = sorted((loaded - said_loaded) | (deferred - said_deferred))
            wrong.append(
                f"{path.relative_to(PACKAGE)}: {', '.join(sorted(loaded)) or '—'}{later}"
                f"  (the row also names {extra or 'nothing else'}; it misses or misplaces {missing or 'nothing'})"
            )
    assert not wrong, "docs/architecture.md's Imports column is wrong; the code imports:\n" + "\n".join(wrong)


def test_the_package_has_no_import_circle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
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


def test_no_serving_module_is_over_450_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in serving_modules() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"serving modules over 450 lines (split them by concern): {long}"
