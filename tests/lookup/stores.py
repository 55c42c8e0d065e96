"""Stores over rows that no layout placed (a table at any row offset, any columns), for
tests of the tiers and of what wraps them."""

from __future__ import annotations

import os

import torch

from engramrt._device import default_compute_device
from engramrt.lookup.tiers import RowStore, TierOptions, tier_class
from engramrt.packed import row_width_for


def store_of(
    tier: str | TierOptions,
    table: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    row_begin: int = 0,
    col_begin: int = 0,
    col_end: int | None = None,
    path: str | os.PathLike[str] | None = None,
) -> RowStore:
    """A store of ``tier`` (a name: its default options) holding ``table`` as rows
    ``[row_begin, ...)`` that serves columns ``[col_begin, col_end)`` (None: up to the last
    column of each batch)."""
    options = tier_class(tier).options_type() if isinstance(tier, str) else tier
    store = tier_class(options.tier).build(
        table.shape[0],
        row_width_for(table.shape[1]),
        options,
        path=path,
        new_file=True,
        device=torch.device(device) if device is not None else default_compute_device(),
        row_begin=row_begin,
        col_begin=col_begin,
        col_end=col_end,
    )
    store.write_rows(0, table)
    store.flush()
    return store
