"""Row stores filled with random rows, for demos and benchmarks without a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engramrt.layout import EngramLayout
from engramrt.lookup.synthetic import random_packed_rows
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
    """Rows ``[row_begin, row_end)`` of layer ``layer_index``'s random table, in pieces.

    Yields ``(local_row, packed)``: ``packed`` holds rows ``row_begin +
    local_row`` onwards, generated on ``device``. Row ``g`` is the same
    whatever the range asked for: pieces of ``_FILL_ROWS`` global rows are
    seeded by their index.
    """
    device = torch.device(device)
    E = layout.config.head_dim
    for piece in range(row_begin // _FILL_ROWS, -(-row_end // _FILL_ROWS)):
        gen = torch.Generator(device=device).manual_seed(
            (seed * 1_000_003 + layer_index) * 1_000_003 + piece
        )
        rows = random_packed_rows(_FILL_ROWS, E, device, gen)
        lo = max(row_begin, piece * _FILL_ROWS)
        hi = min(row_end, (piece + 1) * _FILL_ROWS)
        base = piece * _FILL_ROWS
        yield lo - row_begin, rows[lo - base : hi - base]


def synthetic_stores(
    layout: EngramLayout,
    placement: TablePlacement,
    *,
    seed: int = 0,
) -> list[RowStore]:
    """One store per Engram layer of ``layout`` (the placement's rank's shard), random rows.

    Row ``g`` of a layer is the same whatever the shard
    (:func:`synthetic_rows`), so tensor-parallel ranks hold exactly their
    slice of the one table. Rows are generated on
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
