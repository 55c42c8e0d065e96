"""``engramrt plan``: the memory plan of a config, per table and per tensor-parallel rank.

Reads the family's tables (:meth:`MemoryFamily.tables`) and splits each by its rule
(:func:`engramrt.plan.table_shards`): DeepSeek Engram by hash columns (a rank holds its
columns' rows), Qwen4-Exp PLE by width (a rank holds a slice of every row).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from engramrt.cli._family_config import FamilyConfigOption

__all__ = ["DEFAULT_TP", "human_bytes", "plan_report", "register"]

DEFAULT_TP = (1, 2, 4, 8)


def human_bytes(count: int) -> str:
    """``"95.37 GiB"``, ``"1.50 MiB"``, ``"264 B"``: binary units, two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.2f} {unit}"
    return f"{count} B"


def _tp_sizes(option: str, text: str | None) -> list[int]:
    """The TP sizes asked for (``--tp 1,2,4``; None: :data:`DEFAULT_TP`), in order, once each."""
    from engramrt.cli._checks import parse_int_list
    from engramrt.errors import ValidationError

    if text is None:
        return list(DEFAULT_TP)
    sizes = parse_int_list(option, text)
    for size in sizes:
        if size < 1:
            raise ValidationError(
                f"{option}={text!r} holds {size}; expected tensor-parallel sizes >= 1"
            )
    return list(dict.fromkeys(sizes))


def plan_report(config: str, tp: str | None) -> dict[str, Any]:
    """Everything ``plan`` prints, as one JSON-able object.

    A TP size the tables cannot be split into (a rank left without a hash column or a
    value) is an error when ``--tp`` names it and is listed under ``skipped_tp`` when it
    is one of the defaults.
    """
    from engramrt.cli._family_config import family_value, load_family_config
    from engramrt.errors import ShardingError
    from engramrt.plan import table_shards

    loaded = load_family_config("--config", config)
    tables = family_value(loaded).tables()
    per_tp, skipped = [], []
    for size in _tp_sizes("--tp", tp):
        try:
            shards = [table_shards(table, size) for table in tables]
        except ShardingError as exc:
            if tp is not None:
                raise ShardingError(f"--tp={tp!r}: {exc}") from exc
            skipped.append({"tp": size, "reason": str(exc)})
            continue
        rank_bytes = [sum(s[rank].nbytes for s in shards) for rank in range(size)]
        per_tp.append(
            {
                "tp": size,
                "tables": [
                    {
                        "layer_id": table.layer_id,
                        "rank_rows": [s.num_rows for s in table_shards_],
                        "rank_values": [s.num_values for s in table_shards_],
                        "rank_bytes": [s.nbytes for s in table_shards_],
                    }
                    for table, table_shards_ in zip(tables, shards, strict=True)
                ],
                "rank_bytes": rank_bytes,
                "max_rank_bytes": max(rank_bytes),
                "node_bytes": sum(rank_bytes),
            }
        )
    return {
        "config": config,
        "family": loaded.family,
        "tables": [
            {
                "layer_id": table.layer_id,
                "rows": table.rows,
                "width": table.width,
                "row_format": table.row_format.name,
                "row_bytes": table.row_bytes,
                "nbytes": table.nbytes,
                "num_cols": table.num_cols,
                "shard": table.shard,
            }
            for table in tables
        ],
        "total_bytes": sum(table.nbytes for table in tables),
        "tp": per_tp,
        "skipped_tp": skipped,
    }


def _unit(count: int) -> tuple[str, int]:
    """The binary unit :func:`human_bytes` writes ``count`` in, and its size."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return unit, scale
    return "B", 1


def _print_report(report: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    from engramrt.cli._console import console

    split = {"columns": "hash columns", "width": "row width"}
    tables = report["tables"]
    formats = ", ".join(sorted({t["row_format"] for t in tables}))
    splits = ", ".join(sorted({split[t["shard"]] for t in tables}))
    console.print(
        f"[bold]{report['config']}[/] ({report['family']}): {len(tables)} table(s) of {formats} "
        f"rows, {human_bytes(report['total_bytes'])} ({report['total_bytes']:,} B); tensor "
        f"parallelism splits them by {splits}",
        highlight=False,
        soft_wrap=True,
    )
    unit, scale = _unit(report["total_bytes"])
    grid = Table(
        title=f"{unit} per table; tp=N: what the largest rank holds",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("layer", "rows", "row B", "total", *(f"tp={e['tp']}" for e in report["tp"])):
        grid.add_column(name, justify="right")

    def size(count: int) -> str:
        return f"{count / scale:,.2f}" if scale > 1 else f"{count:,}"

    for index, table in enumerate(tables):
        grid.add_row(
            str(table["layer_id"]),
            f"{table['rows']:,}",
            str(table["row_bytes"]),
            size(table["nbytes"]),
            *(size(max(e["tables"][index]["rank_bytes"])) for e in report["tp"]),
        )
    grid.add_section()
    grid.add_row(
        "all",
        "",
        "",
        size(report["total_bytes"]),
        *(size(e["max_rank_bytes"]) for e in report["tp"]),
    )
    console.print(grid)
    for entry in report["skipped_tp"]:
        console.print(f"tp={entry['tp']} not planned: {entry['reason']}", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(
        config: FamilyConfigOption = "dsv41-flash",
        tp: Annotated[
            str | None,
            typer.Option(help="Tensor-parallel sizes, e.g. 1,2,4,8 (the default)."),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """The memory plan of a config: each table's rows, row bytes, format and size, and
        the bytes one rank holds at each tensor-parallel size."""
        report = plan_report(config, tp)
        if as_json:
            print(json.dumps(report, indent=1))
        else:
            _print_report(report)
