"""Plain PyTorch definition of the row lookup (SPEC §6, §7).

The one lookup contract: row ids ``[T, C]`` (int32 or int64; global row ids
of one layer, as hashing produces them) in, bf16 rows ``[T, C, E]`` out.

A table is stored *packed* (:mod:`engramrt.packed`): one uint8 row of
``E + E/32`` bytes, values then scales.

Head sharding (SPEC §7): a table object may hold only the contiguous rows
``[row_begin, row_begin + num_rows)`` that serve the hash columns
``[col_begin, col_end)`` (a tensor-parallel rank's shard: its columns'
bucket ranges are contiguous). Columns outside that range come back as
zeros (+0.0), so an all-gather over ranks rebuilds ``[T, C, E]``; an owned
column reads packed row ``row_id - row_begin``.

Ids outside the table: an owned id outside ``[row_begin, row_begin +
num_rows)`` (negative, past the shard, any int64) reads as a row of zeros
(+0.0 everywhere), exactly as a non-owned column does. Checking ids is the
caller's choice (``check_ids``, one host synchronisation); with it off the
result is still defined and no kernel reads outside the table.
"""

from __future__ import annotations

import torch

from engramrt.packed import unpack_rows
from engramrt.quant.reference import dequantize_rows_reference

__all__ = ["gather_packed_rows_reference", "lookup_rows_reference"]


def lookup_rows_reference(
    row_ids: torch.Tensor,
    packed_table: torch.Tensor,
    E: int,
    col_begin: int = 0,
    col_end: int | None = None,
    row_begin: int = 0,
) -> torch.Tensor:
    """Gather, unpack and dequantise rows; zeros for columns this table does not own.

    Args:
        row_ids: ``[T, C]`` int32/int64 global row ids of one layer.
        packed_table: ``[num_rows, E + E/32]`` uint8 holding rows
            ``[row_begin, row_begin + num_rows)``.
        E: values per row.
        col_begin, col_end: the hash columns this table serves (``col_end``
            defaults to ``C``).
        row_begin: global id of the table's first row.

    Returns:
        ``[T, C, E]`` bf16 on ``packed_table``'s device.
    """
    num_tokens, num_cols = row_ids.shape
    col_end = num_cols if col_end is None else col_end
    out = torch.zeros((num_tokens, num_cols, E), dtype=torch.bfloat16, device=packed_table.device)
    owned = row_ids[:, col_begin:col_end].to(device=packed_table.device, dtype=torch.int64)
    local, in_table = _local_rows(owned.reshape(-1), packed_table.shape[0], row_begin)
    if packed_table.shape[0] == 0:
        return out  # every owned id is outside an empty table
    packed = packed_table.index_select(0, local)  # [T*owned, E + E/32]
    values, scales = unpack_rows(packed)
    rows = dequantize_rows_reference(values, scales)  # [T*owned, E]
    rows = torch.where(in_table[:, None], rows, torch.zeros((), dtype=rows.dtype))
    out[:, col_begin:col_end] = rows.reshape(num_tokens, col_end - col_begin, E)
    return out


def _local_rows(
    row_ids: torch.Tensor, num_rows: int, row_begin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local rows ``row_ids - row_begin`` (0 where outside ``[0, num_rows)``) and
    whether each id is inside the table."""
    local = row_ids - row_begin
    in_table = (local >= 0) & (local < num_rows)
    return torch.where(in_table, local, 0), in_table


def gather_packed_rows_reference(
    row_ids: torch.Tensor, packed_table: torch.Tensor, row_begin: int = 0
) -> torch.Tensor:
    """Packed rows ``packed_table[row_ids - row_begin]``: ``[U]`` ids -> ``[U, row_bytes]`` uint8.

    The raw bytes, not dequantised: what a tier moves before the lookup
    kernel decodes it (:func:`engramrt.lookup.kernel.gather_packed_rows_triton`).
    An id outside the table gives a row of zero bytes.
    """
    ids = row_ids.to(device=packed_table.device, dtype=torch.int64)
    local, in_table = _local_rows(ids, packed_table.shape[0], row_begin)
    if packed_table.shape[0] == 0:
        return packed_table.new_zeros((ids.shape[0], packed_table.shape[1]))
    rows = packed_table.index_select(0, local)
    return rows.masked_fill_(~in_table[:, None], 0)
