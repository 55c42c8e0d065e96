"""Memory plans: where the tables go and how many bytes each rank needs.

Under tensor parallelism a rank holds only the rows of its hash columns
(SPEC §7), so its share of a layer is one contiguous row range. The plan
reports, for each placement, the bytes one rank needs in GPU memory, in host
memory and on disk (tables only; staging buffers are a few MiB).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engramrt.layout import EngramLayout

__all__ = ["PLACEMENTS", "PlacementPlan", "memory_plan", "rank_rows"]

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


@dataclass(frozen=True)
class PlacementPlan:
    """Bytes for one placement of all Engram tables at a given TP size.

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


def memory_plan(layout: EngramLayout, tp: int = 1) -> list[PlacementPlan]:
    """One :class:`PlacementPlan` per placement (``gpu``, ``host``, ``disk``)."""
    row_bytes = layout.config.row_bytes
    per_rank = [sum(rows) * row_bytes for rows in rank_rows(layout, tp)]
    biggest, total = max(per_rank), sum(per_rank)
    return [
        PlacementPlan("gpu", tp, biggest, 0, 0, 0),
        PlacementPlan("host", tp, 0, biggest, total, 0),
        PlacementPlan("disk", tp, 0, 0, 0, total),
    ]
