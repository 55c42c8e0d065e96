"""Launch configurations of the fused gate kernel, as frozen values.

:class:`GateConfig` says how :mod:`engramrt.gate.kernel` launches (chunk
width, warps, grid, pipelining, streams per program, unrolling); every
configuration computes the same function within the documented tolerance
(:func:`engramrt.gate.reference.gate_tolerance`). :func:`default_gate_config`
picks one from the shape, and for decode-sized batches from the table
:data:`DECODE_CONFIGS`. This module imports neither Triton nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

from engramrt.errors import ValidationError

__all__ = [
    "DECODE_CONFIGS",
    "DECODE_MAX_TOKENS",
    "SHAPE_CONFIGS",
    "VEC",
    "GateConfig",
    "default_gate_config",
]

VEC = 8
"""Elements per 16-byte bf16 vector: the innermost tile dimension."""


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class GateConfig:
    """Launch parameters of :func:`_engram_gate_kernel` (tune on the GPU).

    Attributes:
        block_d: width of one chunk of D (a power of two, >= 8).
        num_warps: warps per program.
        programs_per_sm: cap on the persistent grid, programs per SM; None
            launches one program per work item (a token, or a group of its
            streams).
        num_stages: software-pipelining depth of the D loops; 1 keeps the
            loops unpipelined (no shared-memory staging), so occupancy is set
            by registers alone.
        streams_per_program: hidden streams one program gates (None: all
            ``hc``, so the value row is read once per token). Fewer streams
            per program means ``ceil(hc / streams_per_program)`` programs per
            token: at a decode batch (T=256 tokens on 132 SMs) one program
            per token leaves most warp slots empty and each program walks its
            chunks one DRAM round trip after another; more, smaller programs
            run those round trips side by side. The value row is then read
            once per group, the extra reads coming mostly from L2.
        unroll: unroll the loops over D chunks (``tl.static_range``), so that
            the loads of every chunk of pass 1 can be issued before the first
            one returns: one DRAM round trip per pass instead of one per
            chunk, which is what bounds a small batch. Costs registers (all
            chunks' loads live at once), so it wants more warps.
    """

    block_d: int
    num_warps: int
    programs_per_sm: int | None = 2
    num_stages: int = 1
    streams_per_program: int | None = None
    unroll: bool = False

    def __post_init__(self) -> None:
        spp = self.streams_per_program
        if spp is not None and (isinstance(spp, bool) or not isinstance(spp, int) or spp < 1):
            raise ValidationError(f"streams_per_program = {spp!r}; expected None or an int >= 1")
        if not isinstance(self.unroll, bool):
            raise ValidationError(f"unroll = {self.unroll!r}; expected a bool")


SHAPE_CONFIGS: dict[tuple[int, int], GateConfig] = {
    (4, 5120): GateConfig(1024, 4, None, 1, streams_per_program=1),
}
"""Launch configuration by ``(hc, D)`` for 2-byte (bf16/fp16) operands, chosen by
measurement (see :func:`default_gate_config`); other shapes follow its rule."""

DECODE_MAX_TOKENS = 0
"""Batches of at most this many tokens use :data:`DECODE_CONFIGS` (0: never). In
the one H200 run of the decode variants, no configuration beat
:data:`SHAPE_CONFIGS` at T=256, so the table is off; ``bench/tune_gate.py`` and
the ``gate/T=256`` bench case time them."""

DECODE_CONFIGS: dict[tuple[int, int], GateConfig] = {
    (4, 5120): GateConfig(1024, 4, None, 1, streams_per_program=1, unroll=True),
}
"""Launch configuration by ``(hc, D)`` for decode-sized batches (at most
:data:`DECODE_MAX_TOKENS` tokens), where latency, not bandwidth, bounds the gate."""


def default_gate_config(
    hc: int, dim: int, element_bytes: int = 2, num_tokens: int | None = None
) -> GateConfig:
    """A launch configuration from the shape alone.

    ``element_bytes`` is the widest element among hidden, kv and the weights.
    One chunk is a ``[next_pow2(hc), block_d]`` tile of at most 8 KB per
    tensor at 4 warps, one program per token (no persistent grid).
    With 2-byte operands, a shape in :data:`SHAPE_CONFIGS` takes its entry
    there, and ``num_tokens`` (when given) at most :data:`DECODE_MAX_TOKENS`
    the entry of :data:`DECODE_CONFIGS`.

    Measured on an H200 (torch 2.11, Triton 3.6; ``bench/tune_gate.py``), hc=4,
    D=5120, bf16, T=8192, percent of the 4.27 TB/s device copy ceiling:

    =======================================  ======  ==========================
    GateConfig(block_d, warps, per_sm, st)   T=8192  T=256 (graph replay)
    =======================================  ======  ==========================
    (1024, 4, None, 1)  -- chosen            88.3%   11.4 µs
    (1024, 4, 4, 1)                          87.2%   11.0 µs
    (512, 4, 8, 1)                           77.8%   18.0 µs
    (2048, 8, 2, 1)                          76.7%   10.7 µs
    (2048, 8, None, 1)                       75.2%   11.1 µs
    (1024, 8, 2, 1)                          64.3%   12.0 µs
    (2048, 16, 1, 1)                         51.2%   15.5 µs
    (1024, 4, 4, 2), (2048, 8, 2, 2)         26.8%   ~36 µs
    =======================================  ======  ==========================

    Software pipelining through shared memory (``num_stages=2``) costs 3x:
    the loads are already 16 bytes wide and enough tokens are in flight.

    A later run (same machine and versions, graph replay, this kernel) timed
    streams per program and unrolled D loops beside the chosen configuration:

    ===================================================  ========  =========
    GateConfig(block_d, warps, per_sm, st, streams, unr)  T=8192    T=256
    ===================================================  ========  =========
    (1024, 4, None, 1)                                   288.7 µs  11.0 µs
    (1024, 4, None, 1, 1) -- chosen (SHAPE_CONFIGS)      277.6 µs   9.7 µs
    (1024, 4, None, 1, 1, unroll)                        308.0 µs   9.7 µs
    (1024, 4, None, 1, 2, unroll)                        315.3 µs  10.6 µs
    (1024, 4, None, 1, 2)                                292.3 µs  11.3 µs
    (1024, 8 or 16, None, 1, all, unroll)                ≥ 509 µs  ≥ 15.7 µs
    ===================================================  ========  =========

    One program per (token, stream) (the value row read four times, three of
    them mostly from L2) runs four times as many programs of a quarter of the
    work: at T=256 more of the GPU's warp slots wait on DRAM at once, at
    T=8192 the smaller programs keep more loads in flight per SM (92% of the
    copy ceiling against 88%). Unrolling costs registers and occupancy more
    than it saves in round trips.
    """
    if element_bytes == 2:
        if num_tokens is not None and num_tokens <= DECODE_MAX_TOKENS:
            decode = DECODE_CONFIGS.get((hc, dim))
            if decode is not None:
                return decode
        tuned = SHAPE_CONFIGS.get((hc, dim))
        if tuned is not None:
            return tuned
    hc_pad = _next_power_of_2(hc)
    tile_bytes = 8192
    block_d = max(VEC, min(_next_power_of_2(dim), tile_bytes // element_bytes // hc_pad))
    num_warps = max(1, min(4, hc_pad * block_d * element_bytes // 2048))
    return GateConfig(block_d=block_d, num_warps=num_warps, programs_per_sm=None)
