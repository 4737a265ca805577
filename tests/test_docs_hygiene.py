"""The docs stay a reference a user can read: within their sizes, and with no history in
them (commit hashes, "(was …)", scratch runs, issue talk: history lives in git)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
KIB = 1024


def prose(text: str) -> str:
    """The text without fenced code blocks (examples may print ids that look like hashes)."""
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)


def test_sizes():
    """docs/ at most 160 KiB in all, performance.md 25 KiB, README.md 13 KiB."""
    total = sum(p.stat().st_size for p in DOCS)
    assert total <= 160 * KIB, f"docs/ is {total} bytes"
    assert (ROOT / "docs" / "performance.md").stat().st_size <= 25 * KIB
    assert (ROOT / "README.md").stat().st_size <= 13 * KIB


def test_no_history_in_the_docs():
    bad = []
    history = re.compile(r"\(was [^)]*\)|scratch run|\bthe issue\b|\bissue #?\d+|"
                         r"design history|\b20\d\d-\d\d-\d\d\b", re.I)
    commit = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])")
    for page in [ROOT / "README.md", *DOCS]:
        for n, line in enumerate(prose(page.read_text()).splitlines(), 1):
            for m in (history.search(line), commit.search(line)):
                if m:
                    bad.append(f"{page.relative_to(ROOT)}: {m.group(0)!r} in {line.strip()[:80]!r}")
    assert not bad, "\n".join(bad)
