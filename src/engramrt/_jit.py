"""``@triton.jit`` helpers shared by the kernels of several packages.

- :func:`program_block`: the int64 indices a one-dimensional program serves;
- :func:`dequantize_to_bf16_bits`: e4m3fn value bytes times ue8m0 scales to
  bf16 bits (SPEC §6), the integer formulation exact under Triton's
  interpreter too (:mod:`engramrt.quant.kernel` explains why);
- :func:`flat_lookups` and :func:`store_dequantized_rows`: the flattened
  ``[T, C]`` lookup tile and the dequantising tail of the row lookup
  (:mod:`engramrt.lookup.kernel`), shared by the cache's probe kernel
  (:mod:`engramrt.cache.kernel`).

Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dequantize_to_bf16_bits", "flat_lookups", "program_block", "store_dequantized_rows"]


@triton.jit
def program_block(n, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` consecutive indices ``[BLOCK]`` and which are below ``n``.

    The indices are int64, the program id cast before the multiply: scaled by a
    row's width they overflow int32 at V4.1 sizes.
    """
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return index, index < n


@triton.jit
def dequantize_to_bf16_bits(value_bytes, scale_bytes, HW_CONVERT: tl.constexpr):
    """``bf16(fp32(value) * 2**(b-127))`` as int16 bits; NaN as ``0x7FC0``.

    ``value_bytes`` and ``scale_bytes`` are uint8 and broadcast against each
    other (``[..., 32]`` and ``[..., 1]``).

    ``HW_CONVERT=False`` (the default everywhere) decodes and rounds with
    integer operations and is exact in Triton's interpreter too.
    ``HW_CONVERT=True`` uses the GPU's conversion instructions instead
    (``cvt`` e4m3 -> f16 -> f32 and ``cvt.rn`` f32 -> bf16): fewer
    instructions per value, same bytes on a GPU; the interpreter gets it
    right only for finite codes and normal products (it truncates to bf16
    and decodes the NaN codes as 480), so it is checked in full on the GPU.
    """
    scale = (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    if HW_CONVERT:
        product = value_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        bits = product.to(tl.bfloat16).to(tl.int16, bitcast=True)
        return tl.where(product != product, 0x7FC0, bits.to(tl.int32)).to(tl.int16)
    value_bits = value_bytes.to(tl.int32)
    magnitude = value_bits & 0x7F
    # Put the e4m3 exponent and mantissa fields at the top of the fp32
    # fields; multiplying by 2**120 (= 2**(127-7)) rebiases the exponent and
    # also turns e4m3 subnormals (exponent field 0, an fp32 subnormal here)
    # into the exact value. Both products below are exact or IEEE-rounded.
    decoded_bits = ((value_bits & 0x80) << 24) | (magnitude << 20)
    decoded = decoded_bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
    product = decoded * scale
    product_bits = product.to(tl.int32, bitcast=True)
    # fp32 -> bf16 round to nearest even on the bits; overflow rounds to inf.
    # (Only subnormal products have non-zero low bits: 4 significant bits times
    # a power of two fit bf16's 8 otherwise.)
    rounded = (product_bits + 0x7FFF + ((product_bits >> 16) & 1)) >> 16
    is_nan = (magnitude == 0x7F) | (product != product)
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def flat_lookups(
    row_ids_ptr,
    tile,
    n_lookups,
    num_cols,
    stride_t,
    stride_c,
    col_begin,
    col_end,
    ROWS: tl.constexpr,
):
    """Tile ``tile``'s (int64) ``ROWS`` flat lookups ``t * C + c``: their indices,
    whether each is in the batch and owned (``col_begin <= c < col_end``), and its row
    id as int64 (0 where not owned)."""
    lookup = tile * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS] flat (t, c)
    in_batch = lookup < n_lookups
    token = lookup // num_cols
    col = lookup - token * num_cols
    owned = in_batch & (col >= col_begin) & (col < col_end)
    row_id = tl.load(row_ids_ptr + token * stride_t + col * stride_c, mask=owned, other=0)
    return lookup, in_batch, owned, row_id.to(tl.int64)


@triton.jit
def store_dequantized_rows(
    out_ptr,
    lookup,
    row_ptrs,
    read,
    written,
    E: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Dequantise the packed row at ``row_ptrs[i]`` (``[ROWS]`` uint8 pointers; zeros
    where not ``read``) into ``out[lookup[i]]`` where ``written``, as a
    ``[ROWS, NB_PAD, 32]`` tile. ``CACHE`` is the table loads' cache operator
    (``""`` for the default, or ``".ca"``, ``".cg"``, ``".cv"``)."""
    block = tl.arange(0, NB_PAD)
    lane = tl.arange(0, 32)
    if NB_PAD != NB:
        load_ok = (read[:, None] & (block < NB)[None, :])[:, :, None]  # [ROWS, NB_PAD, 1]
        store_ok = (written[:, None] & (block < NB)[None, :])[:, :, None]
    else:
        load_ok = read[:, None, None]  # [ROWS, 1, 1]
        store_ok = written[:, None, None]
    byte = block[None, :, None] * 32 + lane[None, None, :]  # [1, NB_PAD, 32]
    value_bytes = tl.load(
        row_ptrs[:, None, None] + byte, mask=load_ok, other=0, cache_modifier=CACHE
    )
    scale_ptrs = row_ptrs[:, None, None] + E + block[None, :, None]  # [ROWS, NB_PAD, 1]
    scale_bytes = tl.load(scale_ptrs, mask=load_ok, other=127, cache_modifier=CACHE)
    bf16_bits = dequantize_to_bf16_bits(value_bytes, scale_bytes, HW_CONVERT)
    out_offsets = lookup[:, None, None] * E + byte
    tl.store(out_ptr + out_offsets, bf16_bits, mask=store_ok)
