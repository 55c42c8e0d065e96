"""Row stores filled with synthetic rows, for demos and benchmarks without a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engramrt.layout import EngramLayout
from engramrt.lookup.synthetic import synthetic_packed_rows
from engramrt.lookup.tiers import TablePlacement, check_placement, make_store
from engramrt.lookup.tiers.base import RowStore

__all__ = ["synthetic_rows", "synthetic_stores"]

_FILL_ROWS = 1 << 16  # rows generated per piece (17 MB at 264 B)


def synthetic_rows(
    layout: EngramLayout,
    layer_index: int,
    row_begin: int,
    row_end: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[int, torch.Tensor]]:
    """Rows ``[row_begin, row_end)`` of layer ``layer_index``'s synthetic table, in pieces.

    Yields ``(local_row, packed)``: ``packed`` holds rows ``row_begin +
    local_row`` onwards, computed on ``device``: the rows of
    :func:`~engramrt.lookup.synthetic.synthetic_packed_rows` with a seed per
    ``(seed, layer_index)``, so row ``g`` is the same whatever the range asked for.
    """
    device = torch.device(device)
    E = layout.config.head_dim
    for begin in range(row_begin, row_end, _FILL_ROWS):
        end = min(row_end, begin + _FILL_ROWS)
        row_ids = torch.arange(begin, end, dtype=torch.int64, device=device)
        yield begin - row_begin, synthetic_packed_rows(row_ids, E, seed * 1_009 + layer_index)


def synthetic_stores(
    layout: EngramLayout,
    placement: TablePlacement,
    *,
    seed: int = 0,
) -> list[RowStore]:
    """One store per Engram layer of ``layout`` (the placement's rank's shard), synthetic rows.

    Row ``g`` of a layer is the same whatever the shard
    (:func:`synthetic_rows`), so tensor-parallel ranks hold exactly their
    slice of the one table. Rows are computed on
    the compute device (fast on a GPU) and written into the tier's memory.
    """
    placement = check_placement(placement, "synthetic_stores(layout, TablePlacement('device'))")
    generator_device = placement.device if placement.device is not None else torch.device("cpu")
    stores = []
    for li in range(layout.n_layers):
        shard = placement.shard(layout, li)
        store = make_store(
            placement,
            num_rows=shard.num_rows,
            E=layout.config.head_dim,
            shard=shard if placement.tp > 1 else None,
            path=placement.disk_path(layout.config.layer_ids[li]),
            new_file=True,
        )
        for local_row, rows in synthetic_rows(
            layout, li, shard.row_begin, shard.row_end, seed=seed, device=generator_device
        ):
            store.write_rows(local_row, rows)
        store.flush()
        stores.append(store)
    return stores
