"""Launch settings of the row-lookup kernels, as one frozen value, and the tuned choice.

:class:`LookupKernelConfig` travels whole from the public calls
(:func:`engramrt.lookup.lookup_rows`, every store, ``make_store``, the
cache) down to the launchers, and is hashable, so two lookups with equal
settings compile and launch the same kernel. :func:`tuned_lookup_config`
gives a tier's tuned settings on a device
(``engramrt/tuned/lookup_rows.<device>.json``, read by
:func:`engramrt.tuning.tuned_config`). It imports neither Triton nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engramrt.errors import ValidationError
from engramrt.tuning import register_tuned, tuned_config

__all__ = ["DEFAULT_KERNEL", "LookupKernelConfig", "check_kernel_config", "tuned_lookup_config"]

_NUM_WARPS = (1, 2, 4, 8, 16, 32)
_CACHE_MODIFIERS = ("", ".ca", ".cg", ".cv")


def _optional_positive_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValidationError(f"{name} = {value!r}; expected None or an int >= 1")


@register_tuned("lookup_rows")
@dataclass(frozen=True)
class LookupKernelConfig:
    """How the gather + dequantise kernels are launched; the bytes they write never change.

    Attributes:
        rows_per_program: rows per tile (rounded up to a power of two);
            None: :data:`engramrt.lookup.kernel.DEFAULT_TILE_ELEMENTS` values
            per tile.
        num_warps: warps per program, a power of two in 1..32; None: 4.
        hw_convert: decode and round with the GPU's conversion instructions
            (True) or with integer operations (False); see
            :func:`engramrt._jit.dequantize_to_bf16_bits`. None (default): the
            conversion instructions on a GPU, where they write the same bytes
            (checked for every value byte and scale byte) with fewer
            instructions per value, and the lookup from device memory is
            bound by the integer pipe (BENCHMARKS.md#lookup, ``hw_convert``);
            integer operations under Triton's interpreter, whose casts are
            not the GPU's.
        max_programs: launch at most this many programs, each serving
            consecutive tiles in turn; None: one tile per program. Meant for
            reads of host memory, whose programs mostly wait on the bus.
            The cache's probe kernel always runs one tile per program.
        num_stages: Triton's software-pipelining depth for the loop over a
            program's tiles (only matters with ``max_programs``: the loads
            of the next tile can be issued while the current one is
            converted and stored); None: Triton's default.
        cache_modifier: the cache operator of the table loads: ``""``
            (default, cached in L1 and L2), ``".cg"`` (L2 only: rows are
            read once, so L1 lines only hold space another load could
            use), ``".ca"``, ``".cv"`` (no caching, fetched again). The
            default stays where ``.cg`` measured slower (BENCHMARKS.md#lookup).
        cached_launch: launch through :class:`engramrt._launch.CachedLauncher`
            (the compiled kernel called directly) instead of
            ``kernel[grid](...)``, which binds and specialises ~20 arguments
            in Python on every call, a host cost of the order of a decode
            step's kernel. False is for debugging: the same kernel, the same
            bytes.
    """

    rows_per_program: int | None = None
    num_warps: int | None = None
    hw_convert: bool | None = None
    max_programs: int | None = None
    num_stages: int | None = None
    cache_modifier: str = ""
    cached_launch: bool = True

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
        _optional_positive_int("num_stages", self.num_stages)
        if self.hw_convert is not None and not isinstance(self.hw_convert, bool):
            raise ValidationError(f"hw_convert = {self.hw_convert!r}; expected None or a bool")
        if not isinstance(self.cached_launch, bool):
            raise ValidationError(f"cached_launch = {self.cached_launch!r}; expected a bool")
        if self.cache_modifier not in _CACHE_MODIFIERS:
            raise ValidationError(
                f"cache_modifier = {self.cache_modifier!r}; expected one of "
                f"{', '.join(map(repr, _CACHE_MODIFIERS))}"
            )

    def resolved_hw_convert(self, interpreted: bool) -> bool:
        """Whether the kernel uses the conversion instructions: :attr:`hw_convert`, or
        when None, whether it runs on a GPU (not ``interpreted``)."""
        return (not interpreted) if self.hw_convert is None else self.hw_convert

    def replace(self, **changes: Any) -> LookupKernelConfig:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)


DEFAULT_KERNEL = LookupKernelConfig()
"""Every field left to the kernel's rule: one tile of
:data:`engramrt.lookup.kernel.DEFAULT_TILE_ELEMENTS` values per program, 4 warps,
the GPU's conversion instructions (integer ones in the interpreter), one tile
per program, launched through the cached launcher."""


def tuned_lookup_config(tier: str, device: Any = None) -> LookupKernelConfig:
    """The lookup kernel's settings for a storage tier on ``device``: the entry for
    ``tier`` in the device's ``lookup_rows`` file (reads of host memory want a
    bounded grid: programs mostly wait on the bus; chosen by measurement,
    BENCHMARKS.md#what-keeping-the-tables-off-the-gpu-costs), else
    :data:`DEFAULT_KERNEL`.

    ``device``: a ``torch.device``, a device name or None (the default file).
    """
    tuned = tuned_config("lookup_rows", device, {"tier": tier})
    return DEFAULT_KERNEL if tuned is None else tuned


def check_kernel_config(kernel: Any) -> LookupKernelConfig:
    """``kernel`` itself when it is a :class:`LookupKernelConfig`; else a ValidationError."""
    if not isinstance(kernel, LookupKernelConfig):
        raise ValidationError(
            f"kernel = {kernel!r}; expected a LookupKernelConfig (engramrt.lookup.settings)"
        )
    return kernel
