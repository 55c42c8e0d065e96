"""Launch settings of the n-gram hash kernel, as one frozen value, and the tuned choice.

:class:`HashKernelConfig` says how ``_ngram_hash_kernel`` launches; every
choice gives the same row ids. :func:`kernel_config_for` picks one by token
count from the tuned data (``engramrt/tuned/ngram_hash.<device>.json``, read
by :func:`engramrt.tuning.tuned_config`). This module imports neither Triton
nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engramrt._launch import next_pow2
from engramrt.errors import ValidationError
from engramrt.tuning import cached_choice, register_tuned, tuned_config

__all__ = ["HashKernelConfig", "kernel_config_for"]


@register_tuned("ngram_hash")
@dataclass(frozen=True)
class HashKernelConfig:
    """Launch settings of ``_ngram_hash_kernel``; every choice gives the same row ids.

    Attributes:
        block_t: tokens per program (a power of two). Fewer spread a decode
            batch over more SMs, so more dependent-load chains and more of
            the hash arithmetic run in parallel and fewer lanes idle; more
            amortise each program's constant loads and request search over
            more tokens at prefill sizes.
        num_warps: warps per program (a power of two); more share one
            program's remainders and compare tile, at small ``block_t``
            they idle.
        scan_tile: find requests with ONE vector load of ``query_start_loc``
            and a ``block_t x max(16, next_pow2(R))`` int32 compare in
            registers when that tile has at most this many elements; beyond
            it (or at 0) a binary search, ``ceil(log2(R + 1))`` dependent
            loads (each a DRAM round trip when L2 is cold).
        ring_commit: with a :class:`RequestHistory`, write the ring inside
            the hash launch (no second kernel node) when
            ``T <= window - (N-1)``: no chunk is then long enough for a
            written slot to alias one read before it.
        fast_mod: remainders by the column primes through a float64
            reciprocal with an exact correction instead of a 64-bit integer
            division (used only when every prime is >= 4096, which the
            correction's error bound needs).
        speculate_decode: load lookback row ``i``, columns ``k-1``, for token
            ``i`` before the request search, as if every token were a
            decode token of its own request; right guesses (a decode batch)
            save one dependent load, wrong ones load after the search.
    """

    block_t: int = 64
    num_warps: int = 4
    scan_tile: int = 8192
    ring_commit: bool = True
    fast_mod: bool = True
    speculate_decode: bool = True

    def __post_init__(self) -> None:
        for name in ("block_t", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError(f"{name}={value!r} must be a positive power of two")
            if value & (value - 1):
                raise ValidationError(f"{name}={value} must be a power of two")
        if isinstance(self.scan_tile, bool) or not isinstance(self.scan_tile, int):
            raise ValidationError(f"scan_tile={self.scan_tile!r} must be an integer")
        if self.scan_tile < 0:
            raise ValidationError(f"scan_tile={self.scan_tile} must be >= 0 (0: binary search)")
        for name in ("ring_commit", "fast_mod", "speculate_decode"):
            flag = getattr(self, name)
            if not isinstance(flag, bool):
                raise ValidationError(f"{name}={flag!r} must be a bool (true or false)")

    def scan_width(self, num_requests: int) -> int:
        """``SCAN_R`` for a batch of ``num_requests``: the qsl tile width, 0 for a binary search.

        Powers of two from 16 up, so only a few variants ever compile.
        """
        width = max(16, next_pow2(num_requests))
        return width if self.block_t * width <= self.scan_tile else 0


@cached_choice
def kernel_config_for(num_tokens: int, device: Any = None) -> HashKernelConfig:
    """The tuned :class:`HashKernelConfig` for a batch of ``num_tokens`` on ``device``
    (host ints only; see :func:`engramrt.tuning.tuned_config`).

    The first entry of the device's ``ngram_hash`` file whose ``num_tokens``
    bucket holds the batch: decode sizes are a chain of dependent loads, so
    few tokens per program spread it over more SMs; large batches are
    throughput-bound and take more tokens per program. Chosen by the
    ``hash/sweep ...`` bench cases: BENCHMARKS.md#hash.
    """
    config = tuned_config("ngram_hash", device, {"num_tokens": num_tokens})
    return HashKernelConfig() if config is None else config
