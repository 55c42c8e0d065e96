"""Plain PyTorch definition of the cache probe (the Triton kernel's reference).

One probe of ``row_ids [T, C]`` against a set-associative index
(:mod:`engramrt.cache.policy`):

- an owned lookup (column in ``[col_begin, col_end)``) whose row id is the
  tag of one of the ``ways`` slots of its set is a *hit*: its slot's packed
  row is dequantised into ``out[t, c]`` by
  :func:`engramrt.lookup.lookup_rows_reference` (the table being the
  cache's slots), so the bytes are those of every other tier;
- an owned lookup whose row is not cached is a *miss*: ``out[t, c]`` is left
  as it was (the caller fills it from the backing tier), or, given the
  backing tier's packed rows (``backing``), filled from them the same way;
- a column outside ``[col_begin, col_end)`` reads zeros, as in every tier.

``slots [T, C]`` int64 reports what happened: the slot of a hit,
:data:`~engramrt.cache.policy.MISS` or
:data:`~engramrt.cache.policy.NOT_OWNED`.
"""

from __future__ import annotations

import torch

from engramrt.cache.policy import MISS, NOT_OWNED, probe_slots
from engramrt.lookup.reference import lookup_rows_reference

__all__ = ["probe_gather_reference", "probe_slots"]


def probe_gather_reference(
    row_ids: torch.Tensor,
    tags: torch.Tensor,
    cache_rows: torch.Tensor,
    out: torch.Tensor,
    *,
    num_sets: int,
    ways: int,
    col_begin: int,
    col_end: int,
    backing: torch.Tensor | None = None,
    backing_row_begin: int = 0,
) -> torch.Tensor:
    """Probe ``row_ids [T, C]``; write hits and non-owned zeros into ``out [T, C, E]``.

    Args:
        row_ids: ``[T, C]`` int32/int64 global row ids.
        tags: ``[num_slots + 1]`` int64 tags (the last slot is scratch).
        cache_rows: ``[num_slots + 1, E + E/32]`` uint8 packed rows.
        out: ``[T, C, E]`` bf16, written at hits and non-owned columns only.
        num_sets, ways: the index geometry.
        col_begin, col_end: the owned hash columns.
        backing: ``[rows, E + E/32]`` uint8 packed rows of the backing tier,
            its row ``i`` being global row ``backing_row_begin + i``: misses
            are dequantised from it (then ``out`` is written everywhere); a
            miss outside its rows reads a row of zeros.

    Returns:
        ``slots [T, C]`` int64 on ``tags``' device.
    """
    num_tokens, num_cols = row_ids.shape
    E = out.shape[-1]
    cols = torch.arange(num_cols, device=tags.device)
    owned = ((cols >= col_begin) & (cols < col_end)).expand(num_tokens, num_cols)
    slots = torch.where(owned, probe_slots(row_ids, tags, num_sets, ways), NOT_OWNED)
    hit = slots >= 0
    # Hit slots read as row ids of a "table" whose rows are the cache's slots.
    rows = lookup_rows_reference(torch.where(hit, slots, 0), cache_rows, E)  # [T, C, E]
    zero = torch.zeros((), dtype=torch.bfloat16, device=rows.device)
    value = torch.where(hit[..., None], rows, zero).to(out.device)
    written = (hit | ~owned).to(out.device)
    if backing is not None:
        miss = (slots == MISS).to(out.device)
        local = torch.where(slots == MISS, row_ids.to(slots.device) - backing_row_begin, 0)
        missed = lookup_rows_reference(local.to(backing.device), backing, E).to(out.device)
        value = torch.where(miss[..., None], missed, value)
        written = written | miss
    out.copy_(torch.where(written[..., None], value, out))
    return slots
