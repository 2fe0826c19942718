"""README.md is not a page of the MkDocs site, so `mkdocs build --strict` never sees its links."""

import re
import subprocess
import sys
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


def nav_pages() -> set[str]:
    """The site's pages as mkdocs.yml's nav lists them (mkdocs warns of a page left out)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r":\s*([a-z0-9-]+\.md)\s*$", nav, re.MULTILINE))


def test_every_page_of_the_site_is_linked_from_the_readme_and_the_docs_index():
    pages = nav_pages() - {"index.md"}
    assert {"transports.md", "keys.md", "observability.md"} <= pages
    readme = {target.split("#")[0] for target in relative_links((ROOT / "README.md").read_text())}
    index = {target.split("#")[0] for target in relative_links((ROOT / "docs/index.md").read_text())}
    assert sorted(pages - {p.removeprefix("docs/") for p in readme}) == []
    assert sorted(pages - index) == []


# Flags of the other programs the README's commands run (apt-get).
FOREIGN_FLAGS = {"--no-install-recommends"}


def test_every_flag_the_readme_names_is_one_the_commands_list_in_their_help():
    helps = ""
    for command in ("serve", "up"):
        done = subprocess.run(
            [sys.executable, "-m", "epd_proxy", command, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert done.returncode == 0, done.stderr
        helps += done.stdout
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", helps))
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", (ROOT / "README.md").read_text())) - FOREIGN_FLAGS
    assert "--api-key" in named and "--api-key" in listed
    assert sorted(named - listed) == [], "README.md names flags that neither serve nor up lists"
