"""Triton probe + gather + dequantise kernel of the hot-row cache.

One launch, no host synchronisation (the miss path that follows it is the
part that synchronises). The structure is :mod:`engramrt.lookup.kernel`'s,
with a probe in front (the flat-lookup preamble and the dequantising tail are
the shared ``@triton.jit`` helpers of :mod:`engramrt._jit`):

- the ``T * C`` lookups are flattened, ``ROWS`` per program, as tiles
  ``[ROWS, NB, 32]`` (rows x scale blocks x values);
- per lookup the set is ``mix32(row_id) mod num_sets`` (the same integer
  steps as :func:`engramrt.cache.policy.mix32`, all int64 and overflow-free)
  and the set's ``WAYS`` tags load as one ``[ROWS, WAYS]`` tile (64 bytes
  per lookup at 8 ways, contiguous); a match gives the slot;
- a hit reads the slot's packed row (264 bytes at ``E = 256``, 8-byte
  aligned as in the lookup kernel) and dequantises it with the lookup
  kernel's own tail (:func:`engramrt._jit.store_dequantized_rows`,
  the integer formulation that is exact in the interpreter too);
- a non-owned column stores +0.0; a miss stores nothing (the caller's miss
  path fills it), and its slot is reported as -1 — unless ``READ_MISSES``:
  then a miss reads its packed row from the backing tier's rows (device
  memory, or host memory mapped for the device) and stores it like a hit,
  so the lookup needs no miss path at all. A miss outside the backing's
  rows reads nothing and stores +0.0 (the lookup kernel's rule), never
  out of bounds.

Every index is int64 (program id cast first): slot * 264 overflows int32
past 8.1 M slots, and a 5 % cache of a V4.1 layer has 19 M.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engramrt._jit import flat_lookups, program_block, store_dequantized_rows
from engramrt._launch import CachedLauncher
from engramrt.cache.policy import MIX_MULTIPLIER
from engramrt.lookup.kernel import flat_lookup_args, row_tile_options
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelConfig

__all__ = ["install_rows_triton", "probe_gather_triton"]

# Runtime integers are not specialised on their values (cheap launcher key).
_INTS = [
    "backing_num_rows",
    "n_lookups",
    "num_cols",
    "stride_t",
    "stride_c",
    "col_begin",
    "col_end",
    "num_sets",
    "backing_row_begin",
]


@triton.jit(do_not_specialize=_INTS)
def _cache_probe_gather_kernel(
    row_ids_ptr,  # [T, C] int32 / int64, strides (stride_t, stride_c)
    tags_ptr,  # [num_sets * WAYS + 1] int64, EMPTY = -1
    cache_rows_ptr,  # [num_sets * WAYS + 1, ROW_BYTES] uint8, packed rows
    out_ptr,  # [T, C, E] int16 (bf16 bits), contiguous
    slots_ptr,  # [T, C] int64, contiguous: slot, -1 miss, -2 not owned
    backing_ptr,  # [backing rows, ROW_BYTES] uint8, packed rows (READ_MISSES)
    n_lookups,  # T * C
    num_cols,
    stride_t,
    stride_c,
    col_begin,
    col_end,
    num_sets,
    backing_row_begin,  # the global id of the backing's first row
    backing_num_rows,  # its rows: a miss outside them reads zeros (READ_MISSES)
    E: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    WAYS: tl.constexpr,
    MIX: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    READ_MISSES: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    lookup, in_batch, owned, row_id = flat_lookups(
        row_ids_ptr, tile, n_lookups, num_cols, stride_t, stride_c, col_begin, col_end, ROWS
    )

    # mix32 (policy.py): fold to 32 bits, two xor-shift-multiply rounds.
    h = (row_id ^ (row_id >> 32)) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * MIX) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * MIX) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    first_slot = (h % num_sets) * WAYS  # [ROWS] int64

    way = tl.arange(0, WAYS)
    set_tags = tl.load(
        tags_ptr + first_slot[:, None] + way[None, :], mask=owned[:, None], other=-1
    )  # [ROWS, WAYS]
    found = tl.max(tl.where(set_tags == row_id[:, None], way[None, :], -1), axis=1)
    hit = owned & (found >= 0) & (row_id >= 0)  # a negative id never matches EMPTY (-1)
    slot = tl.where(hit, first_slot + found, -1)
    tl.store(slots_ptr + lookup, tl.where(owned, slot, -2), mask=in_batch)

    if READ_MISSES:
        # A miss reads the backing's row; each lookup loads from one of two tables.
        local_row = row_id - backing_row_begin
        miss = owned & ~hit & (local_row >= 0) & (local_row < backing_num_rows)
        read = hit | miss
        cache_start = tl.where(hit, slot, 0) * ROW_BYTES
        backing_start = tl.where(miss, local_row, 0) * ROW_BYTES
        row_ptrs = tl.where(hit, cache_rows_ptr + cache_start, backing_ptr + backing_start)
        written = in_batch
    else:
        read = hit
        row_ptrs = cache_rows_ptr + tl.where(hit, slot, 0) * ROW_BYTES
        written = in_batch & (hit | ~owned)  # misses are left to the miss path
    store_dequantized_rows(out_ptr, lookup, row_ptrs, read, written, E, NB, NB_PAD, HW_CONVERT, "")


# A plain kernel[grid](...) binds ~20 arguments in Python on every call (host
# time of the order of a decode step's kernel): launch through the cache.
_launch_probe_gather = CachedLauncher(_cache_probe_gather_kernel)


def probe_gather_triton(
    row_ids: torch.Tensor,
    tags: torch.Tensor,
    cache_rows: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_sets: int,
    ways: int,
    col_begin: int,
    col_end: int,
    kernel: LookupKernelConfig = DEFAULT_KERNEL,
    backing: Any = None,
    backing_row_begin: int = 0,
) -> torch.Tensor:
    """Launch :func:`_cache_probe_gather_kernel` (inputs validated by the caller).

    Args:
        row_ids: ``[T, C]`` int32/int64 on the cache's device (any strides).
        tags, cache_rows: the index and its packed rows (contiguous).
        out: contiguous ``[T, C, E]`` bf16; hits and non-owned columns written.
        slots: contiguous ``[T, C]`` int64, fully written.
        num_sets, ways: geometry (``ways`` a power of two).
        col_begin, col_end: owned columns.
        kernel: tile, warps and conversion variant, as in
            :func:`engramrt.lookup.kernel.lookup_rows_triton` (one tile per
            program: ``max_programs`` does not apply to the probe).
        backing: the backing tier's packed rows as the device reads them
            (:meth:`engramrt.lookup.tiers.RowStore.device_rows`): misses read
            them and ``out`` is written everywhere. None: misses are left.
        backing_row_begin: the global row id of ``backing``'s first row; a
            miss outside ``backing``'s rows (``shape[0]`` of a tensor,
            ``num_rows`` of :class:`~engramrt.lookup.mapped.MappedHostRows`)
            reads a row of zeros.

    Returns:
        ``slots``.
    """
    n_lookups = row_ids.numel()  # T * C
    if n_lookups == 0:
        return slots
    options = row_tile_options(out.shape[-1], kernel)
    if backing is None:
        backing_num_rows = 0
    elif isinstance(backing, torch.Tensor):
        backing_num_rows = backing.shape[0]
    else:
        backing_num_rows = backing.num_rows
    grid = (triton.cdiv(n_lookups, options["ROWS"]),)
    _launch_probe_gather(
        grid,
        row_ids,
        tags,
        cache_rows,
        out.view(torch.int16),
        slots,
        cache_rows if backing is None else backing,
        *flat_lookup_args(row_ids, col_begin, col_end),
        num_sets,
        backing_row_begin,
        backing_num_rows,
        WAYS=ways,
        MIX=MIX_MULTIPLIER,
        READ_MISSES=backing is not None,
        **options,
    )
    return slots


@triton.jit(do_not_specialize=["n", "row_begin", "num_rows"])
def _install_kernel(
    plan_slots_ptr,  # [n] int64: the victim slot of an admitted entry
    plan_tags_ptr,  # [n] int64: the admitted row id
    plan_counts_ptr,  # [n] int32
    admitted_ptr,  # [n] bool as uint8
    evicted_ptr,  # [n] bool as uint8
    backing_ptr,  # [num_rows, WORDS] words: the backing's packed rows
    cache_rows_ptr,  # [slots + 1, WORDS] words
    tags_ptr,  # [slots + 1] int64
    counts_ptr,  # [slots + 1] int32
    admitted_total_ptr,  # [] int64 counters, added to
    evicted_total_ptr,
    read_total_ptr,
    n,
    row_begin,
    num_rows,
    WORDS: tl.constexpr,
    WORDS_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    r, ok = program_block(n, ROWS)
    admitted = ok & (tl.load(admitted_ptr + r, mask=ok, other=0) != 0)
    slot = tl.load(plan_slots_ptr + r, mask=admitted, other=0)
    tag = tl.load(plan_tags_ptr + r, mask=admitted, other=0)
    local = tag - row_begin
    read = admitted & (local >= 0) & (local < num_rows)
    word = tl.arange(0, WORDS_PAD)
    in_row = (word < WORDS)[None, :]
    words = tl.load(
        backing_ptr + tl.where(read, local, 0)[:, None] * WORDS + word[None, :],
        mask=read[:, None] & in_row,
        other=0,
    )
    tl.store(
        cache_rows_ptr + slot[:, None] * WORDS + word[None, :],
        words,
        mask=admitted[:, None] & in_row,
    )
    tl.store(tags_ptr + slot, tag, mask=admitted)
    tl.store(counts_ptr + slot, tl.load(plan_counts_ptr + r, mask=admitted, other=0), mask=admitted)
    evicted = admitted & (tl.load(evicted_ptr + r, mask=ok, other=0) != 0)
    tl.atomic_add(admitted_total_ptr, tl.sum(admitted.to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_add(evicted_total_ptr, tl.sum(evicted.to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_add(read_total_ptr, tl.sum(read.to(tl.int64), axis=0), sem="relaxed")


_launch_install = CachedLauncher(_install_kernel)

INSTALL_ROWS_PER_PROGRAM = 8
"""Plan entries per program of :func:`install_rows_triton` (as the packed-row gather)."""


def install_rows_triton(
    plan: Any,
    backing_words: Any,
    cache_rows: torch.Tensor,
    tags: torch.Tensor,
    counts: torch.Tensor,
    totals: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    row_begin: int,
    num_rows: int,
) -> None:
    """Install an :class:`~engramrt.cache.policy.AdmissionPlan` in one launch: each admitted
    entry's packed row read from the backing's rows (``backing_words``, as
    :func:`engramrt.lookup.kernel.gather_packed_rows_triton` reads them) into its victim
    slot of ``cache_rows``, then its tag and counter; rejected entries write nothing.
    Adds the admitted, evicted and read rows to the three 0-d int64 ``totals``.

    The result is the three phases' (``invalidate``, ``write``, ``publish``) on every
    slot but the scratch one, which rejected entries leave as it was. No phase order
    is needed inside the launch: the cache's lookups wait for the update to finish
    (:meth:`engramrt.cache.CachedRowStore.update`), so none reads a slot meanwhile.
    """
    n = plan.slots.shape[0]
    if n == 0:
        return
    word = backing_words.dtype
    words = cache_rows.shape[1] // torch.empty((), dtype=word).element_size()
    _launch_install(
        (triton.cdiv(n, INSTALL_ROWS_PER_PROGRAM),),
        plan.slots,
        plan.tags,
        plan.counts,
        plan.admitted.view(torch.uint8),
        plan.evicted.view(torch.uint8),
        backing_words,
        cache_rows.view(word),
        tags,
        counts,
        *totals,
        n,
        row_begin,
        num_rows,
        WORDS=words,
        WORDS_PAD=triton.next_power_of_2(words),
        ROWS=INSTALL_ROWS_PER_PROGRAM,
    )
