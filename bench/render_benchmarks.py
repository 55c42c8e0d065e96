"""Rewrite the results section of BENCHMARKS.md from the newest JSON of each group.

    python bench/render_benchmarks.py [bench/results] [BENCHMARKS.md]

Only the text between the ``<!-- results:start -->`` and
``<!-- results:end -->`` markers is replaced; the file is written atomically.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engramrt._io import atomic_write_bytes
from engramrt.bench.runner import markdown_table

START, END = "<!-- results:start -->", "<!-- results:end -->"


def newest_per_group(results: Path) -> dict[str, dict]:
    newest: dict[str, tuple[str, dict]] = {}
    for path in sorted(results.glob("bench-*.json")):
        report = json.loads(path.read_text())
        for group in {c["group"] for c in report["cases"]}:
            date = report["environment"]["date"]
            if group not in newest or date > newest[group][0]:
                newest[group] = (date, report)
    return {g: r for g, (_, r) in sorted(newest.items())}


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "BENCHMARKS.md")
    sections = []
    for group, report in newest_per_group(results).items():
        only = dict(report, cases=[c for c in report["cases"] if c["group"] == group])
        sections.append(f"### {group}\n\n{markdown_table(only)}\n")
    text = target.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(
        target, (head + START + "\n\n" + "\n".join(sections) + "\n" + END + tail).encode()
    )


if __name__ == "__main__":
    main()
