"""Launch configurations of the fused gate kernel, as frozen values.

:class:`GateKernelConfig` says how :mod:`engramrt.gate.kernel` launches (chunk
width, warps, grid, pipelining, streams per program, unrolling); every
configuration computes the same function within the documented tolerance
(:func:`engramrt.gate.reference.gate_tolerance`). :func:`default_gate_config`
picks one: the tuned entry for the shape and device when there is one
(``engramrt/tuned/engram_gate.<device>.json``, read by
:func:`engramrt.tuning.tuned_config`), else a rule of the shape. This module
imports neither Triton nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engramrt.errors import ValidationError
from engramrt.tuning import register_tuned, tuned_config

__all__ = ["VEC", "GateKernelConfig", "default_gate_config"]

VEC = 8
"""Elements per 16-byte bf16 vector: the innermost tile dimension."""


_NUM_WARPS = (1, 2, 4, 8, 16, 32)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@register_tuned("engram_gate")
@dataclass(frozen=True)
class GateKernelConfig:
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
        # Triton needs power-of-two tile widths and warp counts; a chunk narrower than
        # one 16-byte vector (VEC elements) has no layout.
        block_d = self.block_d
        if (
            isinstance(block_d, bool)
            or not isinstance(block_d, int)
            or block_d < VEC
            or block_d & (block_d - 1)
        ):
            raise ValidationError(
                f"block_d = {block_d!r}; expected a power of two >= {VEC} (an int)"
            )
        num_warps = self.num_warps
        if isinstance(num_warps, bool) or num_warps not in _NUM_WARPS:
            raise ValidationError(
                f"num_warps = {num_warps!r}; expected one of {', '.join(map(str, _NUM_WARPS))}"
            )
        pps = self.programs_per_sm
        if pps is not None and (isinstance(pps, bool) or not isinstance(pps, int) or pps < 1):
            raise ValidationError(f"programs_per_sm = {pps!r}; expected None or an int >= 1")
        stages = self.num_stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValidationError(f"num_stages = {stages!r}; expected an int >= 1")
        spp = self.streams_per_program
        if spp is not None and (isinstance(spp, bool) or not isinstance(spp, int) or spp < 1):
            raise ValidationError(f"streams_per_program = {spp!r}; expected None or an int >= 1")
        if not isinstance(self.unroll, bool):
            raise ValidationError(f"unroll = {self.unroll!r}; expected a bool")


def default_gate_config(
    hc: int,
    dim: int,
    element_bytes: int = 2,
    num_tokens: int | None = None,
    device: Any = None,
) -> GateKernelConfig:
    """A launch configuration for a shape on a device.

    ``element_bytes`` is the widest element among hidden, kv and the weights;
    ``num_tokens`` (when given) lets a tuned entry hold for a bucket of batch
    sizes only; ``device`` is a ``torch.device`` or a device name (None: the
    default file). The first matching entry of the device's ``engram_gate``
    file wins (chosen by measurement: BENCHMARKS.md#gate-launch-configurations);
    other shapes follow the rule: one chunk is a ``[next_pow2(hc), block_d]``
    tile of at most 8 KB per tensor at 4 warps, one program per token (no
    persistent grid), enough 16-byte loads in flight without shared-memory
    pipelining.
    """
    key = {"hc": hc, "dim": dim, "element_bytes": element_bytes, "num_tokens": num_tokens}
    tuned = tuned_config("engram_gate", device, key)
    if tuned is not None:
        return tuned  # type: ignore[no-any-return]
    hc_pad = _next_power_of_2(hc)
    tile_bytes = 8192
    block_d = max(VEC, min(_next_power_of_2(dim), tile_bytes // element_bytes // hc_pad))
    num_warps = max(1, min(4, hc_pad * block_d * element_bytes // 2048))
    return GateKernelConfig(block_d=block_d, num_warps=num_warps, programs_per_sm=None)
