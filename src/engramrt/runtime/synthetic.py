"""Row stores filled with random rows, for demos and benchmarks without a checkpoint."""

from __future__ import annotations

import torch

from engramrt.layout import EngramLayout
from engramrt.lookup.synthetic import random_packed_rows
from engramrt.lookup.tiers import make_store
from engramrt.lookup.tiers.base import RowStore

__all__ = ["synthetic_stores"]

_FILL_ROWS = 1 << 16  # rows generated per piece (17 MB at 264 B)


def synthetic_stores(
    layout: EngramLayout,
    tier: str,
    *,
    device: torch.device | str | None = None,
    tp: int = 1,
    rank: int = 0,
    seed: int = 0,
    **store_options: object,
) -> list[RowStore]:
    """One store per Engram layer of ``layout`` (this rank's shard), random rows.

    Row ``g`` of a layer is the same whatever the shard (pieces of
    ``_FILL_ROWS`` global rows are seeded by their index), so tensor-parallel
    ranks hold exactly their slice of the one table. Rows are generated on
    the compute device (fast on a GPU) and written into the tier's memory.
    """
    generator_device = torch.device(device) if device is not None else torch.device("cpu")
    stores = []
    for li in range(layout.n_layers):
        shard = layout.column_shard(li, tp, rank)
        store = make_store(
            tier,
            num_rows=shard.num_rows,
            E=layout.config.head_dim,
            device=device,
            row_begin=shard.row_begin,
            col_begin=shard.col_begin,
            col_end=shard.col_end if tp > 1 else None,
            **store_options,  # type: ignore[arg-type]
        )
        first_piece = shard.row_begin // _FILL_ROWS
        for piece in range(first_piece, -(-shard.row_end // _FILL_ROWS)):
            gen = torch.Generator(device=generator_device).manual_seed(
                (seed * 1_000_003 + li) * 1_000_003 + piece
            )
            rows = random_packed_rows(_FILL_ROWS, layout.config.head_dim, generator_device, gen)
            lo = max(shard.row_begin, piece * _FILL_ROWS)
            hi = min(shard.row_end, (piece + 1) * _FILL_ROWS)
            base = piece * _FILL_ROWS
            store.write_rows(lo - shard.row_begin, rows[lo - base : hi - base])
        stores.append(store)
    return stores
