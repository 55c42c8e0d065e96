"""Triton kernels for n-gram hash ids (an optimisation of ``reference.py``).

``_ngram_hash_kernel`` computes the row ids ``[T, L, C]`` of every Engram
layer of a whole ragged batch in one launch. Each program takes BLOCK_T
tokens, finds their requests by binary search over ``query_start_loc``,
gathers the N values of each token (chunk -> lookback -> history store),
then hashes them for all layers as ``[BLOCK_T, L_PAD, H_PAD]`` tiles. All
index and hash arithmetic is int64. Nothing here reads a value back to the
host, so a step can be captured in a CUDA graph.

With a slot cache (HISTORY == 1) the same kernel writes each new token's
compressed id (or DEAD) to ``slots[slot_mapping[i]]``, and the known
lookback ids of a chunk to their positions' slots (so a request prefilled
elsewhere needs lookback ids only in its first step). Neither write races
with the history reads of the same launch: a request reads the cache only
for positions before its chunk whose lookback id is unknown, the chunk
writes positions inside it or with a known lookback id, and a block table
pins every (request, position) to its own slot. A request-history ring (HISTORY == 2)
can alias positions, so it is written by ``_history_commit_kernel`` after.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Must match engramrt.hashing.types; constexpr so kernels may read them.
EMPTY = tl.constexpr(-1)
DEAD = tl.constexpr(-2)


# Integer arguments are not specialised on their values, so the launcher's
# cache key stays cheap (see engramrt._launch); pointers keep their 16-byte
# alignment specialisation, which vectorises the per-token loads.
_HASH_INTS = ["T", "R", "V", "pad_id", "block_size", "table_stride", "lb_stride"]
_COMMIT_INTS = ["T", "R", "V", "window"]


@triton.jit
def _request_of(qsl_ptr, i, valid, R, BLOCK_T: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Request of each token ``i``: ``#{b in qsl[1..R] : b <= i}``; ``R`` marks a padding row.

    A binary search over ``query_start_loc`` (``SEARCH_STEPS >= ceil(log2(R + 1))``).
    """
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + R
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        bound = tl.load(qsl_ptr + 1 + mid, mask=valid & active, other=0).to(tl.int64)
        right = active & (bound <= i)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def _history_code(input_ids_ptr, token_map_ptr, dead_ptr, i, write, V, HAS_DEAD: tl.constexpr):
    """int32 history code of token ``i``: its compressed id, or ``DEAD`` where marked dead."""
    tok = tl.load(input_ids_ptr + i, mask=write, other=0).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), V - 1)
    code = tl.load(token_map_ptr + tok, mask=write, other=0)
    if HAS_DEAD:
        is_dead = tl.load(dead_ptr + i, mask=write, other=0) != 0
        code = tl.where(is_dead, DEAD, code)
    return code.to(tl.int32)


@triton.jit(do_not_specialize=_HASH_INTS)
def _ngram_hash_kernel(
    out_ptr,  # [T, L, C] int32 or int64
    input_ids_ptr,  # [T]
    positions_ptr,  # [T]
    qsl_ptr,  # [R + 1]
    dead_ptr,  # [T] uint8/bool            (HAS_DEAD)
    lookback_ptr,  # [R, N-1]              (HAS_LOOKBACK), row stride lb_stride
    lookback_dead_ptr,  # [R, N-1]         (HAS_LOOKBACK_DEAD)
    token_map_ptr,  # [V] int32
    consts_ptr,  # [L, N + 2C] int64: multipliers | primes | offsets
    slots_ptr,  # int32 history store      (HISTORY > 0)
    tags_ptr,  # int64 ring tags           (HISTORY == 2)
    slot_mapping_ptr,  # [T]               (HISTORY == 1)
    table_ptr,  # [R, max_blocks] block table (HISTORY == 1) or [R] request slots (HISTORY == 2)
    T,
    R,
    V,
    pad_id,
    block_size,  # KV block size (HISTORY == 1) or ring window (HISTORY == 2)
    table_stride,
    lb_stride,
    L: tl.constexpr,
    N: tl.constexpr,
    H: tl.constexpr,
    L_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    HAS_LOOKBACK: tl.constexpr,
    HAS_LOOKBACK_DEAD: tl.constexpr,
    HISTORY: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # >= ceil(log2(R + 1)); a constexpr so loops unroll
):
    C: tl.constexpr = (N - 1) * H
    ROW: tl.constexpr = N + 2 * C
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # [BLOCK_T] token index
    valid = i < T

    r = _request_of(qsl_ptr, i, valid, R, BLOCK_T, SEARCH_STEPS)
    padding_row = r >= R
    r_safe = tl.where(padding_row, 0, r)
    start = tl.load(qsl_ptr + r_safe, mask=valid & ~padding_row, other=0).to(tl.int64)
    start = tl.where(padding_row, i, start)
    p = tl.load(positions_ptr + i, mask=valid, other=0).to(tl.int64)
    chunk_start_pos = p - (i - start)

    l_idx = tl.arange(0, L_PAD).to(tl.int64)  # [L_PAD]
    h_idx = tl.arange(0, H_PAD).to(tl.int64)  # [H_PAD]
    l_ok = l_idx < L
    h_ok = h_idx < H
    lh_ok = l_ok[:, None] & h_ok[None, :]  # [L_PAD, H_PAD]

    blocked = ~valid
    rolling = tl.zeros([BLOCK_T, L_PAD], dtype=tl.int64)
    for k in tl.static_range(N):
        pos = p - k
        src = i - k
        in_chunk = valid & (src >= start)
        tok = tl.load(input_ids_ptr + src, mask=in_chunk, other=0).to(tl.int64)
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)  # never read outside the map
        value = tl.load(token_map_ptr + tok, mask=in_chunk, other=0).to(tl.int64)
        known = in_chunk
        dead = tl.zeros([BLOCK_T], dtype=tl.int1)
        if HAS_DEAD:
            dead = tl.load(dead_ptr + src, mask=in_chunk, other=0) != 0
        if k > 0:
            outside = valid & ~in_chunk & ~padding_row & (pos >= 0)
            if HAS_LOOKBACK:
                j = chunk_start_pos - 1 - pos  # >= 0 outside the chunk
                use_lb = outside & (j < N - 1)
                lb = tl.load(lookback_ptr + r_safe * lb_stride + j, mask=use_lb, other=-1)
                lb = lb.to(tl.int64)
                lb_known = use_lb & (lb >= 0)
                lb_tok = tl.minimum(tl.maximum(lb, 0), V - 1)
                lb_value = tl.load(token_map_ptr + lb_tok, mask=lb_known, other=0).to(tl.int64)
                value = tl.where(lb_known, lb_value, value)
                if HAS_LOOKBACK_DEAD:
                    lb_dead = tl.load(
                        lookback_dead_ptr + r_safe * lb_stride + j, mask=lb_known, other=0
                    )
                    dead = tl.where(lb_known, lb_dead != 0, dead)
                if HISTORY == 1:
                    # Seed the cache from lookback ids (a request prefilled elsewhere):
                    # the chunk's first token writes each known column once.
                    seed = lb_known & (i == start)
                    lb_pos = tl.where(seed, pos, 0)
                    lb_block = tl.load(
                        table_ptr + r_safe * table_stride + lb_pos // block_size, mask=seed, other=0
                    ).to(tl.int64)
                    lb_code = tl.where(dead & lb_known, DEAD, lb_value)
                    tl.store(
                        slots_ptr + lb_block * block_size + lb_pos % block_size,
                        lb_code.to(tl.int32),
                        mask=seed,
                    )
                known = known | lb_known
            if HISTORY == 1:
                use_h = outside & ~known
                pos_safe = tl.where(use_h, pos, 0)
                block = tl.load(
                    table_ptr + r_safe * table_stride + pos_safe // block_size, mask=use_h, other=0
                ).to(tl.int64)
                slot = block * block_size + pos_safe % block_size
                code = tl.load(slots_ptr + slot, mask=use_h, other=EMPTY).to(tl.int64)
                h_known = use_h & (code != EMPTY)
                value = tl.where(h_known, tl.maximum(code, 0), value)
                dead = tl.where(h_known, code == DEAD, dead)
                known = known | h_known
            if HISTORY == 2:
                use_h = outside & ~known
                ring = tl.load(table_ptr + r_safe, mask=use_h, other=0).to(tl.int64)
                slot = ring * block_size + tl.where(use_h, pos, 0) % block_size
                tag = tl.load(tags_ptr + slot, mask=use_h, other=-1)
                code = tl.load(slots_ptr + slot, mask=use_h, other=EMPTY).to(tl.int64)
                h_known = use_h & (tag == pos) & (code != EMPTY)
                value = tl.where(h_known, tl.maximum(code, 0), value)
                dead = tl.where(h_known, code == DEAD, dead)
                known = known | h_known
            blocked = blocked | (pos < 0) | padding_row
        blocked = blocked | (known & dead)
        value = tl.where(blocked | ~known, pad_id, value)  # [BLOCK_T]

        mult = tl.load(consts_ptr + l_idx * ROW + k, mask=l_ok, other=0)  # [L_PAD]
        rolling = rolling ^ (value[:, None] * mult[None, :])  # [BLOCK_T, L_PAD]
        if k > 0:
            col = (k - 1) * H + h_idx  # [H_PAD]
            prime = tl.load(
                consts_ptr + l_idx[:, None] * ROW + N + col[None, :], mask=lh_ok, other=1
            )  # [L_PAD, H_PAD]
            offset = tl.load(
                consts_ptr + l_idx[:, None] * ROW + N + C + col[None, :], mask=lh_ok, other=0
            )
            row_id = rolling[:, :, None] % prime[None, :, :] + offset[None, :, :]
            out_off = i[:, None, None] * (L * C) + l_idx[None, :, None] * C + col[None, None, :]
            tl.store(
                out_ptr + out_off,
                row_id.to(out_ptr.dtype.element_ty),
                mask=valid[:, None, None] & lh_ok[None, :, :],
            )

    if HISTORY == 1:
        # This step's tokens become history for later steps and other requests.
        slot = tl.load(slot_mapping_ptr + i, mask=valid & ~padding_row, other=-1).to(tl.int64)
        write = valid & ~padding_row & (slot >= 0)
        code = _history_code(input_ids_ptr, token_map_ptr, dead_ptr, i, write, V, HAS_DEAD)
        tl.store(slots_ptr + slot, code, mask=write)


@triton.jit(do_not_specialize=_COMMIT_INTS)
def _history_commit_kernel(
    slots_ptr,  # [max_requests * W] int32
    tags_ptr,  # [max_requests * W] int64
    input_ids_ptr,  # [T]
    positions_ptr,  # [T]
    qsl_ptr,  # [R + 1]
    dead_ptr,  # [T] (HAS_DEAD)
    request_slots_ptr,  # [R]
    token_map_ptr,  # [V] int32
    T,
    R,
    V,
    window,
    BLOCK_T: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Write the last ``window`` tokens of each chunk into its request's ring."""
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    valid = i < T
    r = _request_of(qsl_ptr, i, valid, R, BLOCK_T, SEARCH_STEPS)
    owned = valid & (r < R)
    r_safe = tl.where(owned, r, 0)
    end = tl.load(qsl_ptr + r_safe + 1, mask=owned, other=0).to(tl.int64)
    # Only the last `window` tokens of a chunk: each ring slot is written once.
    write = owned & (i >= end - window)
    p = tl.load(positions_ptr + i, mask=write, other=0).to(tl.int64)
    ring = tl.load(request_slots_ptr + r_safe, mask=write, other=0).to(tl.int64)
    slot = ring * window + p % window
    code = _history_code(input_ids_ptr, token_map_ptr, dead_ptr, i, write, V, HAS_DEAD)
    tl.store(slots_ptr + slot, code, mask=write)
    tl.store(tags_ptr + slot, p, mask=write)
