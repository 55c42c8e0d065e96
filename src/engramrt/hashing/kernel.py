"""Triton kernels for n-gram hash ids (an optimisation of ``reference.py``).

``_ngram_hash_kernel`` computes the row ids ``[T, L, C]`` of every Engram
layer of a whole ragged batch in one launch. Each program takes BLOCK_T
tokens, finds their requests in ``query_start_loc``, gathers the N values of
each token (chunk -> lookback -> history store), then hashes them for all
layers as ``[BLOCK_T, L_PAD, H_PAD]`` tiles. All index and hash arithmetic
is int64. Nothing here reads a value back to the host, so a step can be
captured in a CUDA graph.

Why it is shaped this way (a decode step runs after a backbone step has
evicted L2, so every dependent global load costs a DRAM round trip, and a
small batch is a chain of them, not a bandwidth problem):

- Requests are found by ONE vector load of ``query_start_loc`` and a
  compare in registers (``SCAN_R``), not by a binary search whose
  ``log2(R)`` steps are each a dependent load (9 at R = 256). A binary
  search remains for batches with more requests than a tile holds.
- The N shifts of every token are loaded as ``[BLOCK_T, N_PAD]`` tiles and
  all constants (multipliers, primes, offsets of every layer and column) as
  small tiles up front; the hash loop then runs from registers. A per-shift
  loop that loads as it goes pays the token -> token-map chain once per shift.
- The token-map gathers of the batch tokens (and of speculated lookback
  ids) are issued before the request search, so they overlap it.
- Decode tokens (chunks of one, request r owning token r, as engines lay
  out a decode batch) get their lookback ids loaded speculatively beside
  the batch tokens (``SPECULATE``), before the request search confirms the
  guess; tokens where the guess is wrong load theirs after it, as before.
- Remainders by the column primes use a float64 reciprocal and an exact
  correction (``FAST_MOD``) instead of a 64-bit integer division, which the
  GPU runs as a long software routine (48 of them per token at V4.1-Flash).
- The slot-cache write and, when provably safe, the request-ring write
  (``RING_COMMIT``) happen in the same launch: inside a CUDA graph each
  kernel node adds its own launch latency.
- Tokens per program and warps are launch parameters (see
  ``engramrt.hashing.config.HashKernelConfig``): few tokens per program spread
  a decode batch over more SMs, more tokens per program amortise the
  constant loads at prefill sizes.

With a slot cache (HISTORY == 1) the same kernel writes each new token's
compressed id (or DEAD) to ``slots[slot_mapping[i]]``, and the known
lookback ids of a chunk to their positions' slots (so a request prefilled
elsewhere needs lookback ids only in its first step). Neither write races
with the history reads of the same launch: a request reads the cache only
for positions before its chunk whose lookback id is unknown, the chunk
writes positions inside it or with a known lookback id, and a block table
pins every (request, position) to its own slot. A request-history ring
(HISTORY == 2) can alias positions, so it is written by
``_history_commit_kernel`` after, unless every chunk is short enough that
no written position aliases a read one (``RING_COMMIT``).

Memory-safe without checks (``check_ids`` off), as the reference defines:
every history load and store is masked to the history's bounds. A
``slot_mapping`` entry outside ``[0, num_slots)`` is not written; a block
table column past ``table_cols`` or a block id outside ``[0, num_blocks)``
reads EMPTY (unknown: hashes as pad) and is not seeded; a request slot
outside ``[0, max_requests)`` reads nothing and writes nothing, nor does a
token at a negative position write a ring. A token id
(batch or lookback) outside ``[0, V)`` is clamped into it before the
token-map gather (the reference clamps the same way). The masks are a few
compares on tiles already in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engramrt._jit import program_block

# Must match engramrt.hashing.types; constexpr so kernels may read them.
EMPTY = tl.constexpr(-1)
DEAD = tl.constexpr(-2)


# Integer arguments are not specialised on their values, so the launcher's
# cache key stays cheap (see engramrt._launch); pointers keep their 16-byte
# alignment specialisation, which vectorises the per-token loads.
_HASH_INTS = [
    "T",
    "R",
    "V",
    "pad_id",
    "block_size",
    "table_stride",
    "table_cols",
    "history_rows",
    "lb_stride",
]
_COMMIT_INTS = ["T", "R", "V", "window", "max_requests"]


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


@triton.jit
def _request_of_scan(qsl_ptr, i, R, R_PAD: tl.constexpr):
    """(request, chunk start) of each token ``i`` from ONE vector load of ``query_start_loc``.

    ``request = #{b in qsl[1..R] : b <= i}`` (``R`` marks a padding row) and
    ``start = qsl[request]`` = the largest of ``qsl[0]`` and the bounds
    ``<= i`` (``qsl`` never decreases). Needs ``R_PAD >= R``. Replaces the
    binary search's ``ceil(log2(R + 1))`` dependent loads by one load and a
    ``[BLOCK_T, R_PAD]`` compare in registers.
    """
    # int32 halves the registers of the tile: boundaries and token indices are < T < 2**31.
    j = tl.arange(0, R_PAD)
    in_range = j < R
    bounds = tl.load(qsl_ptr + 1 + j, mask=in_range, other=0).to(tl.int32)  # [R_PAD] qsl[1..R]
    first = tl.load(qsl_ptr).to(tl.int32)
    passed = in_range[None, :] & (bounds[None, :] <= i.to(tl.int32)[:, None])  # [BLOCK_T, R_PAD]
    r = tl.sum(passed.to(tl.int32), axis=1).to(tl.int64)
    start = tl.max(tl.where(passed, bounds[None, :], first), axis=1)
    return r, tl.maximum(start, first).to(tl.int64)


@triton.jit
def _cache_slot(table_ptr, r, pos, use, table_stride, table_cols, block_size, history_rows):
    """Slot of position ``pos [BLOCK_T, N_PAD]`` of request ``r [BLOCK_T]`` in the slot
    cache, through the request's row of the block table, and ``use`` narrowed to the
    positions whose block lies inside the cache (a column past ``table_cols`` or a
    block id outside ``[0, history_rows)`` has no slot)."""
    pos = tl.where(use, pos, 0)
    col = pos // block_size
    block = tl.load(
        table_ptr + r[:, None] * table_stride + col,
        mask=use & (col < table_cols),
        other=-1,
    ).to(tl.int64)
    use = use & (block >= 0) & (block < history_rows)
    return block * block_size + pos % block_size, use


@triton.jit
def _mod_prime(x, prime, inv_prime, FAST_MOD: tl.constexpr):
    """``x % prime`` for ``0 <= x < 2**63``, bit-exact.

    FAST_MOD (needs every prime >= 4096): the quotient from a float64
    multiply by ``inv_prime``, ``1 / prime`` correctly rounded on the host,
    is off by at most one (x rounds by at most 512 when converted, the
    reciprocal and the product by 2**-53 relative each:
    ``|x * inv_prime - x / prime| <= 512 / prime + 2**63 * 2**-52 / prime
    = 2560 / prime < 1``), so one correction each way makes the remainder
    exact. Lanes of padded columns (prime 1, inv_prime 0, never stored)
    compute a harmless garbage value. A 64-bit integer division is a long software
    routine on the GPU; this is a convert, a multiply, a multiply-subtract
    and two selects.
    """
    if FAST_MOD:
        q = (x.to(tl.float64) * inv_prime).to(tl.int64)  # truncation = floor, x >= 0
        rem = x - q * prime  # in [-prime, 2 * prime); exact in wrapping int64
        rem = tl.where(rem < 0, rem + prime, rem)
        rem = tl.where(rem >= prime, rem - prime, rem)
    else:
        rem = x % prime
    return rem


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
    inv_primes_ptr,  # [L, C] float64: 1 / prime, correctly rounded (FAST_MOD)
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
    table_cols,  # HISTORY == 1: max_blocks, the block table's columns
    history_rows,  # blocks of the slot cache (HISTORY == 1) or rings (HISTORY == 2)
    lb_stride,
    L: tl.constexpr,
    N: tl.constexpr,
    H: tl.constexpr,
    L_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    HAS_LOOKBACK: tl.constexpr,
    HAS_LOOKBACK_DEAD: tl.constexpr,
    HISTORY: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # binary search: >= ceil(log2(R + 1)); a constexpr so loops unroll
    SCAN_R: tl.constexpr,  # > 0: find requests by _request_of_scan with R_PAD = SCAN_R >= R
    RING_COMMIT: tl.constexpr,  # HISTORY == 2: write the ring here (launcher proves it safe)
    FAST_MOD: tl.constexpr,  # every prime >= 4096: remainders through float64 (_mod_prime)
    SPECULATE: tl.constexpr,  # load lookback ids as if every token were a decode token
):
    """Row ids of BLOCK_T tokens for all layers; see the module docstring.

    Every token's N shifts are gathered as ``[BLOCK_T, N_PAD]`` tiles and all
    constants as small tiles before any of them is used, so the loads of a
    program form a chain of at most three dependent global loads (four with
    a slot cache): qsl -> lookback ids -> token map (-> block table -> slot).
    With SPECULATE, a decode token's lookback ids load beside qsl, so its
    chain is two loads long: (qsl | tokens | lookback ids) -> token map,
    and the token-map gathers run while the request search computes.
    """
    C: tl.constexpr = (N - 1) * H
    ROW: tl.constexpr = N + 2 * C
    i, valid = program_block(T, BLOCK_T)  # [BLOCK_T] token index
    k_idx = tl.arange(0, N_PAD).to(tl.int64)  # [N_PAD] shift
    k2 = k_idx[None, :]  # [1, N_PAD]
    shift_ok = k2 < N
    src = i[:, None] - k2  # [BLOCK_T, N_PAD] token index of each shift
    l_idx = tl.arange(0, L_PAD).to(tl.int64)  # [L_PAD]
    h_idx = tl.arange(0, H_PAD).to(tl.int64)  # [H_PAD]
    l_ok = l_idx < L
    h_ok = h_idx < H
    lh_ok = l_ok[:, None] & h_ok[None, :]  # [L_PAD, H_PAD]

    # Loads that depend on nothing, issued together so their latencies overlap:
    # positions, the batch tokens of every shift (the chunk test comes later),
    # dead flags and all hash constants.
    p = tl.load(positions_ptr + i, mask=valid, other=0).to(tl.int64)
    maybe = valid[:, None] & shift_ok & (src >= 0)
    tok = tl.load(input_ids_ptr + src, mask=maybe, other=0).to(tl.int64)  # [BLOCK_T, N_PAD]
    dead_tok = tl.zeros([BLOCK_T, N_PAD], dtype=tl.int1)
    if HAS_DEAD:
        dead_tok = tl.load(dead_ptr + src, mask=maybe, other=0) != 0
    mult = tl.load(
        consts_ptr + l_idx[:, None] * ROW + k2, mask=l_ok[:, None] & shift_ok, other=0
    )  # [L_PAD, N_PAD]
    l3 = l_idx[:, None, None]
    k3 = k_idx[None, :, None]
    col3 = (k3 - 1) * H + h_idx[None, None, :]  # [1, N_PAD, H_PAD] column of (shift, head)
    col_ok = (l3 < L) & (k3 >= 1) & (k3 < N) & h_ok[None, None, :]
    prime3 = tl.load(
        consts_ptr + l3 * ROW + N + col3, mask=col_ok, other=1
    )  # [L_PAD, N_PAD, H_PAD]
    offset3 = tl.load(consts_ptr + l3 * ROW + N + C + col3, mask=col_ok, other=0)
    inv_prime3 = tl.load(inv_primes_ptr + l3 * C + col3, mask=col_ok, other=0.0)
    if HISTORY == 1:
        new_slot = tl.load(slot_mapping_ptr + i, mask=valid, other=-1).to(tl.int64)
    if HAS_LOOKBACK and SPECULATE:
        # Guess that token i is a decode token (a chunk of one) of request i:
        # its lookback ids are then row i, column k - 1, loaded now with the
        # batch tokens instead of after the request search.
        r_guess = tl.minimum(i, tl.maximum(R - 1, 0))  # [BLOCK_T]
        guess_off = r_guess[:, None] * lb_stride + (k2 - 1)  # [BLOCK_T, N_PAD]
        guess_ok = valid[:, None] & (k2 >= 1) & shift_ok & (r_guess < R)[:, None]
        lb_guess = tl.load(lookback_ptr + guess_off, mask=guess_ok, other=-1).to(tl.int64)
        if HAS_LOOKBACK_DEAD:
            lb_dead_guess = tl.load(lookback_dead_ptr + guess_off, mask=guess_ok, other=0) != 0
    # Token-map gathers that need no request: issued before the search so its
    # compute (or its dependent loads) overlaps them.
    tok = tl.minimum(tl.maximum(tok, 0), V - 1)  # never read outside the map
    value = tl.load(token_map_ptr + tok, mask=maybe, other=0).to(tl.int64)  # [BLOCK_T, N_PAD]
    if HAS_LOOKBACK and SPECULATE:
        guess_known = guess_ok & (lb_guess >= 0)
        lb_guess_tok = tl.minimum(tl.maximum(lb_guess, 0), V - 1)
        value_guess = tl.load(token_map_ptr + lb_guess_tok, mask=guess_known, other=0)

    if SCAN_R > 0:
        r, start = _request_of_scan(qsl_ptr, i, R, SCAN_R)
    else:
        r = _request_of(qsl_ptr, i, valid, R, BLOCK_T, SEARCH_STEPS)
        start = tl.load(qsl_ptr + tl.minimum(r, R), mask=valid, other=0).to(tl.int64)
    padding_row = r >= R
    r_safe = tl.where(padding_row, 0, r)
    start = tl.where(padding_row, i, start)
    chunk_start_pos = p - (i - start)
    owned = valid & ~padding_row
    if HISTORY == 2:
        ring = tl.load(table_ptr + r_safe, mask=owned, other=-1).to(tl.int64)  # [BLOCK_T]
        ring_ok = owned & (ring >= 0) & (ring < history_rows)  # a slot outside: no history
        ring = tl.where(ring_ok, ring, 0)

    pos = p[:, None] - k2  # [BLOCK_T, N_PAD] position of each shift
    in_chunk = valid[:, None] & shift_ok & (src >= start[:, None])
    known = in_chunk
    dead = dead_tok & in_chunk
    # Shift 0 is always in the chunk, so `outside` is false there.
    outside = owned[:, None] & shift_ok & ~in_chunk & (pos >= 0)
    if HAS_LOOKBACK:
        j = chunk_start_pos[:, None] - 1 - pos  # >= 0 outside the chunk
        use_lb = outside & (j < N - 1)
        lb_off = r_safe[:, None] * lb_stride + j
        if SPECULATE:
            # Right guess (request i, first token of its chunk): then j == k - 1 and the
            # guessed ids are the ones wanted; only the other tokens load (later).
            hit = ((r == r_guess) & (start == i))[:, None]
            lb = tl.load(lookback_ptr + lb_off, mask=use_lb & ~hit, other=-1).to(tl.int64)
            lb = tl.where(hit, lb_guess, lb)
            if HAS_LOOKBACK_DEAD:
                lb_dead = tl.load(lookback_dead_ptr + lb_off, mask=use_lb & ~hit, other=0) != 0
                lb_dead = tl.where(hit, lb_dead_guess, lb_dead)
        else:
            lb = tl.load(lookback_ptr + lb_off, mask=use_lb, other=-1).to(tl.int64)
            if HAS_LOOKBACK_DEAD:
                lb_dead = tl.load(lookback_dead_ptr + lb_off, mask=use_lb, other=0) != 0
        lb_known = use_lb & (lb >= 0)
        lb_tok = tl.minimum(tl.maximum(lb, 0), V - 1)
        if SPECULATE:
            lb_value = tl.load(token_map_ptr + lb_tok, mask=lb_known & ~hit, other=0)
            lb_value = tl.where(hit, value_guess, lb_value).to(tl.int64)
        else:
            lb_value = tl.load(token_map_ptr + lb_tok, mask=lb_known, other=0).to(tl.int64)
        value = tl.where(lb_known, lb_value, value)
        if HAS_LOOKBACK_DEAD:
            dead = tl.where(lb_known, lb_dead, dead)
        known = known | lb_known
    if HISTORY == 1:
        if HAS_LOOKBACK:
            # Seed the cache from lookback ids (a request prefilled elsewhere):
            # the chunk's first token writes each known column once.
            seed = lb_known & (i == start)[:, None]
            lb_slot, seed = _cache_slot(
                table_ptr, r_safe, pos, seed, table_stride, table_cols, block_size, history_rows
            )
            lb_code = tl.where(dead, DEAD, value)
            tl.store(slots_ptr + lb_slot, lb_code.to(tl.int32), mask=seed)
        use_h = outside & ~known
        slot, use_h = _cache_slot(
            table_ptr, r_safe, pos, use_h, table_stride, table_cols, block_size, history_rows
        )
        # A block id outside the cache (or a column past the table) reads EMPTY: unknown.
        code = tl.load(slots_ptr + slot, mask=use_h, other=EMPTY).to(tl.int64)
        h_known = use_h & (code != EMPTY)
        value = tl.where(h_known, tl.maximum(code, 0), value)
        dead = tl.where(h_known, code == DEAD, dead)
        known = known | h_known
    if HISTORY == 2:
        use_h = outside & ~known & ring_ok[:, None]
        slot = ring[:, None] * block_size + tl.where(use_h, pos, 0) % block_size
        tag = tl.load(tags_ptr + slot, mask=use_h, other=-1)
        code = tl.load(slots_ptr + slot, mask=use_h, other=EMPTY).to(tl.int64)
        h_known = use_h & (tag == pos) & (code != EMPTY)
        value = tl.where(h_known, tl.maximum(code, 0), value)
        dead = tl.where(h_known, code == DEAD, dead)
        known = known | h_known

    # blocked_k = any stop at a shift <= k (SPEC §4): a prefix OR along the shifts.
    stop = (known & dead) | ((k2 > 0) & ((pos < 0) | padding_row[:, None]))
    blocked = (tl.cumsum(stop.to(tl.int32), axis=1) > 0) | ~valid[:, None]
    hashed = tl.where(blocked | ~known, pad_id, value)  # [BLOCK_T, N_PAD]

    rolling = tl.zeros([BLOCK_T, L_PAD], dtype=tl.int64)
    for k in tl.static_range(N):
        # Column k of the register tiles (one nonzero term per sum: exact).
        value_k = tl.sum(tl.where(k2 == k, hashed, 0), axis=1)  # [BLOCK_T]
        mult_k = tl.sum(tl.where(k2 == k, mult, 0), axis=1)  # [L_PAD]
        rolling = rolling ^ (value_k[:, None] * mult_k[None, :])  # [BLOCK_T, L_PAD]
        if k > 0:
            prime = tl.sum(tl.where(k3 == k, prime3, 0), axis=1)  # [L_PAD, H_PAD]
            offset = tl.sum(tl.where(k3 == k, offset3, 0), axis=1)
            inv_prime = tl.sum(tl.where(k3 == k, inv_prime3, 0.0), axis=1)
            bucket = _mod_prime(
                rolling[:, :, None], prime[None, :, :], inv_prime[None, :, :], FAST_MOD
            )
            row_id = bucket + offset[None, :, :]
            col = (k - 1) * H + h_idx  # [H_PAD]
            out_off = i[:, None, None] * (L * C) + l_idx[None, :, None] * C + col[None, None, :]
            tl.store(
                out_ptr + out_off,
                row_id.to(out_ptr.dtype.element_ty),
                mask=valid[:, None, None] & lh_ok[None, :, :],
            )

    if HISTORY > 0:
        # This step's tokens become history for later steps and other requests:
        # shift 0 is the token itself (in its chunk), already mapped.
        own_code = tl.sum(tl.where(k2 == 0, tl.where(dead, DEAD, value), 0), axis=1)
        own_code = own_code.to(tl.int32)  # [BLOCK_T]
    if HISTORY == 1:
        write = owned & (new_slot >= 0) & (new_slot < history_rows * block_size)
        tl.store(slots_ptr + new_slot, own_code, mask=write)
    if HISTORY == 2 and RING_COMMIT:
        # Every chunk is at most window - (N-1) long here, so the positions
        # written never alias (mod window) the N-1 positions read before a chunk.
        ring_write = ring_ok & (p >= 0)  # a negative position has no place in the ring
        ring_slot = ring * block_size + tl.where(ring_write, p, 0) % block_size
        tl.store(slots_ptr + ring_slot, own_code, mask=ring_write)
        tl.store(tags_ptr + ring_slot, p, mask=ring_write)


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
    max_requests,  # rings: a request slot outside [0, max_requests) is not written
    BLOCK_T: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Write the last ``window`` tokens of each chunk into its request's ring."""
    i, valid = program_block(T, BLOCK_T)
    r = _request_of(qsl_ptr, i, valid, R, BLOCK_T, SEARCH_STEPS)
    owned = valid & (r < R)
    r_safe = tl.where(owned, r, 0)
    end = tl.load(qsl_ptr + r_safe + 1, mask=owned, other=0).to(tl.int64)
    # Only the last `window` tokens of a chunk: each ring slot is written once.
    write = owned & (i >= end - window)
    p = tl.load(positions_ptr + i, mask=write, other=0).to(tl.int64)
    ring = tl.load(request_slots_ptr + r_safe, mask=write, other=-1).to(tl.int64)
    write = write & (ring >= 0) & (ring < max_requests) & (p >= 0)
    slot = ring * window + tl.where(write, p, 0) % window
    code = _history_code(input_ids_ptr, token_map_ptr, dead_ptr, i, write, V, HAS_DEAD)
    tl.store(slots_ptr + slot, code, mask=write)
    tl.store(tags_ptr + slot, p, mask=write)
