"""Synthetic tier: rows computed from their row id, no storage at all.

For demos and tests at real layouts (a V4.1-Flash layer has 384 M rows):
the rows of :func:`engramrt.lookup.synthetic.synthetic_packed_rows`, the same
on every device and for every shard (a rank holding rows ``[row_begin,
row_end)`` serves exactly those rows of the whole table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engramrt.errors import ValidationError
from engramrt.family import FP8_UE8M0
from engramrt.lookup.synthetic import synthetic_packed_rows
from engramrt.lookup.tiers.base import RowStore, register_tier
from engramrt.lookup.tiers.options import BACKENDS, TierOptions, check_int
from engramrt.quant import dequantize_rows

__all__ = ["SyntheticOptions", "SyntheticRowStore", "synthetic_packed_rows"]


@dataclass(frozen=True)
class SyntheticOptions(TierOptions):
    """Settings of tier ``"synthetic"``.

    Attributes:
        seed: selects the table (an int >= 0).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the dequantise.
        validate, check_ids: see :class:`~engramrt.lookup.tiers.options.TierOptions`.
    """

    tier = "synthetic"
    seed: int = 0
    backend: str = "auto"

    def _check(self) -> None:
        check_int(self, "seed", 0)
        if self.backend not in BACKENDS:
            raise self.error("backend", " or ".join(repr(b) for b in BACKENDS))


@register_tier
class SyntheticRowStore(RowStore):
    """Rows ``[row_begin, row_end)`` of a synthetic table (see the module doc).

    Args: see :class:`RowStore`; options: :class:`SyntheticOptions`.

    Every id reads its synthetic row, inside the shard or not: nothing is
    stored that an id could read out of bounds.
    """

    tier = "synthetic"
    options_type = SyntheticOptions
    row_formats = (FP8_UE8M0,)  # it computes fp8 rows

    def _setup(self) -> None:
        assert isinstance(self.options, SyntheticOptions)
        self.seed = self.options.seed
        self.backend = self.options.backend

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens, num_cols = row_ids.shape
        if out is None:
            out = torch.empty(
                (num_tokens, num_cols, self.E), dtype=torch.bfloat16, device=self.device
            )
        out.zero_()
        owned = row_ids[:, self.col_begin : col_end].to(self.device)
        if owned.numel():
            packed = synthetic_packed_rows(owned, self.E, self.seed)
            values = packed[..., : self.E].contiguous().view(torch.float8_e4m3fn)
            scales = packed[..., self.E :].contiguous()
            rows = dequantize_rows(values, scales, backend=self.backend)
            out[:, self.col_begin : col_end] = rows
        return out

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        return synthetic_packed_rows(local_ids.to(self.device) + self.row_begin, self.E, self.seed)

    def _write(self, start: int, packed: torch.Tensor) -> None:
        raise ValidationError("a SyntheticRowStore computes its rows; write_rows is not supported")
