"""The one interface every storage tier implements.

A :class:`RowStore` holds the packed rows ``[row_begin, row_end)`` of one
layer's table (a whole table, or a tensor-parallel rank's shard serving the
hash columns ``[col_begin, col_end)``) in some memory, and answers
``lookup(row_ids [T, C]) -> [T, C, E]`` bf16 on its compute device with the
bytes of :func:`engramrt.lookup.reference.lookup_rows_reference`.
Where the rows live, and how they reach the device, is the tier's business;
a new tier is a new file, not an ``if`` in every caller.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from engramrt.errors import ValidationError
from engramrt.lookup import check_lookup_args, check_row_ids_in_shard
from engramrt.lookup.reference import row_bytes_for
from engramrt.quant import check_row_width
from engramrt.source import RowSource

__all__ = ["RowStore", "default_compute_device"]


def default_compute_device() -> torch.device:
    """The current CUDA device when there is one, the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _with_index(device: torch.device | str) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``, so it compares equal to tensors' devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class RowStore(RowSource):
    """Packed table rows in one kind of memory, served through :meth:`lookup`.

    Attributes:
        tier: the tier's name (``"device"``, ``"uva"``, ``"host"``, ``"disk"``).
        num_rows: rows held (``row_end - row_begin``).
        E: values per row; ``row_bytes = E + E/32`` bytes per packed row.
        row_begin, row_end: the global row ids held, ``[row_begin, row_end)``.
        col_begin, col_end: the hash columns served; ``col_end=None`` means
            "up to the last column of each batch". Other columns read as 0.
        device: where :meth:`lookup` writes its output (the compute device).
        validate: check every batch's owned ids against the shard (one host
            synchronisation per call); off on the hot path.
    """

    tier: ClassVar[str]

    def __init__(
        self,
        num_rows: int,
        E: int,
        *,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = False,
    ) -> None:
        check_row_width("E", E)
        if num_rows < 0:
            raise ValidationError(f"num_rows = {num_rows}; expected >= 0")
        if row_begin < 0:
            raise ValidationError(f"row_begin = {row_begin}; expected >= 0")
        if col_begin < 0 or (col_end is not None and col_end < col_begin):
            raise ValidationError(
                f"columns [col_begin, col_end) = [{col_begin}, {col_end}); expected "
                f"0 <= col_begin <= col_end"
            )
        self.num_rows = int(num_rows)
        self.E = int(E)
        self.row_bytes = row_bytes_for(self.E)
        self.row_begin = int(row_begin)
        self.col_begin = int(col_begin)
        self.col_end = None if col_end is None else int(col_end)
        self.device = _with_index(device) if device is not None else default_compute_device()
        self.validate = validate

    @property
    def row_end(self) -> int:
        return self.row_begin + self.num_rows

    @property
    def nbytes(self) -> int:
        """Bytes of packed rows held (``num_rows * row_bytes``)."""
        return self.num_rows * self.row_bytes

    def lookup(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, C]`` int32/int64 global row ids -> ``[T, C, E]`` bf16 on :attr:`device`.

        Columns outside ``[col_begin, col_end)`` are zeros. ``out``, when
        given, is a contiguous ``[T, C, E]`` bf16 tensor on :attr:`device`.
        """
        col_end = check_lookup_args(
            row_ids, self.col_begin, self.col_end, E=self.E, device=self.device, out=out
        )
        if self.validate:
            check_row_ids_in_shard(row_ids, self.col_begin, col_end, self.row_begin, self.row_end)
        return self._lookup(row_ids, col_end, out)

    @abstractmethod
    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The tier's lookup, arguments already checked."""

    def served_columns(self, num_cols: int) -> tuple[int, int]:
        return self.col_begin, num_cols if self.col_end is None else min(self.col_end, num_cols)

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A store's rows for a step are its :meth:`lookup` (the :class:`RowSource` contract)."""
        return self.lookup(row_ids, out)

    def device_rows(self) -> Any:
        """The packed rows ``[num_rows, row_bytes]`` as the compute device's kernels can read
        them in place (local row ``i`` at byte ``i * row_bytes``): a device tensor, or host
        memory mapped for the device (an object with ``data_ptr()`` and ``dtype`` uint8).
        None when kernels cannot read them (the CPU gathers them, or there are none)."""
        return None

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows ``[U, row_bytes]`` uint8 on :attr:`device` of local ids ``[U]`` int64.

        Local ids are ``row_id - row_begin``. For consumers that keep or
        move rows themselves (a row cache): one trip per row, no dequantise.
        """
        raise ValidationError(
            f"{type(self).__name__} (tier={self.tier!r}) offers no packed rows; expected a "
            f"tier that stores them"
        )

    @abstractmethod
    def _write(self, start: int, packed: torch.Tensor) -> None:
        """Copy ``packed [n, row_bytes]`` (CPU or device) into local rows ``[start, start + n)``."""

    def write_rows(self, start: int, packed: torch.Tensor) -> None:
        """Fill local rows ``[start, start + n)`` from packed rows ``[n, row_bytes]`` uint8.

        Rows are written in pieces so a checkpoint can stream in without
        holding a whole table twice.
        """
        if (
            not isinstance(packed, torch.Tensor)
            or packed.dtype != torch.uint8
            or packed.dim() != 2
            or packed.shape[1] != self.row_bytes
        ):
            found = (
                f"{packed.dtype} {tuple(packed.shape)}"
                if isinstance(packed, torch.Tensor)
                else type(packed).__name__
            )
            raise ValidationError(f"packed is {found}; expected uint8 [n, {self.row_bytes}]")
        if not 0 <= start <= start + packed.shape[0] <= self.num_rows:
            raise ValidationError(
                f"rows [{start}, {start + packed.shape[0]}) to write; expected a range inside "
                f"[0, {self.num_rows}) (local rows of this store)"
            )
        self._write(start, packed)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tier={self.tier!r}, rows=[{self.row_begin}, {self.row_end}), "
            f"cols=[{self.col_begin}, {self.col_end}), E={self.E}, nbytes={self.nbytes}, "
            f"device={self.device})"
        )
