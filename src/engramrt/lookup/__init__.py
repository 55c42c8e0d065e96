"""Row lookup: row ids ``[T, C]`` in, dequantised bf16 rows ``[T, C, E]`` out.

:func:`lookup_rows` serves a packed table that lives on the compute device
(the kernel of :mod:`.kernel`, or the reference of :mod:`.reference` chosen
by ``backend``). Tables in host memory or on disk are served by the storage
tiers of :mod:`engramrt.lookup.tiers`, all behind one ``RowStore``
interface and all returning the same bytes as :func:`lookup_rows_reference`.
"""

from __future__ import annotations

import torch

from engramrt._backend import resolve_backend
from engramrt.errors import ValidationError
from engramrt.lookup.reference import gather_packed_rows_reference, lookup_rows_reference
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelConfig, check_kernel_config
from engramrt.packed import check_packed_rows, pack_rows, row_bytes_for, row_width_for, unpack_rows

__all__ = [
    "DEFAULT_KERNEL",
    "LookupKernelConfig",
    "check_lookup_args",
    "check_row_ids_in_shard",
    "gather_packed_rows_reference",
    "lookup_rows",
    "lookup_rows_reference",
    "pack_rows",
    "row_bytes_for",
    "row_width_for",
    "unpack_rows",
]

_ID_DTYPES = (torch.int32, torch.int64)


def check_lookup_args(
    row_ids: torch.Tensor,
    col_begin: int,
    col_end: int | None,
    *,
    E: int,
    device: torch.device,
    out: torch.Tensor | None,
) -> int:
    """Check shapes, dtypes and the column range (host metadata only, no sync).

    Returns the resolved ``col_end``.
    """
    if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in _ID_DTYPES:
        found = row_ids.dtype if isinstance(row_ids, torch.Tensor) else type(row_ids).__name__
        raise ValidationError(f"row_ids has dtype {found}; expected torch.int32 or torch.int64")
    if row_ids.dim() != 2:
        raise ValidationError(
            f"row_ids has shape {tuple(row_ids.shape)}; expected [T, C] (tokens x hash columns)"
        )
    num_tokens, num_cols = row_ids.shape
    col_end = num_cols if col_end is None else col_end
    if not 0 <= col_begin <= col_end <= num_cols:
        raise ValidationError(
            f"columns [col_begin, col_end) = [{col_begin}, {col_end}); expected "
            f"0 <= col_begin <= col_end <= C = {num_cols}"
        )
    if out is not None:
        expected = (num_tokens, num_cols, E)
        if (
            out.dtype != torch.bfloat16
            or tuple(out.shape) != expected
            or not out.is_contiguous()
            or out.device != device
        ):
            raise ValidationError(
                f"out is {out.dtype} {tuple(out.shape)} on {out.device} (contiguous: "
                f"{out.is_contiguous()}); expected contiguous bfloat16 {expected} on {device}"
            )
    return col_end


def check_row_ids_in_shard(
    row_ids: torch.Tensor, col_begin: int, col_end: int, row_begin: int, row_end: int
) -> None:
    """Raise :class:`ValidationError` naming the first owned id outside ``[row_begin, row_end)``.

    Synchronises with the device: this is the checked mode, not the hot path.
    """
    owned = row_ids[:, col_begin:col_end]
    bad = (owned < row_begin) | (owned >= row_end)
    if owned.numel() > 0 and bool(bad.any()):
        token, col = (int(i) for i in torch.nonzero(bad)[0].tolist())
        raise ValidationError(
            f"row_ids[{token}, {col_begin + col}] = {int(owned[token, col])} for hash column "
            f"{col_begin + col}; expected a row of this shard, in [{row_begin}, {row_end})"
        )


def lookup_rows(
    row_ids: torch.Tensor,
    packed_table: torch.Tensor,
    *,
    col_begin: int = 0,
    col_end: int | None = None,
    row_begin: int = 0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
    check_ids: bool = False,
    kernel: LookupKernelConfig = DEFAULT_KERNEL,
) -> torch.Tensor:
    """Gather and dequantise packed rows: ``[T, C]`` ids -> ``[T, C, E]`` bf16.

    Args:
        row_ids: ``[T, C]`` int32/int64 global row ids, on ``packed_table``'s
            device (the reference also accepts them elsewhere).
        packed_table: ``[num_rows, E + E/32]`` uint8, contiguous, holding
            rows ``[row_begin, row_begin + num_rows)``.
        col_begin, col_end: hash columns this table serves; the others are
            returned as zeros (``col_end`` defaults to ``C``).
        row_begin: global id of the table's first row.
        out: optional contiguous ``[T, C, E]`` bf16 to write (a fixed
            address, e.g. for CUDA-graph capture).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        validate: check shapes, dtypes, devices, the column range and
            ``kernel`` on the host (never synchronises).
        check_ids: reject owned ids outside the table's rows (synchronises).
            Off on the hot path, where such an id reads as a row of zeros
            (see :mod:`engramrt.lookup.reference`), never out of bounds.
        kernel: the kernel's tuning settings (see
            :class:`~engramrt.lookup.settings.LookupKernelConfig`); the same
            bytes for every setting (``hw_convert``: on a GPU).

    Returns:
        ``out`` or a new ``[T, C, E]`` bf16 tensor on ``packed_table``'s device.
    """
    if validate:
        check_packed_rows("packed_table", packed_table)
        check_kernel_config(kernel)
    row_width = row_width_for(packed_table.shape[1])
    device = packed_table.device
    num_rows = packed_table.shape[0]
    if validate:
        col_end = check_lookup_args(
            row_ids, col_begin, col_end, E=row_width, device=device, out=out
        )
    elif col_end is None:
        col_end = row_ids.shape[1]
    if check_ids:
        check_row_ids_in_shard(row_ids, col_begin, col_end, row_begin, row_begin + num_rows)
    if resolve_backend(backend, device) == "reference":
        rows = lookup_rows_reference(
            row_ids, packed_table, row_width, col_begin, col_end, row_begin
        )
        return rows if out is None else out.copy_(rows)
    if validate and row_ids.device != device:
        raise ValidationError(
            f"row_ids is on {row_ids.device}; expected packed_table's device {device}"
        )
    from engramrt.lookup.kernel import lookup_rows_triton

    if out is None:
        out = torch.empty((*row_ids.shape, row_width), dtype=torch.bfloat16, device=device)
    return lookup_rows_triton(
        row_ids,
        packed_table,
        out,
        E=row_width,
        col_begin=col_begin,
        col_end=col_end,
        row_begin=row_begin,
        num_rows=num_rows,
        kernel=kernel,
    )
