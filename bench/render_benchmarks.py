"""Rewrite BENCHMARKS.md's generated parts: the results tables and the summary of the targets.

    python bench/render_benchmarks.py [bench/results] [BENCHMARKS.md] [--targets FILE] [--check]

The text between ``<!-- results:start -->`` and ``<!-- results:end -->`` becomes the
newest JSON record of each case (:func:`newest_per_case`). The text between
``<!-- targets:start -->`` and ``<!-- targets:end -->`` becomes one table, one row per
target of ``bench/targets.json``: its newest dated measurement, naming its date and the
section that reports it (:func:`targets_table`). That section is read from the file
being rendered (or the doc the measurement names); it (or a heading it lies under) must
hold the date, and it every number of the row's result, so the summary cannot drift from
the sections below it.
The file is written atomically; ``--check`` writes nothing and exits 1 when the file
differs from its rendering (a hand edit, or a new record not rendered).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from engramrt._io import atomic_write_bytes
from engramrt.bench.runner import markdown_table

START, END = "<!-- results:start -->", "<!-- results:end -->"
TARGETS_START, TARGETS_END = "<!-- targets:start -->", "<!-- targets:end -->"
TARGETS = Path(__file__).resolve().parent / "targets.json"
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_NUMBER = re.compile(r"\d[\d,.]*\d|\d")


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


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def section_text(text: str, heading: str, where: str) -> tuple[str, list[str]]:
    """The section of ``text`` under ``heading`` (its heading line included), up to the next
    heading of the same or a higher level, and the headings it lies under (a subsection's
    date is often its parent's).

    Raises:
        ValueError: no heading or several headings of that text.
    """
    lines = text.splitlines()
    found = [
        (i, len(m.group(1))) for i, line in enumerate(lines) if (m := _HEADING.match(line))
        if m.group(2) == heading
    ]  # fmt: skip
    if len(found) != 1:
        raise ValueError(f"{where}: {len(found)} headings {heading!r}; expected exactly one")
    start, level = found[0]
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if (m := _HEADING.match(lines[i])) and len(m.group(1)) <= level
        ),
        len(lines),
    )
    parents, above = [], level
    for line in reversed(lines[:start]):
        if (m := _HEADING.match(line)) and len(m.group(1)) < above:
            parents.append(m.group(2))
            above = len(m.group(1))
    return "\n".join(lines[start:end]), parents


def _holds(section: str, number: str) -> bool:
    """Whether ``number`` appears in ``section`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", section) is not None


def newest_measurement(target: dict[str, Any]) -> dict[str, Any]:
    """The measurement of ``target`` with the latest date; of those on one date, the last."""
    measurements = target["measurements"]
    if not measurements:
        raise ValueError(f"target {target['what']!r} has no measurement")
    return max(enumerate(measurements), key=lambda pair: (pair[1]["date"], pair[0]))[1]


def targets_table(targets: list[dict[str, Any]], docs: dict[str, str]) -> str:
    """The summary table: per target its newest measurement, its date and its section.

    ``docs`` maps a doc's path (``"BENCHMARKS.md"``, ``"docs/cache.md"``) to its text.
    Every measurement is checked, not only the newest: its section exists, holds its
    date and every number of its result.

    Raises:
        ValueError: naming the target, the section and what it lacks.
    """
    rows = [
        "| target | goal | newest measurement | verdict | date | section |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for target in targets:
        for measurement in target["measurements"]:
            doc = measurement.get("doc", "BENCHMARKS.md")
            where = f"target {target['what']!r}, measurement of {measurement['date']}, {doc}"
            section, parents = section_text(docs[doc], measurement["section"], where)
            if not any(measurement["date"] in part for part in (section, *parents)):
                raise ValueError(
                    f"{where}: section {measurement['section']!r} (and the headings above "
                    f"it) does not hold the date {measurement['date']}; expected the section "
                    f"that reports that run"
                )
            missing = [n for n in _NUMBER.findall(measurement["result"]) if not _holds(section, n)]
            if missing:
                raise ValueError(
                    f"{where}: section {measurement['section']!r} does not hold {missing} of "
                    f"the result {measurement['result']!r}; expected figures quoted from it"
                )
        newest = newest_measurement(target)
        doc = newest.get("doc", "BENCHMARKS.md")
        link = "" if doc == "BENCHMARKS.md" else doc
        rows.append(
            f"| {target['what']} | {target['goal']} | {newest['result']} | {newest['verdict']} "
            f"| {newest['date']} | [{newest['section']}]({link}#{slug(newest['section'])}) |"
        )
    return "\n".join(rows)


def _replace_between(text: str, start: str, end: str, body: str, where: str) -> str:
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{where}: expected one {start} and one {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + body + end + tail


def render(text: str, results: Path, targets_file: Path, root: Path, where: str) -> str:
    """``text`` (BENCHMARKS.md) with both generated parts rendered; a text without the
    targets markers gets the results only."""
    sections = []
    for group, reports in newest_per_case(results).items():
        tables = "\n\n".join(markdown_table(report) for report in reports)
        sections.append(f"### {group}\n\n{tables}\n")
    text = _replace_between(text, START, END, "\n\n" + "\n".join(sections) + "\n", where)
    if TARGETS_START not in text and TARGETS_END not in text:
        return text
    targets = json.loads(targets_file.read_text(encoding="utf-8"))["targets"]
    docs = {"BENCHMARKS.md": text}
    for target in targets:
        for measurement in target["measurements"]:
            doc = measurement.get("doc")
            if doc is not None and doc not in docs:
                docs[doc] = (root / doc).read_text(encoding="utf-8")
    table = targets_table(targets, docs)
    return _replace_between(text, TARGETS_START, TARGETS_END, "\n" + table + "\n", where)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=Path("bench/results"))
    parser.add_argument("target", nargs="?", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--targets", type=Path, default=TARGETS, help="the targets' JSON")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the file is stale"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    text = args.target.read_text(encoding="utf-8")
    root = args.target.resolve().parent
    try:
        rendered = render(text, args.results, args.targets, root, str(args.target))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if rendered != text:
            print(f"{args.target} differs from its rendering: run bench/render_benchmarks.py")
            return 1
        return 0
    atomic_write_bytes(args.target, rendered.encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
