"""README.md is not a page of the MkDocs site, so `mkdocs build --strict` never sees its links."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(markdown: str) -> list[str]:
    return [target for target in LINK.findall(markdown) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_relative_links_are_found():
    assert relative_links("[a](docs/x.md) [b](https://e.org) [c](docs/y.md#part) [d](mailto:x)") == [
        "docs/x.md",
        "docs/y.md#part",
    ]


def test_every_relative_link_of_the_readme_names_a_file_of_the_checkout():
    links = relative_links((ROOT / "README.md").read_text())
    assert links, "the README links into docs/"
    missing = [target for target in links if not (ROOT / target.split("#")[0]).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
