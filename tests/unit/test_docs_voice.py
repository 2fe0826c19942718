"""The reference pages speak to a user about the current version: what changed, and when, belongs
to docs/changelog.md; the authors' machine and checkout are nobody else's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Phrases that only make sense to whoever wrote the page, at the time they wrote it.
NARRATION = re.compile(
    r"\bissue \d+|\bmain\d+\b|\bthis change\b|\bthe seed(?:'s)?\b|\bon this machine\b|/work/main\b",
    re.IGNORECASE,
)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def narration(text: str) -> list[str]:
    return [match.group(0) for match in NARRATION.finditer(text)]


def test_the_pattern_finds_narration_and_leaves_the_present_alone():
    assert narration("Before this change (issue 30) the main30 arm, measured on this machine") == [
        "this change",
        "issue 30",
        "main30",
        "on this machine",
    ]
    assert narration("An address that no longer resolves leaves the fleet; a seeded workload (--seed)") == []


def test_no_reference_page_narrates_history():
    found = [
        f"{page.relative_to(ROOT)}:{number}: {phrase}"
        for page in pages()
        if page.name != "changelog.md"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for phrase in narration(line)
    ]
    assert not found, "history belongs in docs/changelog.md, the page speaks of today:\n" + "\n".join(found)
