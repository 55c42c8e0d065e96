"""Plain PyTorch definition of the table-row quantisation (SPEC §6).

A table row holds ``E`` float8 e4m3fn values and ``E/32`` ue8m0 scale bytes,
one per block of 32 values. Scale byte ``b`` means ``2**(b - 127)``: it is
the fp32 exponent field, so ``b << 23`` bit-cast to fp32 is the scale
(``b = 0`` gives a scale of 0.0 and ``b = 255`` gives +inf, exactly as that
bit-cast says).

Quantising (used to convert float tables), per block of 32:

- ``amax = max |x|`` in fp32, floored at ``1e-4`` (the fp32 nearest 1e-4);
- ``s = amax / 448`` in fp32 (IEEE division, round to nearest even);
- ``exponent = ceil(log2(s))``, read from the fp32 bits of ``s``: the
  unbiased exponent field, plus one unless the mantissa field is zero. For
  a normal ``s`` (always the case: ``s >= fp32(1e-4)/448 ~ 2.2e-7``) this is
  the mathematically exact ``ceil(log2(s))``: ``s = 2**(eb-127) * (1 + m/2**23)``
  lies in ``(2**(eb-127), 2**(eb-126))`` when ``m != 0`` and equals
  ``2**(eb-127)`` when ``m == 0``. It also equals ``ceil(log2(amax/448))``
  computed with the exact real quotient: rounding ``amax/448`` to fp32 never
  moves it across a power of two from above (``tests/quant`` checks every
  fp32 mantissa);
- scale byte ``= exponent + 127``;
- ``value = e4m3fn(clamp(x / 2**exponent, -448, 448))``, rounded to nearest,
  ties to even. Whether ``torch``'s cast to float8_e4m3fn saturates has
  changed between versions (older ones turn values past 464 into the NaN
  code; 2.13 on CPU saturates), hence the clamp first. Because
  ``amax <= 448 * 2**exponent`` the clamp never changes a finite input; it
  is kept because the format says "saturating".

Dequantising: ``bf16(fp32(value) * scale)``, rounded to nearest even. NaN
results (from the e4m3fn NaN codes ``0x7F``/``0xFF``, or ``0 * inf`` when a
scale byte is 255) are written as the canonical bf16 NaN ``0x7FC0``, so the
bytes do not depend on the device that computed them (CUDA's conversion
returns ``0x7FFF``, the CPU's ``0x7FC0``).
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "CANONICAL_BF16_NAN_BITS",
    "E4M3_MAX",
    "SCALE_FLOOR",
    "dequantize_rows_reference",
    "quantize_rows_reference",
    "scale_bytes_to_fp32",
]

BLOCK = 32
"""Values per scale byte."""

E4M3_MAX = 448.0
"""Largest finite float8 e4m3fn value."""

SCALE_FLOOR = 1e-4
"""Floor on a block's amax (as fp32), so an all-zero block gets a finite scale."""

CANONICAL_BF16_NAN_BITS = 0x7FC0
"""The one bf16 bit pattern dequantisation writes for NaN."""


def scale_bytes_to_fp32(scale_bytes: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes (uint8 or float8_e8m0fnu) -> fp32 scales ``2**(b-127)`` by bit-cast."""
    as_int = scale_bytes.view(torch.uint8).to(torch.int32)
    return (as_int << 23).view(torch.float32)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows of ``E`` floats to e4m3fn values and ue8m0 scale bytes.

    Args:
        x: ``[..., E]`` float32, bfloat16 or float16, ``E`` a multiple of 32,
            finite.

    Returns:
        ``(values [..., E] float8_e4m3fn, scales [..., E/32] uint8)``.
    """
    *lead, row_width = x.shape
    blocks = x.to(torch.float32).reshape(*lead, row_width // BLOCK, BLOCK)  # [..., E/32, 32]
    amax = blocks.abs().amax(dim=-1).clamp_min(SCALE_FLOOR)  # [..., E/32]
    scale_fp32 = amax / E4M3_MAX
    scale_bits = scale_fp32.view(torch.int32)
    biased_exponent = (scale_bits >> 23) & 0xFF
    mantissa_nonzero = ((scale_bits & 0x7FFFFF) != 0).to(torch.int32)
    scale_bytes = biased_exponent + mantissa_nonzero  # = ceil(log2(s)) + 127
    scale = scale_bytes_to_fp32(scale_bytes.to(torch.uint8))  # 2**exponent, exact
    scaled = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float8_e4m3fn).reshape(*lead, row_width)
    return values, scale_bytes.to(torch.uint8)


def dequantize_rows_reference(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``bf16(fp32(value) * 2**(b-127))`` per block of 32, NaN as ``0x7FC0``.

    Args:
        values: ``[..., E]`` float8_e4m3fn (or uint8 holding its bytes).
        scales: ``[..., E/32]`` uint8 (or float8_e8m0fnu holding the same bytes).

    Returns:
        ``[..., E]`` bfloat16.
    """
    *lead, row_width = values.shape
    decoded = values.view(torch.float8_e4m3fn).to(torch.float32)
    decoded = decoded.reshape(*lead, row_width // BLOCK, BLOCK)  # [..., E/32, 32]
    scale = scale_bytes_to_fp32(scales).unsqueeze(-1)  # [..., E/32, 1]
    rows = (decoded * scale).reshape(*lead, row_width).to(torch.bfloat16)
    canonical_nan = torch.tensor(CANONICAL_BF16_NAN_BITS, dtype=torch.int16, device=rows.device)
    return torch.where(rows.isnan(), canonical_nan.view(torch.bfloat16), rows)
