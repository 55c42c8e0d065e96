"""Memory plans: where the tables go and how many bytes each rank needs.

A plan reads a family's tables (:class:`~engramrt.family.TableSpec`), so it serves any
memory family. Tensor parallelism splits a table by its ``shard`` rule:

- ``"columns"`` (DeepSeek Engram, SPEC §7): a rank holds only the rows of its hash
  columns, one contiguous row range of every value;
- ``"width"`` (Qwen4-Exp PLE, ``embedding_colwise``): a rank holds every row, one slice
  of each row's values.

The plan reports, for each placement, the bytes one rank needs in GPU memory, in host
memory and on disk (tables only; staging buffers are a few MiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engramrt.errors import ShardingError
from engramrt.family import TableSpec
from engramrt.layout import EngramLayout, owned_columns

__all__ = [
    "PLACEMENTS",
    "PlacementPlan",
    "TableRegion",
    "TableShard",
    "memory_plan",
    "rank_bytes",
    "rank_rows",
    "table_shards",
    "width_slice",
]

PLACEMENTS: tuple[str, ...] = ("gpu", "host", "disk")


def rank_rows(layout: EngramLayout, tp: int) -> list[list[int]]:
    """``[tp][layer]`` table rows each rank holds under head sharding.

    With ``tp == 1`` a rank holds the checkpoint's whole table
    (``engram_num_embeddings``, which may exceed what the primes need); with
    sharding it holds exactly its columns' bucket ranges.
    """
    layout.cols_per_rank(tp)  # refuses a tp that leaves a rank without columns
    if tp == 1:
        return [list(layout.config.num_embeddings)]
    return [
        [layout.column_shard(li, tp, r).num_rows for li in range(layout.n_layers)]
        for r in range(tp)
    ]


def width_slice(width: int, tp: int, rank: int) -> tuple[int, int]:
    """``(value_begin, value_end)`` of each row that ``rank`` of ``tp`` holds under the
    ``"width"`` rule: ``torch.chunk`` of the values, as a DTensor ``Shard(1)`` places them
    (``w = ceil(width / tp)`` each; when ``tp`` does not divide ``width`` the last ranks
    get fewer values, possibly none). The one place the rule lives:
    :meth:`~engramrt.families.qwen4_ple.checkpoint.PleTableRegion.width_shard` reads by it."""
    per_rank = -(-width // tp)
    return min(rank * per_rank, width), min((rank + 1) * per_rank, width)


class TableRegion:
    """Rows ``[row_begin, row_end)`` of a table and, of each, values ``[value_begin,
    value_end)``: what a rank holds (:class:`TableShard`) or a reader reads
    (:class:`~engramrt.families.qwen4_ple.checkpoint.PleTableRegion`). Subclasses are
    dataclasses that declare the four bounds."""

    row_begin: int
    row_end: int
    value_begin: int
    value_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_begin

    @property
    def num_values(self) -> int:
        return self.value_end - self.value_begin


@dataclass(frozen=True)
class TableShard(TableRegion):
    """The part of one table a tensor-parallel rank holds: rows ``[row_begin, row_end)``,
    values ``[value_begin, value_end)`` of each, ``nbytes`` as stored."""

    layer_id: int
    rank: int
    tp: int
    row_begin: int
    row_end: int
    value_begin: int
    value_end: int
    nbytes: int


def _check_tp(tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ShardingError(f"tp={tp!r} must be a positive integer")


def _check_width_split(table: TableSpec, tp: int) -> None:
    """Refuse a ``tp`` whose :func:`width_slice` leaves a rank without a value of each row
    (as :func:`~engramrt.layout.cols_per_rank` refuses one that leaves it no column)."""
    part = -(-table.width // tp)
    if (tp - 1) * part >= table.width:
        empty = [r for r in range(tp) if r * part >= table.width]
        raise ShardingError(
            f"tp={tp} leaves rank(s) {empty} without a value of the rows of layer "
            f"{table.layer_id}: d={table.width} values in parts of ceil({table.width}/{tp})="
            f"{part}; choose tp so that (tp-1)*ceil(d/tp) < d"
        )


def table_shards(table: TableSpec, tp: int) -> list[TableShard]:
    """What each of ``tp`` ranks holds of ``table`` (``[tp]``, rank order).

    At ``tp == 1`` the rank holds the whole table, padding rows included. Under
    ``"columns"`` a rank of several holds exactly its columns' row ranges
    (:func:`~engramrt.layout.owned_columns`); under ``"width"`` every row, padding
    included, and its :func:`width_slice` of the values. A ``tp`` that leaves a rank
    without a column, or without a value, is refused.
    """
    _check_tp(tp)
    if tp > 1 and table.shard == "width":
        _check_width_split(table, tp)
    shards = []
    for rank in range(tp):
        rows, values = (0, table.rows), (0, table.width)
        if tp > 1 and table.shard == "columns":
            c0, c1 = owned_columns(table.num_cols, tp, rank)
            rows = (table.col_offsets[c0], table.col_offsets[c1 - 1] + table.col_rows[c1 - 1])
        elif tp > 1:
            values = width_slice(table.width, tp, rank)
        width = values[1] - values[0]
        row_bytes = table.row_format.row_bytes(width) if width else 0
        nbytes = (rows[1] - rows[0]) * row_bytes
        shards.append(TableShard(table.layer_id, rank, tp, *rows, *values, nbytes))
    return shards


def rank_bytes(tables: Sequence[TableSpec], tp: int) -> list[int]:
    """``[tp]`` bytes of all ``tables`` each rank holds."""
    per_table = [table_shards(table, tp) for table in tables]
    if not per_table:
        _check_tp(tp)
        return [0] * tp
    return [sum(shards[rank].nbytes for shards in per_table) for rank in range(tp)]


@dataclass(frozen=True)
class PlacementPlan:
    """Bytes for one placement of all of a family's tables at a given TP size.

    ``*_per_rank`` figures are the largest rank's; ``*_per_node`` assume the
    TP group shares one node.
    """

    placement: str
    tp: int
    gpu_bytes_per_rank: int
    host_bytes_per_rank: int
    host_bytes_per_node: int
    disk_bytes_per_node: int

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


def memory_plan(tables: EngramLayout | Sequence[TableSpec], tp: int = 1) -> list[PlacementPlan]:
    """One :class:`PlacementPlan` per placement (``gpu``, ``host``, ``disk``).

    Args:
        tables: a family's tables (``family.tables()``), or an Engram layout (its
            :class:`~engramrt.families.deepseek_engram.family.DeepSeekEngramFamily` tables).
        tp: tensor-parallel size.
    """
    if isinstance(tables, EngramLayout):
        from engramrt.family import resolve_family

        specs: Sequence[TableSpec] = resolve_family("deepseek-engram")(tables.config).tables()
    else:
        specs = tables
    per_rank = rank_bytes(specs, tp)
    biggest, total = max(per_rank), sum(per_rank)
    return [
        PlacementPlan("gpu", tp, biggest, 0, 0, 0),
        PlacementPlan("host", tp, 0, biggest, total, 0),
        PlacementPlan("disk", tp, 0, 0, 0, total),
    ]
