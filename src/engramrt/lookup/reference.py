"""Plain PyTorch definition of the row lookup (SPEC §6, §7).

The one lookup contract: row ids ``[T, C]`` (int32 or int64; global row ids
of one layer, as hashing produces them) in, bf16 rows ``[T, C, E]`` out.

A table is stored *packed*: one uint8 row of ``E + E/32`` bytes, the ``E``
float8 e4m3fn value bytes followed by the ``E/32`` ue8m0 scale bytes (264 B
for ``E = 256``), so one lookup reads one contiguous row.

Head sharding (SPEC §7): a table object may hold only the contiguous rows
``[row_begin, row_begin + num_rows)`` that serve the hash columns
``[col_begin, col_end)`` (a tensor-parallel rank's shard: its columns'
bucket ranges are contiguous). Columns outside that range come back as
zeros (+0.0), so an all-gather over ranks rebuilds ``[T, C, E]``; an owned
column reads packed row ``row_id - row_begin``.
"""

from __future__ import annotations

import torch

from engramrt.errors import ValidationError
from engramrt.quant.reference import BLOCK, dequantize_rows_reference

__all__ = [
    "gather_packed_rows_reference",
    "lookup_rows_reference",
    "pack_rows",
    "row_bytes_for",
    "row_width_for",
    "unpack_rows",
    "word_dtype_for",
]


def row_bytes_for(row_width: int) -> int:
    """Bytes of one packed row of ``row_width`` (``E``) values: ``E + E/32``."""
    return row_width + row_width // BLOCK


_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def word_dtype_for(row_bytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``row_bytes`` (int64 for 264-byte rows)."""
    for size, dtype in _WORD_DTYPES:
        if row_bytes % size == 0:
            return dtype
    raise AssertionError("unreachable: a 1-byte word divides every row")  # pragma: no cover


def row_width_for(row_bytes: int) -> int:
    """``E`` of a packed row of ``row_bytes`` bytes (inverse of :func:`row_bytes_for`)."""
    row_width = row_bytes * BLOCK // (BLOCK + 1)
    if row_bytes <= 0 or row_bytes_for(row_width) != row_bytes or row_width % BLOCK != 0:
        raise ValidationError(
            f"packed rows have {row_bytes} bytes; expected E + E/32 for E a positive multiple "
            f"of {BLOCK} (264 for E=256)"
        )
    return row_width


def pack_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., E]`` fp8 values and ``[..., E/32]`` scale bytes -> ``[..., E + E/32]`` uint8."""
    if values.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValidationError(
            f"values has dtype {values.dtype}; expected torch.float8_e4m3fn (or uint8 bytes)"
        )
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValidationError(
            f"scales has dtype {scales.dtype}; expected torch.uint8 or torch.float8_e8m0fnu"
        )
    row_width = values.shape[-1] if values.dim() > 0 else 0
    expected = (*values.shape[:-1], row_width // BLOCK)
    if row_width <= 0 or row_width % BLOCK != 0 or tuple(scales.shape) != expected:
        raise ValidationError(
            f"values {tuple(values.shape)} and scales {tuple(scales.shape)}; expected "
            f"[..., E] with E a positive multiple of {BLOCK} and scales {expected}"
        )
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def unpack_rows(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., E + E/32]`` uint8 -> (``[..., E]`` float8_e4m3fn, ``[..., E/32]`` uint8), views."""
    if packed.dtype != torch.uint8 or packed.dim() < 1:
        raise ValidationError(
            f"packed is {packed.dtype} {tuple(packed.shape)}; expected uint8 [..., E + E/32]"
        )
    row_width = row_width_for(packed.shape[-1])
    values = packed[..., :row_width].view(torch.float8_e4m3fn)
    return values, packed[..., row_width:]


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
    packed = packed_table.index_select(0, (owned - row_begin).reshape(-1))  # [T*owned, E + E/32]
    values, scales = unpack_rows(packed)
    rows = dequantize_rows_reference(values, scales)  # [T*owned, E]
    out[:, col_begin:col_end] = rows.reshape(num_tokens, col_end - col_begin, E)
    return out


def gather_packed_rows_reference(
    row_ids: torch.Tensor, packed_table: torch.Tensor, row_begin: int = 0
) -> torch.Tensor:
    """Packed rows ``packed_table[row_ids - row_begin]``: ``[U]`` ids -> ``[U, row_bytes]`` uint8.

    The raw bytes, not dequantised: what a tier moves before the lookup
    kernel decodes it (:func:`engramrt.lookup.kernel.gather_packed_rows_triton`).
    """
    local = row_ids.to(device=packed_table.device, dtype=torch.int64) - row_begin
    return packed_table.index_select(0, local)
