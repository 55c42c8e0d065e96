"""Triton kernel for PLE row ids (an optimisation of ``ids.ple_row_ids_batch_reference``).

``_ple_row_ids_kernel`` computes the row ids ``[T, L, C]`` of every PLE layer of a whole
ragged engine step in one launch, and each request's next id context ``[R, N - 1]``
(docs/families.md §3, §4). Each program takes BLOCK_T tokens: it loads their N shifts as
a ``[BLOCK_T, N_PAD]`` tile from the chunk, finds each token's request in
``query_start_loc``, replaces the shifts that fall before the chunk by the request's
carried context, blocks everything behind the first EOS met walking back, and hashes the
values for all layers as ``[BLOCK_T, L_PAD, H_PAD]`` tiles. All index and hash arithmetic
is int64; nothing is read back to the host, so a step can be captured in a CUDA graph.

Shaped as the Engram hash kernel (``engramrt.hashing.kernel``) for the same reasons: a
decode step meets a cold L2, so the kernel is a chain of dependent loads, kept short:

- requests are found by one vector load of ``query_start_loc`` (``SCAN_R``), a binary
  search only for batches wider than a tile;
- the chunk's tokens, all constants and (``SPECULATE``) the context row a decode token
  would read (request i, as engines lay out a decode batch) load together up front;
  tokens whose guess is wrong load their context after the search;
- remainders by the head primes go through a float64 reciprocal with an exact
  correction (``FAST_MOD``, :func:`_floor_mod_prime`) instead of a 64-bit integer
  division.

Integer semantics are the reference's: wrapping int64 products, XOR of int64 bit
patterns and a floor modulo, so an EOS id ``>= V`` (whose products can wrap and whose
mix can be negative) gives the reference's rows too.

Next contexts: program ``p`` also writes the contexts of requests ``p*BLOCK_R ..
p*BLOCK_R + BLOCK_R - 1`` (the last ``N - 1`` of ``context ++ chunk``) into a separate
output: the token programs read the old contexts in the same launch, so the two must
not alias.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engramrt._jit import program_block
from engramrt.hashing.kernel import _request_of, _request_of_scan

# Integer arguments are not specialised on their values (see engramrt._launch).
_PLE_INTS = ["T", "R", "eos", "ctx_stride", "next_stride"]


@triton.jit
def _floor_mod_prime(x, prime, inv_prime, FAST_MOD: tl.constexpr):
    """Floor modulo ``x mod prime`` in ``[0, prime)`` of any int64 ``x``, bit-exact.

    FAST_MOD (needs every prime >= 4096): ``floor(x * inv_prime)`` in float64 is within
    one of ``floor(x / prime)`` for any ``|x| < 2**63`` (the conversion of x errs by at
    most 512, the reciprocal and the product by 2**-53 relative each, so the product errs
    by less than ``2560 / prime < 1``), hence the remainder ``x - q * prime`` (exact in
    wrapping int64: the true value is small) lies in ``[-prime, 2 * prime)`` and one
    correction each way makes it exact. Without it: Triton's ``%`` truncates toward zero
    (C), so a negative remainder is moved up by ``prime``.
    """
    if FAST_MOD:
        q = tl.floor(x.to(tl.float64) * inv_prime).to(tl.int64)
        rem = x - q * prime
        rem = tl.where(rem < 0, rem + prime, rem)
        rem = tl.where(rem >= prime, rem - prime, rem)
    else:
        rem = x % prime
        rem = tl.where(rem < 0, rem + prime, rem)
    return rem


@triton.jit(do_not_specialize=_PLE_INTS)
def _ple_row_ids_kernel(
    out_ptr,  # [T, L, C] int32 or int64
    next_ctx_ptr,  # [R, N-1] int64, row stride next_stride; must not alias ctx
    token_ids_ptr,  # [T] int32/int64 raw ids
    qsl_ptr,  # [R + 1]
    ctx_ptr,  # [R, N-1] carried ids, row stride ctx_stride
    consts_ptr,  # [L, N + 2C] int64: multipliers | head sizes | offsets
    inv_sizes_ptr,  # [L, C] float64: 1 / head size, correctly rounded (FAST_MOD)
    T,
    R,
    eos,
    ctx_stride,
    next_stride,
    L: tl.constexpr,
    N: tl.constexpr,
    H: tl.constexpr,
    L_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # binary search: >= ceil(log2(R + 1))
    SCAN_R: tl.constexpr,  # > 0: find requests with one load of a [SCAN_R >= R] qsl tile
    FAST_MOD: tl.constexpr,
    SPECULATE: tl.constexpr,  # load context row i for token i before the request search
):
    """Row ids of BLOCK_T tokens for all PLE layers, and BLOCK_R requests' next contexts."""
    C: tl.constexpr = (N - 1) * H
    ROW: tl.constexpr = N + 2 * C
    i, valid = program_block(T, BLOCK_T)  # [BLOCK_T] token index
    k_idx = tl.arange(0, N_PAD).to(tl.int64)
    k2 = k_idx[None, :]  # [1, N_PAD] shift s
    shift_ok = k2 < N
    src = i[:, None] - k2  # [BLOCK_T, N_PAD] token index of each shift, if in the chunk
    l_idx = tl.arange(0, L_PAD).to(tl.int64)
    h_idx = tl.arange(0, H_PAD).to(tl.int64)
    l_ok = l_idx < L
    lh_ok = l_ok[:, None] & (h_idx < H)[None, :]  # [L_PAD, H_PAD]

    # Loads that depend on nothing, issued together: the chunk's shifts, the constants
    # and, for a guessed decode token, its context row.
    maybe = valid[:, None] & shift_ok & (src >= 0)
    tok = tl.load(token_ids_ptr + src, mask=maybe, other=0).to(tl.int64)  # [BLOCK_T, N_PAD]
    mult = tl.load(
        consts_ptr + l_idx[:, None] * ROW + k2, mask=l_ok[:, None] & shift_ok, other=0
    )  # [L_PAD, N_PAD]
    l3 = l_idx[:, None, None]
    k3 = k_idx[None, :, None]
    col3 = (k3 - 1) * H + h_idx[None, None, :]  # [1, N_PAD, H_PAD] column of (order, head)
    col_ok = (l3 < L) & (k3 >= 1) & (k3 < N) & (h_idx < H)[None, None, :]
    size3 = tl.load(consts_ptr + l3 * ROW + N + col3, mask=col_ok, other=1)
    offset3 = tl.load(consts_ptr + l3 * ROW + N + C + col3, mask=col_ok, other=0)
    inv_size3 = tl.load(inv_sizes_ptr + l3 * C + col3, mask=col_ok, other=0.0)
    if SPECULATE:
        # Token i as the only token of request i: shift s reads context column N-1-s.
        r_guess = tl.minimum(i, tl.maximum(R - 1, 0))
        guess_ok = valid[:, None] & (k2 >= 1) & shift_ok & (i < R)[:, None]
        ctx_guess = tl.load(
            ctx_ptr + r_guess[:, None] * ctx_stride + (N - 1 - k2), mask=guess_ok, other=0
        ).to(tl.int64)

    if SCAN_R > 0:
        r, start = _request_of_scan(qsl_ptr, i, R, SCAN_R)
    else:
        r = _request_of(qsl_ptr, i, valid, R, BLOCK_T, SEARCH_STEPS)
        start = tl.load(qsl_ptr + tl.minimum(r, R), mask=valid, other=0).to(tl.int64)
    padding_row = r >= R  # a token past qsl[-1]: a request start of its own (EOS context)
    r_safe = tl.where(padding_row, 0, r)
    local = tl.where(padding_row, 0, i - start)  # [BLOCK_T] position in its chunk
    in_chunk = k2 <= local[:, None]  # [BLOCK_T, N_PAD]
    ctx_col = N - 1 + local[:, None] - k2  # in [0, N-2] where the shift is before the chunk
    from_ctx = valid[:, None] & shift_ok & ~in_chunk & ~padding_row[:, None]
    if SPECULATE:
        hit = ((r == i) & (local == 0) & ~padding_row)[:, None]
        ctx_val = tl.load(
            ctx_ptr + r_safe[:, None] * ctx_stride + ctx_col, mask=from_ctx & ~hit, other=0
        ).to(tl.int64)
        ctx_val = tl.where(hit, ctx_guess, ctx_val)
    else:
        ctx_val = tl.load(
            ctx_ptr + r_safe[:, None] * ctx_stride + ctx_col, mask=from_ctx, other=0
        ).to(tl.int64)
    raw = tl.where(in_chunk, tok, tl.where(from_ctx, ctx_val, eos))  # [BLOCK_T, N_PAD]
    # v_s is EOS once any of x_{t-s} .. x_{t-1} is EOS: a prefix OR over shifts >= 1.
    stop = (k2 >= 1) & (raw == eos)
    blocked = tl.cumsum(stop.to(tl.int32), axis=1) > 0
    value = tl.where(blocked, eos, raw)

    mix = tl.zeros([BLOCK_T, L_PAD], dtype=tl.int64)
    for k in tl.static_range(N):
        # Column k of the register tiles (one nonzero term per sum: exact).
        value_k = tl.sum(tl.where(k2 == k, value, 0), axis=1)  # [BLOCK_T]
        mult_k = tl.sum(tl.where(k2 == k, mult, 0), axis=1)  # [L_PAD]
        mix = mix ^ (value_k[:, None] * mult_k[None, :])  # wrapping int64 product
        if k > 0:
            size = tl.sum(tl.where(k3 == k, size3, 0), axis=1)  # [L_PAD, H_PAD]
            offset = tl.sum(tl.where(k3 == k, offset3, 0), axis=1)
            inv_size = tl.sum(tl.where(k3 == k, inv_size3, 0.0), axis=1)
            bucket = _floor_mod_prime(
                mix[:, :, None], size[None, :, :], inv_size[None, :, :], FAST_MOD
            )
            col = (k - 1) * H + h_idx
            out_off = i[:, None, None] * (L * C) + l_idx[None, :, None] * C + col[None, None, :]
            tl.store(
                out_ptr + out_off,
                (bucket + offset[None, :, :]).to(out_ptr.dtype.element_ty),
                mask=valid[:, None, None] & lh_ok[None, :, :],
            )

    # Next contexts of this program's requests: column j of the last N-1 of ctx ++ chunk.
    req = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    req_ok = req < R
    begin = tl.load(qsl_ptr + req, mask=req_ok, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1, mask=req_ok, other=0).to(tl.int64)
    j = tl.arange(0, N_PAD).to(tl.int64)[None, :]  # [1, N_PAD]
    j_ok = req_ok[:, None] & (j < N - 1)
    joined = (end - begin)[:, None] + j  # position in ctx ++ chunk
    take_tok = joined >= N - 1
    next_tok = tl.load(
        token_ids_ptr + begin[:, None] + joined - (N - 1), mask=j_ok & take_tok, other=0
    ).to(tl.int64)
    next_old = tl.load(
        ctx_ptr + req[:, None] * ctx_stride + joined, mask=j_ok & ~take_tok, other=0
    ).to(tl.int64)
    tl.store(
        next_ctx_ptr + req[:, None] * next_stride + j,
        tl.where(take_tok, next_tok, next_old),
        mask=j_ok,
    )
