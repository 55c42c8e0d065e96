"""A trainable Engram table: float master rows with a sparse-row backward.

Training keeps one fp32 master table ``[num_rows, E]`` per Engram layer (the
packed fp8 table of SPEC §6 is made from it afterwards with
:func:`engramrt.quant.quantize_rows`). fp32, not bf16: the optimizer's small
per-step updates would be rounded away in bf16, and a separate bf16 copy
would only save memory on the forward gather.

The forward has the inference lookup's contract (:mod:`engramrt.lookup.reference`):
global row ids ``[T, C]`` of one layer in, rows ``[T, C, E]`` out, columns
outside ``[col_begin, col_end)`` and ids outside ``[row_begin, row_begin +
num_rows)`` read as zeros and receive no gradient.

The backward never builds a dense ``[num_rows, E]`` gradient: it returns a
sparse COO tensor holding only the touched rows, the unique local ids
``[U]`` (sorted, each once) and their summed gradients ``[U, E]`` (duplicate ids add up as
dense autograd's ``index_add`` would). Gradient memory is ``U * (E + 1)``
elements with ``U <= T * C``, whatever ``num_rows`` is. Finding the unique
ids has a data-dependent size (one host synchronisation), so the backward is
not CUDA-graph capturable; the forward is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engramrt.errors import ValidationError, expect
from engramrt.packed import pack_rows
from engramrt.quant import quantize_rows

__all__ = ["EngramTable", "lookup_master_rows", "sum_rows_by_id"]


def _local_rows(
    owned_ids: torch.Tensor, num_rows: int, row_begin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local rows ``owned_ids - row_begin`` (0 outside the table) and whether
    each id is inside ``[0, num_rows)``."""
    local = owned_ids.to(torch.int64) - row_begin
    in_table = (local >= 0) & (local < num_rows)
    return torch.where(in_table, local, 0), in_table


def sum_rows_by_id(
    local_ids: torch.Tensor, row_grads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids ``[U]`` (sorted) and the sum of ``row_grads [N, E]`` over each id's
    occurrences ``[U, E]``, accumulated in the gradient's dtype."""
    unique_ids, inverse = torch.unique(local_ids, sorted=True, return_inverse=True)
    summed = row_grads.new_zeros((unique_ids.shape[0], row_grads.shape[1]))
    summed.index_add_(0, inverse, row_grads)
    return unique_ids, summed


class _MasterRowLookup(torch.autograd.Function):
    """Gather of owned rows with a sparse COO gradient for the table."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        row_ids: torch.Tensor,
        table: torch.Tensor,
        col_begin: int,
        col_end: int,
        row_begin: int,
    ) -> torch.Tensor:
        num_tokens, num_cols = row_ids.shape
        num_rows, dim = table.shape
        owned = row_ids[:, col_begin:col_end].reshape(-1)  # [T * owned]
        local, in_table = _local_rows(owned, num_rows, row_begin)
        out = table.new_zeros((num_tokens, num_cols, dim))  # [T, C, E]
        if num_rows > 0:
            rows = table.index_select(0, local)  # [T * owned, E]
            rows = torch.where(in_table[:, None], rows, torch.zeros((), dtype=rows.dtype))
            out[:, col_begin:col_end] = rows.reshape(num_tokens, col_end - col_begin, dim)
        ctx.save_for_backward(local, in_table)
        ctx.table_shape = (num_rows, dim)
        ctx.cols = (col_begin, col_end)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        local, in_table = ctx.saved_tensors
        col_begin, col_end = ctx.cols
        num_rows, dim = ctx.table_shape
        grad_table = None
        if ctx.needs_input_grad[1]:
            row_grads = grad_out[:, col_begin:col_end].reshape(-1, dim)  # [T * owned, E]
            ids, summed = sum_rows_by_id(local[in_table], row_grads[in_table])
            grad_table = torch.sparse_coo_tensor(
                ids.unsqueeze(0),
                summed,
                (num_rows, dim),
                is_coalesced=True,
                check_invariants=False,  # unique sorted in-range ids by construction
            )
        return None, grad_table, None, None, None


def lookup_master_rows(
    row_ids: torch.Tensor,
    table: torch.Tensor,
    col_begin: int = 0,
    col_end: int | None = None,
    row_begin: int = 0,
) -> torch.Tensor:
    """Rows ``[T, C, E]`` (``table``'s dtype) of ``table [num_rows, E]`` for global
    ``row_ids [T, C]``, differentiable in ``table`` with a sparse gradient.

    Zeros (and no gradient) for columns outside ``[col_begin, col_end)`` and for
    ids outside ``[row_begin, row_begin + num_rows)``.
    """
    expect(
        row_ids.dim() == 2 and row_ids.dtype in (torch.int32, torch.int64),
        ValidationError,
        f"row_ids must be a [T, C] int32/int64 tensor, got shape {tuple(row_ids.shape)} "
        f"dtype {row_ids.dtype}",
    )
    expect(
        table.dim() == 2 and table.is_floating_point(),
        ValidationError,
        f"table must be a [num_rows, E] float tensor, got shape {tuple(table.shape)} "
        f"dtype {table.dtype}",
    )
    num_cols = row_ids.shape[1]
    col_end = num_cols if col_end is None else col_end
    expect(
        0 <= col_begin <= col_end <= num_cols,
        ValidationError,
        f"col_begin, col_end must satisfy 0 <= col_begin <= col_end <= C = {num_cols}, "
        f"got {col_begin}, {col_end}",
    )
    expect(
        row_ids.device == table.device,
        ValidationError,
        f"row_ids is on {row_ids.device}, expected table's device {table.device}",
    )
    out: torch.Tensor = _MasterRowLookup.apply(row_ids, table, col_begin, col_end, row_begin)
    return out


class EngramTable(nn.Module):
    """One Engram layer's trainable table (or a tensor-parallel shard of it).

    Holds ``weight``: an fp32 ``[num_rows, E]`` parameter for global rows
    ``[row_begin, row_begin + num_rows)`` serving hash columns ``[col_begin,
    col_end)``. ``forward(row_ids [T, C]) -> [T, C, E]`` fp32. After backward,
    ``weight.grad`` is a sparse COO tensor holding the touched rows only
    (each once); update it with :class:`engramrt_lab.training.SparseRowAdam`.
    """

    def __init__(
        self,
        num_rows: int,
        E: int,
        *,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        expect(num_rows >= 0, ValidationError, f"num_rows must be >= 0, got {num_rows}")
        expect(E > 0, ValidationError, f"E must be > 0, got {E}")
        expect(row_begin >= 0, ValidationError, f"row_begin must be >= 0, got {row_begin}")
        expect(col_begin >= 0, ValidationError, f"col_begin must be >= 0, got {col_begin}")
        expect(
            math.isfinite(init_std) and init_std >= 0,
            ValidationError,
            f"init_std must be a finite number >= 0, got {init_std}",
        )
        self.row_begin = row_begin
        self.col_begin = col_begin
        self.col_end = col_end
        weight = torch.empty((num_rows, E), dtype=torch.float32, device=device)
        nn.init.normal_(weight, mean=0.0, std=init_std)
        self.weight = nn.Parameter(weight)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        return lookup_master_rows(
            row_ids, self.weight, self.col_begin, self.col_end, self.row_begin
        )

    @torch.no_grad()
    def packed_rows(self, *, backend: str = "auto") -> torch.Tensor:
        """The master table quantised for serving (SPEC §6): ``[num_rows, E + E/32]``
        uint8 packed rows, readable by :func:`engramrt.lookup.reference.lookup_rows_reference`
        with this module's ``row_begin`` and columns. ``E`` must be a multiple of 32."""
        values, scales = quantize_rows(self.weight.detach(), backend=backend)
        return pack_rows(values, scales)

    def extra_repr(self) -> str:
        num_rows, dim = self.weight.shape
        return (
            f"num_rows={num_rows}, E={dim}, row_begin={self.row_begin}, "
            f"cols=[{self.col_begin}, {self.col_end})"
        )
