"""Triton kernels for the row quantisation of SPEC §6.

Both directions work on tiles ``[ROWS, NB, 32]``: ``ROWS`` table rows, the
``NB = E/32`` blocks of a row (padded to a power of two for ``tl.arange``)
and the 32 values of a block, so a block's scale broadcasts over the last
axis without a reshape.

Every float conversion is written out in integer arithmetic instead of
using Triton's casts (dequantisation has an opt-in ``HW_CONVERT`` variant
with the GPU's own conversion instructions), so the bytes are defined by
this file alone and agree with :mod:`engramrt.quant.reference` bit for bit
on the GPU *and* under ``TRITON_INTERPRET=1``:

- Triton's interpreter (3.6) casts fp32 -> fp8e4nv by rounding half away
  from zero on one cut-off bit (no sticky bits, no ties-to-even), does not
  saturate (500.0 becomes a wrong code, 464.0 the NaN code) and casts
  fp32 -> bf16 by truncation. On the GPU the same casts are
  ``cvt.rn.satfinite`` (RNE, saturating) and ``cvt.rn``.
- Triton's fp32 ``/`` lowers to an approximate division on NVIDIA GPUs, so
  ``amax / 448`` is not computed at all: the scale exponent is read from
  the bits of ``amax`` (see :func:`_scale_byte_from_amax`).

The only float arithmetic left is fp32 multiplication by powers of two and
one fp32 addition, which are IEEE round-to-nearest-even on both (Triton
does not flush subnormals for plain fp32 ``*`` and ``+``; it only sets
flush-to-zero for libdevice calls, none of which are used here). The tests
cover every (value byte, scale byte) pair, so a GPU that flushed would fail
them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt._jit import dequantize_to_bf16_bits

__all__ = ["dequantize_rows_triton", "quantize_rows_triton"]

_TILE_ELEMENTS = 4096
"""Values per program: 4 warps x 32 threads x 32 values keeps enough loads in flight."""


@triton.jit
def _scale_byte_from_amax(amax):
    """``ceil(log2(amax / 448)) + 127`` for normal fp32 ``amax`` (int32).

    With ``amax = 2**(ea-127) * (1 + m/2**23)`` the quotient is
    ``2**(ea-127-8) * (1 + m/2**23) / 1.75``: its log2 lies in
    ``(ea-127-9, ea-127-8]`` while ``m <= 0x600000`` (``1 + m/2**23 <= 1.75``)
    and in ``(ea-127-8, ea-127-7)`` above. So the byte is
    ``ea - 8 + (m > 0x600000)``, the same byte the reference reads from the
    bits of the IEEE quotient (``tests/quant`` checks all 2**23 mantissas).
    """
    bits = amax.to(tl.int32, bitcast=True)
    biased_exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return biased_exponent - 8 + (mantissa > 0x600000).to(tl.int32)


@triton.jit
def _fp32_to_e4m3fn_code(x):
    """RNE float8 e4m3fn code (int32, 0..255) of fp32 ``x`` with ``|x| <= 448``.

    The algorithm of ``c10::detail::fp8e4m3fn_from_fp32_value`` (PyTorch's
    own cast), minus its NaN branch because callers clamp to +-448 first.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal e4m3 range (|x| >= 2**-6): rebias the exponent (127 -> 7) and
    # round the 23-bit mantissa to 3 bits, ties to even (0x7FFFF + odd bit).
    mantissa_odd = (magnitude >> 20) & 1
    normal = (magnitude + ((7 - 127) << 23) + 0x7FFFF + mantissa_odd) >> 20
    # Subnormal e4m3 range (|x| < 2**-6): adding 2**14 leaves an fp32 whose
    # last mantissa step is 2**-9, the e4m3 subnormal step, so the IEEE add
    # does the round-to-nearest-even; the code is the bits above 2**14's.
    shifted = magnitude.to(tl.float32, bitcast=True) + 16384.0
    subnormal = shifted.to(tl.int32, bitcast=True) - (141 << 23)
    code = tl.where(magnitude < (121 << 23), subnormal, normal)
    return code | sign


@triton.jit
def _row_tile(n_rows, E: tl.constexpr, NB: tl.constexpr, NB_PAD: tl.constexpr, ROWS: tl.constexpr):
    """This program's tile ``[ROWS, NB_PAD, 32]`` of rows of ``E`` values: the rows
    ``[ROWS]`` (int64), the scale blocks ``[NB_PAD]``, which (row, block) pairs exist
    ``[ROWS, NB_PAD]`` and each value's offset in the rows ``[ROWS, NB_PAD, 32]``."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
    block = tl.arange(0, NB_PAD)  # [NB_PAD]
    lane = tl.arange(0, 32)  # [32]
    row_ok = row < n_rows
    if NB_PAD != NB:
        block_ok = (block < NB)[None, :]
    else:
        block_ok = tl.full([1, NB_PAD], 1, tl.int1)
    scale_ok = row_ok[:, None] & block_ok  # [ROWS, NB_PAD]
    offsets = row[:, None, None] * E + block[None, :, None] * 32 + lane[None, None, :]
    return row, block, scale_ok, offsets


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [N, E] fp32 / bf16 / fp16
    values_ptr,  # [N, E] uint8 (float8_e4m3fn bytes)
    scales_ptr,  # [N, E/32] uint8
    n_rows,
    E: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    row, block, scale_ok, offsets = _row_tile(n_rows, E, NB, NB_PAD, ROWS)
    tile_ok = scale_ok[:, :, None]  # [ROWS, NB_PAD, 1]
    x = tl.load(x_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)  # [ROWS, NB_PAD, 32]

    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4)  # [ROWS, NB_PAD]
    scale_byte = _scale_byte_from_amax(amax)  # [ROWS, NB_PAD]
    # 1 / 2**exponent, exact: biased exponent 254 - b (b in 105..247 for finite x).
    inverse_scale = ((254 - scale_byte) << 23).to(tl.float32, bitcast=True)
    scaled = x * inverse_scale[:, :, None]  # = x / scale exactly (power of two)
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    code = _fp32_to_e4m3fn_code(scaled)

    tl.store(values_ptr + offsets, code.to(tl.uint8), mask=tile_ok)
    scale_offsets = row[:, None] * NB + block[None, :]  # [ROWS, NB_PAD]
    tl.store(scales_ptr + scale_offsets, scale_byte.to(tl.uint8), mask=scale_ok)


@triton.jit
def _dequantize_rows_kernel(
    values_ptr,  # [N, E] uint8 (float8_e4m3fn bytes)
    scales_ptr,  # [N, E/32] uint8
    out_ptr,  # [N, E] int16 (bf16 bits)
    n_rows,
    E: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
):
    row, block, scale_ok, offsets = _row_tile(n_rows, E, NB, NB_PAD, ROWS)
    tile_ok = scale_ok[:, :, None]  # [ROWS, NB_PAD, 1]
    value_bytes = tl.load(values_ptr + offsets, mask=tile_ok, other=0)
    scale_offsets = row[:, None, None] * NB + block[None, :, None]  # [ROWS, NB_PAD, 1]
    scale_bytes = tl.load(scales_ptr + scale_offsets, mask=tile_ok, other=127)
    bf16_bits = dequantize_to_bf16_bits(value_bytes, scale_bytes, HW_CONVERT)
    tl.store(out_ptr + offsets, bf16_bits, mask=tile_ok)


def _tile(row_width: int) -> tuple[int, int, int]:
    """``(NB, NB_PAD, ROWS)`` for rows of ``row_width`` values."""
    blocks = row_width // 32
    blocks_pad = triton.next_power_of_2(blocks)
    rows = max(1, _TILE_ELEMENTS // (blocks_pad * 32))
    return blocks, blocks_pad, rows


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_quantize_rows_kernel` on ``x [..., E]`` (validated by the caller)."""
    *lead, row_width = x.shape
    x2d = x.contiguous().view(-1, row_width)
    n_rows = x2d.shape[0]
    values = torch.empty(x2d.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((n_rows, row_width // 32), dtype=torch.uint8, device=x.device)
    if n_rows > 0:
        blocks, blocks_pad, rows = _tile(row_width)
        grid = (triton.cdiv(n_rows, rows),)
        _quantize_rows_kernel[grid](
            x2d, values, scales, n_rows, E=row_width, NB=blocks, NB_PAD=blocks_pad, ROWS=rows
        )
    return (
        values.view(torch.float8_e4m3fn).view(*lead, row_width),
        scales.view(*lead, row_width // 32),
    )


def dequantize_rows_triton(
    values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, hw_convert: bool = False
) -> torch.Tensor:
    """Launch :func:`_dequantize_rows_kernel`; ``out`` is contiguous bf16 like ``values``."""
    row_width = values.shape[-1]
    values2d = values.contiguous().view(torch.uint8).view(-1, row_width)
    scales2d = scales.contiguous().view(torch.uint8).view(-1, row_width // 32)
    n_rows = values2d.shape[0]
    if n_rows > 0:
        blocks, blocks_pad, rows = _tile(row_width)
        grid = (triton.cdiv(n_rows, rows),)
        _dequantize_rows_kernel[grid](
            values2d,
            scales2d,
            out.view(torch.int16),
            n_rows,
            E=row_width,
            NB=blocks,
            NB_PAD=blocks_pad,
            ROWS=rows,
            HW_CONVERT=hw_convert,
        )
    return out
