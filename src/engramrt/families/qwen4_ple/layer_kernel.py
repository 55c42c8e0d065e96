"""Triton kernels of the PLE layer (docs/families.md §6); launchers and references in
:mod:`engramrt.families.qwen4_ple.module`.

Four kernels around the two torch GEMMs of a step (``key_proj`` and ``value_proj`` as one
``[(hc+1)*D, E]`` matmul):

- ``_ple_gather_rows_kernel``: each token's C table rows into ``e [T, E]``;
- ``_ple_gate_norm_kernel``: steps 2-7 after the projections, one program per (token,
  stream): ``RMS_key``, ``RMS_query``, the gate, ``a = sigmoid(g) * v``, ``b = RMS_conv(a)``,
  the token mask;
- ``_ple_conv_out_kernel``: steps 8-9, one program per (token block, channel block): the
  K taps at dilation N from this chunk's ``b`` or the sequence's conv state, SiLU, ``a + c``;
- ``_ple_conv_state_kernel``: the state pool's rows of each sequence become its last S
  ``b`` rows, one program per (sequence, channel block). A separate launch because every
  state read of the conv must happen before the first write.

Rounding follows the reference (every numbered step's result rounded to the model dtype).
``ROUND`` selects the model dtype: 0 fp32 (no rounding), 1 bf16, 2 fp16. bf16 rounding is
done on the bits (round to nearest even), because Triton's CPU interpreter truncates in
``.to(tl.bfloat16)``; on the GPU it is what ``cvt.rn.bf16.f32`` does. Values stored as bf16
are then exactly representable, so the store's conversion is exact everywhere.

All index arithmetic is int64 (program ids cast first): row ids times the row width
overflow int32 on the real tables.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "_ple_conv_out_kernel",
    "_ple_conv_state_kernel",
    "_ple_gate_norm_kernel",
    "_ple_gather_rows_kernel",
]


@triton.jit
def _round(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded to the model dtype (round to nearest even), returned as fp32."""
    if ROUND == 1:
        bits = x.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + lsb) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded)  # NaN stays NaN
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm(x, weight, DIM: tl.constexpr, eps, ROUND: tl.constexpr):
    """``RMS_w`` of one stream ``[BLOCK_D]`` (zeros past DIM): ``x * rsqrt(mean(x^2) + eps)
    * (1 + w)`` in fp32, rounded once. ``1 / sqrt_rn`` as the CPU's ``torch.rsqrt``."""
    mean = tl.sum(x * x, axis=0) / DIM
    inv_root = 1.0 / tl.sqrt_rn(mean + eps)
    return _round((x * inv_root) * (1.0 + weight), ROUND)


@triton.jit(do_not_specialize=["num_pairs", "row_begin", "ids_stride", "table_stride"])
def _ple_gather_rows_kernel(
    out_ptr,  # [T, C * WIDTH] model dtype, contiguous
    table_ptr,  # [rows, table_stride] the table's values (row r - row_begin)
    row_ids_ptr,  # [T, C] int32/int64, row stride ids_stride
    num_pairs,  # T * C
    row_begin,
    ids_stride,
    table_stride,
    C: tl.constexpr,
    WIDTH: tl.constexpr,  # d, values per row
    BLOCK_P: tl.constexpr,  # (token, head) pairs per program
    BLOCK_W: tl.constexpr,  # next power of two >= WIDTH
    WIDEN_BF16: tl.constexpr,  # bf16 rows into fp32: on the bits (the interpreter's cast
    # flushes subnormals), exact everywhere
):
    pid = tl.program_id(0).to(tl.int64)
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)  # [BLOCK_P]
    live = pairs < num_pairs
    token = pairs // C
    head = pairs % C
    rows = tl.load(row_ids_ptr + token * ids_stride + head, mask=live, other=0).to(tl.int64)
    rows = rows - row_begin
    cols = tl.arange(0, BLOCK_W)
    keep = live[:, None] & (cols[None, :] < WIDTH)  # [BLOCK_P, BLOCK_W]
    values = tl.load(table_ptr + rows[:, None] * table_stride + cols[None, :], mask=keep)
    if WIDEN_BF16:
        bits = values.to(tl.int16, bitcast=True).to(tl.int32) << 16
        values = bits.to(tl.float32, bitcast=True)
    tl.store(
        out_ptr + pairs[:, None] * WIDTH + cols[None, :],
        values.to(out_ptr.dtype.element_ty),
        mask=keep,
    )


@triton.jit(
    do_not_specialize=["key_stride", "value_stride", "hidden_stride", "eps", "inv_sqrt_dim"]
)
def _ple_gate_norm_kernel(
    gated_ptr,  # [T, HC * DIM] a, model dtype, contiguous
    normed_ptr,  # [T, HC * DIM] b, model dtype, contiguous
    key_ptr,  # [T, HC * DIM] key_proj(e), row stride key_stride
    value_ptr,  # [T, DIM] value_proj(e), row stride value_stride
    hidden_ptr,  # [T, HC * DIM], row stride hidden_stride
    norm_key_ptr,  # [HC * DIM]
    norm_query_ptr,
    norm_conv_ptr,
    mask_ptr,  # [T] bool (read only when HAS_MASK)
    key_stride,
    value_stride,
    hidden_stride,
    eps,
    sqrt_dim,  # float(sqrt(DIM)) as fp32, the reference's divisor
    HC: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // HC
    stream = pid % HC
    cols = tl.arange(0, BLOCK_D)
    live = cols < DIM
    channels = stream * DIM + cols  # [BLOCK_D]
    key = tl.load(key_ptr + token * key_stride + channels, mask=live, other=0.0).to(tl.float32)
    query = tl.load(hidden_ptr + token * hidden_stride + channels, mask=live, other=0.0)
    value = tl.load(value_ptr + token * value_stride + cols, mask=live, other=0.0)
    norm_key = tl.load(norm_key_ptr + channels, mask=live, other=0.0).to(tl.float32)
    norm_query = tl.load(norm_query_ptr + channels, mask=live, other=0.0).to(tl.float32)
    norm_conv = tl.load(norm_conv_ptr + channels, mask=live, other=0.0).to(tl.float32)
    key = _rms_norm(key, norm_key, DIM, eps, ROUND)
    query = _rms_norm(query.to(tl.float32), norm_query, DIM, eps, ROUND)
    # Step 4, each operation rounded (ple_gate_reference).
    products = _round(key * query, ROUND)
    score = _round(tl.sum(products, axis=0), ROUND)
    score = _round(score / sqrt_dim, ROUND)
    magnitude = _round(tl.maximum(tl.abs(score), 1e-6), ROUND)
    root = _round(tl.sqrt_rn(magnitude), ROUND)
    sign = tl.where(score > 0, 1.0, tl.where(score < 0, -1.0, 0.0))  # torch.sign(0) = 0
    logit = _round(root * sign, ROUND)
    gate = _round(1.0 / (1.0 + tl.exp(-logit)), ROUND)
    gated = _round(gate * value.to(tl.float32), ROUND)  # a, [BLOCK_D]
    normed = _rms_norm(gated, norm_conv, DIM, eps, ROUND)  # b
    if HAS_MASK:
        # A multiply, as the reference: a masked negative value becomes -0.0.
        keep = tl.load(mask_ptr + token).to(tl.float32)
        gated = gated * keep
        normed = normed * keep
    out = token * (HC * DIM) + channels
    tl.store(gated_ptr + out, gated.to(gated_ptr.dtype.element_ty), mask=live)
    tl.store(normed_ptr + out, normed.to(normed_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
def _ple_conv_out_kernel(
    out_ptr,  # [T, WIDTH] model dtype, contiguous
    gated_ptr,  # [T, WIDTH] a
    normed_ptr,  # [T, WIDTH] b
    conv_states_ptr,  # [slots, S, WIDTH] the pool, before this step
    state_slots_ptr,  # [B] int32/int64
    query_start_loc_ptr,  # [B + 1] int32/int64
    conv1d_ptr,  # [WIDTH, 1, K] contiguous
    num_tokens,
    num_seqs,  # B >= 1
    WIDTH: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,  # dilation
    S: tl.constexpr,  # (K - 1) * N
    SEARCH_STEPS: tl.constexpr,  # >= ceil(log2(B))
    ROUND: tl.constexpr,
    WIDE: tl.constexpr,  # fp32 model: taps in float64 (a fused multiply-add, as the reference)
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    channels = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W).to(tl.int64)
    live_t = tokens < num_tokens
    live_w = channels < WIDTH
    # The sequence of each token: the last i in [0, B) with query_start_loc[i] <= t. Empty
    # sequences share their start with the next one, so the search skips them.
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(query_start_loc_ptr + mid).to(tl.int64) <= tokens
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    start = tl.load(query_start_loc_ptr + lo).to(tl.int64)
    end = tl.load(query_start_loc_ptr + num_seqs).to(tl.int64)
    real = live_t & (tokens < end)  # tokens past query_start_loc[B] are padding: out = 0
    slot = tl.load(state_slots_ptr + lo, mask=real, other=0).to(tl.int64)
    local = tokens - start
    both = real[:, None] & live_w[None, :]  # [BLOCK_T, BLOCK_W]
    if WIDE:
        total = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float64)
    else:
        total = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)
    for tap in tl.static_range(K):
        back = (K - 1 - tap) * N
        source = local - back  # position in the chunk; < 0: row S + source of the state
        in_chunk = source >= 0
        from_chunk = tl.load(
            normed_ptr + (tokens - back)[:, None] * WIDTH + channels[None, :],
            mask=both & in_chunk[:, None],
            other=0.0,
        )
        from_state = tl.load(
            conv_states_ptr + (slot * S + S + source)[:, None] * WIDTH + channels[None, :],
            mask=both & (~in_chunk)[:, None],
            other=0.0,
        )
        window = tl.where(in_chunk[:, None], from_chunk, from_state)
        weight = tl.load(conv1d_ptr + channels * K + tap, mask=live_w, other=0.0)
        if WIDE:
            # fp32 products are exact in float64: one rounding per tap, as a fused
            # multiply-add (the reference's emulation, double rounding included).
            product = weight.to(tl.float64)[None, :] * window.to(tl.float64)
            total = (total + product).to(tl.float32).to(tl.float64)
        else:
            # 16-bit products are exact in fp32: one rounding per tap.
            total = total + weight.to(tl.float32)[None, :] * window.to(tl.float32)
    mixed = _round(total.to(tl.float32), ROUND)
    mixed = _round(mixed / (1.0 + tl.exp(-mixed)), ROUND)  # SiLU as torch's CPU kernel
    gated = tl.load(
        gated_ptr + tokens[:, None] * WIDTH + channels[None, :], mask=both, other=0.0
    ).to(tl.float32)
    out = tl.where(both, _round(gated + mixed, ROUND), 0.0)
    tl.store(
        out_ptr + tokens[:, None] * WIDTH + channels[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live_t[:, None] & live_w[None, :],
    )


@triton.jit(do_not_specialize=["num_tokens"])
def _ple_conv_state_kernel(
    conv_states_ptr,  # [slots, S, WIDTH] the pool, updated in place
    normed_ptr,  # [T, WIDTH] b
    state_slots_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_tokens,
    WIDTH: tl.constexpr,
    S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W).to(tl.int64)
    live_w = channels < WIDTH
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    count = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    base = conv_states_ptr + slot * S * WIDTH + channels
    write = live_w & (count > 0)  # a sequence without tokens keeps its rows untouched
    # New row r is row r + count of (state ++ chunk). Rows in order, one 1-D tile per row:
    # a column stays with one thread, so row r + count is read before row r + count is
    # written (in iteration r + count), with no barrier between threads.
    for row in tl.static_range(S):
        source = row + count
        if_state = source < S
        old = tl.load(base + source * WIDTH, mask=write & if_state, other=0.0)
        new = tl.load(
            normed_ptr + (start + source - S) * WIDTH + channels,
            mask=write & (~if_state),
            other=0.0,
        )
        tl.store(base + row * WIDTH, tl.where(if_state, old, new), mask=write)
