"""Rewrite the results section of BENCHMARKS.md from the newest JSON record of each case.

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


def newest_per_case(results: Path) -> dict[str, list[dict]]:
    """Per group, reports holding the newest full-size record of each of its cases.

    A run of some cases (``engramrt bench --case``) replaces those rows only;
    quick runs (small shapes) are not rendered.
    """
    newest: dict[str, tuple[str, str, dict]] = {}  # case -> (date, file, record)
    reports: dict[str, dict] = {}
    for path in sorted(results.glob("bench-*.json")):
        report = json.loads(path.read_text())
        if report.get("quick"):
            continue
        reports[path.name] = report
        date = report["environment"]["date"]
        for case in report["cases"]:
            if case["name"] not in newest or date >= newest[case["name"]][0]:
                newest[case["name"]] = (date, path.name, case)
    groups: dict[str, dict[str, list[dict]]] = {}
    for _, source, case in newest.values():
        groups.setdefault(case["group"], {}).setdefault(source, []).append(case)
    return {
        group: [dict(reports[source], cases=cases) for source, cases in sorted(by_source.items())]
        for group, by_source in sorted(groups.items())
    }


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "BENCHMARKS.md")
    sections = []
    for group, reports in newest_per_case(results).items():
        tables = "\n\n".join(markdown_table(report) for report in reports)
        sections.append(f"### {group}\n\n{tables}\n")
    text = target.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(
        target, (head + START + "\n\n" + "\n".join(sections) + "\n" + END + tail).encode()
    )


if __name__ == "__main__":
    main()
