"""Two models over the same seeds: where on the held-out sets one's loss moves from the other's.

    python -m engramrt_lab.models.pairs --from MODEL RECORD... --to MODEL RECORD...
        [--view longest_seen] [--json PATH]

Each ``RECORD`` is a training record (``--results`` of ``python -m
engramrt_lab.models.train``, or a record of the seeds command) holding ``MODEL``;
``--from`` and ``--to`` take one record per seed, each seed once, and the two must
cover the same seeds (read from each record's ``--seed``; 0 where it has none). A
memory size against another: ``--from engram`` on the records of ``--buckets`` at
×2, ``--to engram_x4`` on the ``--memory-sweep 4`` records.

For each held-out set that every record splits (``stdlib`` and ``site-packages``, from
the records' ``where_it_wins`` and ``where_it_wins_package``; records from before the
second was split have only the first) and each category of ``--view``
(default ``longest_seen``, see :mod:`engramrt_lab.models.wins`), the table gives the
category's share of the predictions, both models' mean loss over seeds, the paired
difference ``to - from`` as mean ± sample std [min, max] over seeds, and each Engram
block's mean gate for both. Its last row is the set's whole loss: the categories
partition the set's predictions, so their share-weighted differences add up to it,
and the row gives that sum beside the difference of the records' own set losses
(``losses``), which it must match to the rounding of the records' shares.

The two records of a seed must have scored the same predictions (every category's
``predictions`` equal): records of different corpora or evaluations are refused.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engramrt.errors import ValidationError
from engramrt_lab.models.cli_parser import OneLineParser, report
from engramrt_lab.models.seeds import HELDOUT_SET_NAMES, MIN_SEEDS, command_seeds, spread
from engramrt_lab.models.wins import gate_column, gate_column_parts

__all__ = ["compare", "main", "markdown", "record_seed"]

PROG = "python -m engramrt_lab.models.pairs"
SETS = {"heldout": "where_it_wins", "package_heldout": "where_it_wins_package"}
"""Each held-out set's loss key and the record field of its categories."""


def record_seed(record: Mapping[str, Any]) -> int:
    """The ``--seed`` of the command that wrote ``record`` (0, the default, without one)."""
    given, _ = command_seeds(shlex.split(str(record.get("command", ""))))
    return int(given[0]) if given else 0


def _by_seed(model: str, records: Mapping[str, Mapping[str, Any]], side: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for name, record in records.items():
        if model not in record.get("models", {}):
            raise ValidationError(
                f"{side} record {name} holds models {sorted(record.get('models', {}))}; "
                f"expected {model!r}"
            )
        seed = record_seed(record)
        if seed in out:
            raise ValidationError(
                f"{side} has two records of seed {seed} ({out[seed][0]} and {name}); "
                f"expected one record per seed"
            )
        out[seed] = (name, record)
    return out


def compare(
    from_model: str,
    from_records: Mapping[str, Mapping[str, Any]],
    to_model: str,
    to_records: Mapping[str, Mapping[str, Any]],
    view: str = "longest_seen",
) -> dict[str, Any]:
    """Per held-out set and category of ``view``: share, both models' losses and gates over
    seeds, and the paired difference ``to - from``; ``*_records`` map a record's name (for
    errors) to the record, one per seed (see the module doc)."""
    first = _by_seed(from_model, from_records, "--from")
    second = _by_seed(to_model, to_records, "--to")
    if set(first) != set(second):
        raise ValidationError(
            f"--from covers seeds {sorted(first)} and --to seeds {sorted(second)}; expected "
            f"the same seeds"
        )
    seeds = sorted(first)
    if len(seeds) < MIN_SEEDS:
        raise ValidationError(f"{len(seeds)} seed; expected at least {MIN_SEEDS} for a spread")
    sets: dict[str, Any] = {}
    everyone = [record for pair in (first, second) for _, record in pair.values()]
    for loss_key, field in SETS.items():
        if not all(record.get(field) for record in everyone):
            continue  # a set some record did not split (records from before it was)
        per_seed = []
        for seed in seeds:
            pair = []
            for model, (name, record) in ((from_model, first[seed]), (to_model, second[seed])):
                categories = (record.get(field) or {}).get(view)
                if not categories:
                    raise ValidationError(
                        f"record {name} has no {field}[{view!r}]; expected the categories of "
                        f"the training command's evaluation"
                    )
                if any(model not in row for row in categories.values()):
                    raise ValidationError(f"record {name}'s {field}[{view!r}] has no {model!r}")
                pair.append((name, categories, record["models"][model]["losses"][loss_key]))
            (name_a, cats_a, loss_a), (name_b, cats_b, loss_b) = pair
            counts_a = {c: row["predictions"] for c, row in cats_a.items()}
            counts_b = {c: row["predictions"] for c, row in cats_b.items()}
            if counts_a != counts_b:
                raise ValidationError(
                    f"seed {seed}: {name_a} and {name_b} scored different predictions in "
                    f"{field}[{view!r}] ({counts_a} against {counts_b}); expected the same "
                    f"corpus and evaluation"
                )
            per_seed.append((cats_a, cats_b, loss_a, loss_b))
        rows = {}
        for category in per_seed[0][0]:
            rows[category] = {
                "share": per_seed[0][0][category]["share"],
                "from": spread([a[category][from_model] for a, _, _, _ in per_seed]),
                "to": spread([b[category][to_model] for _, b, _, _ in per_seed]),
                "difference": spread(
                    [b[category][to_model] - a[category][from_model] for a, b, _, _ in per_seed]
                ),
                "gates": {
                    side: _gates(model, [c[category] for c in cats])
                    for side, model, cats in (
                        ("from", from_model, [a for a, _, _, _ in per_seed]),
                        ("to", to_model, [b for _, b, _, _ in per_seed]),
                    )
                },
            }
        summed = [
            sum(a[c]["share"] * (b[c][to_model] - a[c][from_model]) for c in a)
            for a, b, _, _ in per_seed
        ]
        sets[HELDOUT_SET_NAMES[loss_key]] = {
            "categories": rows,
            "whole": {
                "from": spread([la for _, _, la, _ in per_seed]),
                "to": spread([lb for _, _, _, lb in per_seed]),
                "difference": spread([lb - la for _, _, la, lb in per_seed]),
                "categories_summed": spread(summed),
                "per_seed_difference": [lb - la for _, _, la, lb in per_seed],
                "per_seed_categories_summed": summed,
            },
        }
    if not sets:
        raise ValidationError(
            f"no held-out set is split in every record (fields {', '.join(SETS.values())}); "
            f"expected records of the training command's evaluation"
        )
    return {
        "from": from_model,
        "to": to_model,
        "view": view,
        "seeds": seeds,
        "records": {
            "from": [first[s][0] for s in seeds],
            "to": [second[s][0] for s in seeds],
        },
        "sets": sets,
    }


def _gates(model: str, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``model``'s mean gate per block over ``rows`` (one category's row per seed)."""
    blocks = sorted(
        parts[1] for key in rows[0] if (parts := gate_column_parts(key)) and parts[0] == model
    )
    return {
        str(block): sum(row[gate_column(model, block)] for row in rows) / len(rows)
        for block in blocks
    }


def markdown(result: Mapping[str, Any]) -> str:
    """The comparison as one Markdown table per held-out set."""
    a, b = result["from"], result["to"]
    lines = [
        f"# {b} against {a}, seeds {','.join(map(str, result['seeds']))} ({result['view']})",
        "",
        "mean over seeds; the difference is paired by seed: mean ± sample std [min, max].",
    ]
    for name, data in result["sets"].items():
        lines += [
            "",
            f"{name}:",
            "",
            f"| category | share | {a} | {b} | {b} − {a} | gates, {a} → {b} |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for category, row in data["categories"].items():
            gates = ", ".join(
                f"block {block} {row['gates']['from'][block]:.3f} → "
                f"{row['gates']['to'].get(block, float('nan')):.3f}"
                for block in row["gates"]["from"]
            )
            lines.append(
                f"| {category} | {row['share']:.3f} | {row['from']['mean']:.4f} | "
                f"{row['to']['mean']:.4f} | {_difference(row['difference'])} | {gates} |"
            )
        whole = data["whole"]
        lines.append(
            f"| whole set (categories summed: {_difference(whole['categories_summed'])}) | "
            f"1.000 | {whole['from']['mean']:.4f} | {whole['to']['mean']:.4f} | "
            f"{_difference(whole['difference'])} | |"
        )
    return "\n".join(lines) + "\n"


def _difference(stats: Mapping[str, float]) -> str:
    return f"{stats['mean']:+.4f} ± {stats['std']:.4f} [{stats['min']:+.4f}, {stats['max']:+.4f}]"


def _side(parser: OneLineParser, flag: str, values: Sequence[str]) -> tuple[str, dict[str, Any]]:
    if len(values) < 2:
        parser.error(f"{flag} takes a model and its records; got {' '.join(values)!r}")
    model, paths = values[0], values[1:]
    records = {}
    for path in paths:
        try:
            records[path] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"{flag} record {path!r} cannot be read: {exc}")
    return model, records


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="first", nargs="+", required=True, metavar="MODEL RECORD")
    parser.add_argument("--to", dest="second", nargs="+", required=True, metavar="MODEL RECORD")
    parser.add_argument("--view", default="longest_seen", help="default longest_seen")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    first, second = _side(parser, "--from", args.first), _side(parser, "--to", args.second)
    try:
        result = compare(*first, *second, view=args.view)
    except ValidationError as exc:
        parser.error(str(exc))
    return report(result, args.json, markdown(result))


if __name__ == "__main__":
    raise SystemExit(main())
