"""Tuning settings of the row-lookup kernels, as one frozen value.

:class:`LookupKernelSettings` travels whole from the public calls
(:func:`engramrt.lookup.lookup_rows`, every store, ``make_store``, the
cache) down to the launchers, and is hashable, so two lookups with equal
settings compile and launch the same kernel. It imports neither Triton nor
CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engramrt.errors import ValidationError

__all__ = ["DEFAULT_KERNEL", "LookupKernelSettings", "check_kernel_settings"]

_NUM_WARPS = (1, 2, 4, 8, 16, 32)


def _optional_positive_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValidationError(f"{name} = {value!r}; expected None or an int >= 1")


@dataclass(frozen=True)
class LookupKernelSettings:
    """How the gather + dequantise kernels are launched; the bytes they write never change.

    Attributes:
        rows_per_program: rows per tile (rounded up to a power of two);
            None: :data:`engramrt.lookup.kernel.DEFAULT_TILE_ELEMENTS` values
            per tile.
        num_warps: warps per program, a power of two in 1..32; None: 4.
        hw_convert: decode and round with the GPU's conversion instructions
            instead of integer operations (see
            :func:`engramrt._jit.dequantize_to_bf16_bits`).
        max_programs: launch at most this many programs, each serving
            consecutive tiles in turn; None: one tile per program. Meant for
            reads of host memory, whose programs mostly wait on the bus.
            The cache's probe kernel always runs one tile per program.
    """

    rows_per_program: int | None = None
    num_warps: int | None = None
    hw_convert: bool = False
    max_programs: int | None = None

    def __post_init__(self) -> None:
        _optional_positive_int("rows_per_program", self.rows_per_program)
        _optional_positive_int("max_programs", self.max_programs)
        if self.num_warps is not None and (
            isinstance(self.num_warps, bool) or self.num_warps not in _NUM_WARPS
        ):
            raise ValidationError(
                f"num_warps = {self.num_warps!r}; expected None or one of "
                f"{', '.join(map(str, _NUM_WARPS))}"
            )
        if not isinstance(self.hw_convert, bool):
            raise ValidationError(f"hw_convert = {self.hw_convert!r}; expected a bool")

    def replace(self, **changes: Any) -> LookupKernelSettings:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)


DEFAULT_KERNEL = LookupKernelSettings()
"""One tile of 4096 values per program, 4 warps, integer conversions."""


def check_kernel_settings(kernel: Any) -> LookupKernelSettings:
    """``kernel`` itself when it is a :class:`LookupKernelSettings`; else a ValidationError."""
    if not isinstance(kernel, LookupKernelSettings):
        raise ValidationError(
            f"kernel = {kernel!r}; expected a LookupKernelSettings (engramrt.lookup.settings)"
        )
    return kernel
