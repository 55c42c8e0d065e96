"""Measurements live in BENCHMARKS.md: the code states rules and points there.

Docstrings and comments under ``src/`` carry no timed figure (a number with a
unit of time or rate), and every ``BENCHMARKS.md#anchor`` that the code, the
docs or a tuned-config file points to names a heading that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "engramrt"

TIMED = re.compile(
    r"\d[\d.,]*\s?(µs|us|ms|ns|GB/s|GiB/s|MB/s|TB/s|TFLOP/s|rows/s|tokens/s)(?![\w/])"
)
ANCHOR = re.compile(r"BENCHMARKS\.md#([a-z0-9-]+)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_no_timed_figure_in_the_code() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "{" in line:  # a format string: the unit of a printed value
                continue
            if TIMED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "timed figures belong in BENCHMARKS.md:\n" + "\n".join(found)


def test_the_rule_catches_a_figure() -> None:
    assert TIMED.search("took 45 µs against 54 µs")
    assert TIMED.search("(2.13 ms, 93 M rows/s)") and TIMED.search("~705 TFLOP/s")
    assert not TIMED.search("a 5 % cache") and not TIMED.search("T = 8192 tokens")


def test_every_benchmarks_anchor_exists() -> None:
    headings = {
        _slug(line.lstrip("#"))
        for line in (ROOT / "BENCHMARKS.md").read_text().splitlines()
        if line.startswith("#")
    }
    sources = [
        *SRC.rglob("*.py"),
        *(SRC / "tuned").glob("*.json"),
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "BENCHMARKS.md",
    ]
    missing = sorted(
        f"{path.relative_to(ROOT)}: #{anchor}"
        for path in sources
        for anchor in ANCHOR.findall(path.read_text())
        if anchor not in headings
    )
    assert not missing, missing
    assert (
        _slug("Decode against the targets (2026-12-01)") == "decode-against-the-targets-2026-12-01"
    )
