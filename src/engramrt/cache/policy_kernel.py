"""Triton kernels of the cache's replacement policy: counting and choosing victims.

:class:`~engramrt.cache.policy.SetAssociativeLfu` defines the policy in plain
torch (``backend="reference"``); with ``backend="triton"`` its two per-update
steps run here instead, with the same results bit for bit:

- :func:`record_triton` counts a batch of accesses: per access, one atomic
  add to each of the sketch's ``depth`` counters and one to the hit slot's
  counter (a miss counts on the scratch slot, as the reference's
  ``index_add_`` does). Integer adds commute, so the order the atomics land
  in does not change a count. About 30 small launches in torch become one.
- :func:`plan_triton` chooses the victims of ``U`` candidates in two launches
  around one ``torch.sort``:

  1. per candidate, its sketch estimate (the minimum of its ``depth``
     counters), its set (``mix32(id) mod num_sets``) and the sort key
     ``set * 2**31 + (COUNT_MAX - estimate)`` (a placeholder's estimate is -1);
  2. ``torch.sort(keys, stable=True)``: by set, highest estimate first, ties
     in input order (the reference's ``argsort``);
  3. per sorted candidate, its rank in its set (the distance to the first
     key of its set, found by binary search in the sorted keys), the set's
     ways ordered by counter (empty ways as -1; stable: ties by way), the way
     at position ``min(rank, ways - 1)`` as the victim, and the admission
     test (rank below ``ways``, estimate above the victim's counter, a real
     candidate, not resident already).

  About 80 small launches in torch become three.
- :func:`plan_batch_triton` plans a whole batch of looked-up positions
  (:meth:`SetAssociativeLfu.plan_batch`) with no sort, in three launches:

  1. each missed position in the shard gets its estimate and is linked into
     its set's list: ``atomic_xchg`` of the set's head, the old head kept as
     the position's successor. Heads carry the batch's epoch in their top 32
     bits, so a head left by an earlier batch reads as the end of the list and
     nothing is cleared between batches;
  2. walking its set's list, each position learns whether an earlier position
     holds the same id (then it is a repeat, never a candidate);
  3. walking it again, each candidate counts the candidates that rank before
     it (a higher estimate, or the same estimate and a lower id: the order of
     the sorted definition, whose candidates come sorted by id), then picks its
     victim as in step 3 above.

  Lists are as long as the candidates that share a set: about one at decode
  on a cache of millions of sets.

The hash is :func:`mix32`, the integer steps of
:func:`engramrt.cache.policy.mix32` (int64, overflow-free), the same as the
probe kernel's (:mod:`engramrt.cache.kernel`). Every index is int64. The
functions take a :class:`~engramrt.cache.policy.SetAssociativeLfu` and return
an :class:`~engramrt.cache.policy.AdmissionPlan`'s tensors (this module does
not import the policy's). Importing this module imports Triton.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engramrt._jit import program_block
from engramrt._launch import CachedLauncher

__all__ = ["mix32", "plan_batch_triton", "plan_triton", "record_triton"]

RECORD_BLOCK = 256
"""Accesses per program of the counting kernel."""

KEYS_BLOCK = 256
"""Candidates per program of the key kernel."""


@triton.jit
def mix32(x, MIX: tl.constexpr):
    """int64 ``x`` -> int64 in ``[0, 2**32)``: :func:`engramrt.cache.policy.mix32`."""
    h = (x ^ (x >> 32)) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * MIX) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * MIX) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def sketch_estimate(
    ids, mask, seeds_ptr, sketch_ptr, width, DEPTH: tl.constexpr, MIX: tl.constexpr
):
    """The count-min estimate (int32) of each id: the least of its ``DEPTH`` counters."""
    estimate = tl.full(ids.shape, 2147483647, tl.int32)
    for d in tl.static_range(DEPTH):
        seed = tl.load(seeds_ptr + d)
        column = mix32(ids ^ seed, MIX) & (width - 1)
        count = tl.load(sketch_ptr + d * width + column, mask=mask, other=0)
        estimate = tl.minimum(estimate, count)
    return estimate


@triton.jit
def choose_victim(sets, rank, ids, mask, tags_ptr, counts_ptr, WAYS: tl.constexpr):
    """For candidates of rank ``rank`` in their set: the victim slot (the way at position
    ``min(rank, WAYS - 1)`` of the set's ways by counter, weakest first, empty ways as -1,
    ties by way), its counter, and whether the candidate is resident already."""
    way = tl.arange(0, WAYS).to(tl.int64)
    set_slots = sets[:, None] * WAYS + way[None, :]  # [BLOCK, WAYS]
    tags = tl.load(tags_ptr + set_slots, mask=mask[:, None], other=-1)
    counts = tl.load(counts_ptr + set_slots, mask=mask[:, None], other=0).to(tl.int64)
    weight = tl.where(tags == -1, -1, counts)
    before = (weight[:, None, :] < weight[:, :, None]) | (
        (weight[:, None, :] == weight[:, :, None]) & (way[None, None, :] < way[None, :, None])
    )  # [BLOCK, way w, way v]: v sorts before w
    position = tl.sum(before.to(tl.int32), axis=2)  # [BLOCK, WAYS]
    chosen = position == tl.minimum(rank, WAYS - 1)[:, None]
    victim_count = tl.sum(tl.where(chosen, weight, 0), axis=1)
    victim = sets * WAYS + tl.sum(tl.where(chosen, way[None, :], 0), axis=1)
    # A negative id never matches an empty way.
    resident = tl.max(((tags == ids[:, None]) & (ids[:, None] >= 0)).to(tl.int32), axis=1) > 0
    return victim, victim_count, resident


@triton.jit
def store_plan(
    index, ok, admitted, victim, victim_count, ids, counts, scratch,
    out_slots_ptr, out_tags_ptr, out_counts_ptr, out_admitted_ptr, out_evicted_ptr,
):  # fmt: skip
    """Write the plan entries ``index`` (an :class:`AdmissionPlan`'s five tensors)."""
    tl.store(out_slots_ptr + index, tl.where(admitted, victim, scratch), mask=ok)
    tl.store(out_tags_ptr + index, tl.where(admitted, ids, -1), mask=ok)
    tl.store(out_counts_ptr + index, counts.to(tl.int32), mask=ok)
    tl.store(out_admitted_ptr + index, admitted.to(tl.uint8), mask=ok)
    tl.store(out_evicted_ptr + index, (admitted & (victim_count >= 0)).to(tl.uint8), mask=ok)


@triton.jit(do_not_specialize=["n", "width", "scratch"])
def _record_kernel(
    ids_ptr,  # [n] int32 / int64 row ids
    slots_ptr,  # [n] int64: slot, MISS (-1) or NOT_OWNED (-2)
    seeds_ptr,  # [DEPTH] int64 sketch seeds
    sketch_ptr,  # [DEPTH, width] int32
    counts_ptr,  # [slots + 1] int32 (the last: scratch)
    n,
    width,
    scratch,
    DEPTH: tl.constexpr,
    MIX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, ok = program_block(n, BLOCK)
    ids = tl.load(ids_ptr + index, mask=ok, other=0).to(tl.int64)
    slots = tl.load(slots_ptr + index, mask=ok, other=-2)
    counted = ok & (slots != -2)
    for d in tl.static_range(DEPTH):
        seed = tl.load(seeds_ptr + d)
        column = mix32(ids ^ seed, MIX) & (width - 1)
        tl.atomic_add(sketch_ptr + d * width + column, 1, mask=counted, sem="relaxed")
    target = tl.where(slots >= 0, slots, scratch)
    tl.atomic_add(counts_ptr + target, 1, mask=counted, sem="relaxed")


@triton.jit(do_not_specialize=["n", "width", "num_sets"])
def _candidate_keys_kernel(
    candidates_ptr,  # [n] int64
    valid_ptr,  # [n] bool as uint8 (HAS_VALID)
    seeds_ptr,  # [DEPTH] int64
    sketch_ptr,  # [DEPTH, width] int32
    keys_ptr,  # [n] int64 out: set * 2**31 + (COUNT_MAX - estimate)
    n,
    width,
    num_sets,
    DEPTH: tl.constexpr,
    MIX: tl.constexpr,
    COUNT_MAX: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, ok = program_block(n, BLOCK)
    ids = tl.load(candidates_ptr + index, mask=ok, other=0)
    estimate = sketch_estimate(ids, ok, seeds_ptr, sketch_ptr, width, DEPTH, MIX).to(tl.int64)
    if HAS_VALID:
        valid = tl.load(valid_ptr + index, mask=ok, other=0) != 0
        estimate = tl.where(valid, estimate, -1)
    sets = mix32(ids, MIX) % num_sets
    tl.store(keys_ptr + index, sets * 2147483648 + (COUNT_MAX - estimate), mask=ok)


@triton.jit(do_not_specialize=["n", "scratch", "search_steps"])
def _choose_victims_kernel(
    sorted_keys_ptr,  # [n] int64, ascending
    order_ptr,  # [n] int64: input position of each sorted key
    candidates_ptr,  # [n] int64, input order
    valid_ptr,  # [n] bool as uint8, input order (HAS_VALID)
    tags_ptr,  # [slots + 1] int64
    counts_ptr,  # [slots + 1] int32
    out_slots_ptr,  # [n] int64
    out_tags_ptr,  # [n] int64
    out_counts_ptr,  # [n] int32
    out_admitted_ptr,  # [n] bool as uint8
    out_evicted_ptr,  # [n] bool as uint8
    n,
    scratch,
    search_steps,  # >= log2(n + 1); a runtime bound: one compiled kernel for every n
    WAYS: tl.constexpr,
    COUNT_MAX: tl.constexpr,
    HAS_VALID: tl.constexpr,
    RECHECK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, ok = program_block(n, BLOCK)
    key = tl.load(sorted_keys_ptr + index, mask=ok, other=0)
    sets = key >> 31
    estimate = COUNT_MAX - (key & 2147483647)
    at = tl.load(order_ptr + index, mask=ok, other=0)
    ids = tl.load(candidates_ptr + at, mask=ok, other=0)

    # The first sorted position of this set: the lower bound of set * 2**31.
    low = tl.zeros([BLOCK], tl.int64)
    high = tl.zeros([BLOCK], tl.int64) + n
    bound = sets * 2147483648
    step = 0
    while step < search_steps:
        mid = (low + high) >> 1
        probe = tl.load(sorted_keys_ptr + mid, mask=ok & (mid < high), other=0)
        below = probe < bound
        low = tl.where((mid < high) & below, mid + 1, low)
        high = tl.where((mid < high) & ~below, mid, high)
        step += 1
    rank = index - low

    victim, victim_count, resident = choose_victim(sets, rank, ids, ok, tags_ptr, counts_ptr, WAYS)
    admitted = (rank < WAYS) & (estimate > victim_count)
    if HAS_VALID:
        admitted &= tl.load(valid_ptr + at, mask=ok, other=0) != 0
    if RECHECK:  # resident already
        admitted &= ~resident
    store_plan(
        index, ok, admitted, victim, victim_count, ids, estimate, scratch,
        out_slots_ptr, out_tags_ptr, out_counts_ptr, out_admitted_ptr, out_evicted_ptr,
    )  # fmt: skip


_launch_record = CachedLauncher(_record_kernel)
_launch_keys = CachedLauncher(_candidate_keys_kernel)
_launch_victims = CachedLauncher(_choose_victims_kernel)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def record_triton(policy: Any, row_ids: torch.Tensor, slots: torch.Tensor, *, mix: int) -> None:
    """Count ``[n]`` accesses into ``policy``'s sketch and counters (``policy``: a
    :class:`~engramrt.cache.policy.SetAssociativeLfu`; see the module doc); ``slots``
    int64 on the policy's device, ``mix`` its hash multiplier. The caller handles the
    decay clock."""
    n = slots.shape[0]
    ids = row_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    _launch_record(
        (_cdiv(n, RECORD_BLOCK),),
        ids.contiguous(),
        slots.contiguous(),
        policy.sketch_seeds,
        policy.sketch,
        policy.counts,
        n,
        policy.sketch_width,
        policy.scratch,
        DEPTH=policy.sketch_depth,
        MIX=mix,
        BLOCK=RECORD_BLOCK,
    )


def plan_triton(
    policy: Any,
    candidates: torch.Tensor,
    recheck: bool,
    valid: torch.Tensor | None,
    *,
    mix: int,
    count_max: int,
) -> tuple[torch.Tensor, ...]:
    """:meth:`SetAssociativeLfu.plan` of ``[U]`` int64 candidates (``U >= 1``) on the
    policy's device, ``valid`` bool or None (see the module doc): the plan's ``slots,
    tags, counts, order, admitted, evicted``."""
    count = candidates.shape[0]
    device = policy.device
    candidates = candidates.contiguous()
    valid_bytes = valid.contiguous().view(torch.uint8) if valid is not None else candidates
    keys = torch.empty(count, dtype=torch.int64, device=device)
    _launch_keys(
        (_cdiv(count, KEYS_BLOCK),),
        candidates,
        valid_bytes,
        policy.sketch_seeds,
        policy.sketch,
        keys,
        count,
        policy.sketch_width,
        policy.num_sets,
        DEPTH=policy.sketch_depth,
        MIX=mix,
        COUNT_MAX=count_max,
        HAS_VALID=valid is not None,
        BLOCK=KEYS_BLOCK,
    )
    sorted_keys, order = torch.sort(keys, stable=True)
    outputs = _plan_outputs(count, device)
    ways = policy.ways
    block = max(1, 2048 // (ways * ways))
    _launch_victims(
        (_cdiv(count, block),),
        sorted_keys,
        order,
        candidates,
        valid_bytes,
        policy.tags,
        policy.counts,
        *_written(outputs),
        count,
        policy.scratch,
        max(1, count.bit_length()),
        WAYS=ways,
        COUNT_MAX=count_max,
        HAS_VALID=valid is not None,
        RECHECK=recheck,
        BLOCK=block,
    )
    slots, tags, counts, admitted, evicted = outputs
    return slots, tags, counts, order, admitted, evicted


def _plan_outputs(n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The plan entries a victims kernel writes: ``slots, tags, counts, admitted, evicted``."""
    return (
        torch.empty(n, dtype=torch.int64, device=device),
        torch.empty(n, dtype=torch.int64, device=device),
        torch.empty(n, dtype=torch.int32, device=device),
        torch.empty(n, dtype=torch.bool, device=device),
        torch.empty(n, dtype=torch.bool, device=device),
    )


def _written(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """:func:`_plan_outputs` as the kernels' pointers (the bools as bytes)."""
    slots, tags, counts, admitted, evicted = outputs
    return slots, tags, counts, admitted.view(torch.uint8), evicted.view(torch.uint8)


# -- a batch's plan without sorting -------------------------------------------------


@triton.jit(do_not_specialize=["n", "width", "num_sets", "row_begin", "row_end", "epoch"])
def _link_kernel(
    ids_ptr,  # [n] int64 row ids, the batch's order
    slots_ptr,  # [n] int64, the probe's slots
    seeds_ptr,  # [DEPTH] int64
    sketch_ptr,  # [DEPTH, width] int32
    heads_ptr,  # [num_sets] int64: epoch * 2**32 + the last position linked into the set
    next_ptr,  # [n] int64 out: the set's previous head when this position was linked
    estimate_ptr,  # [n] int64 out: a candidate's estimate, -1 elsewhere
    n,
    width,
    num_sets,
    row_begin,
    row_end,
    epoch,
    DEPTH: tl.constexpr,
    MIX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, ok = program_block(n, BLOCK)
    ids = tl.load(ids_ptr + index, mask=ok, other=0)
    slots = tl.load(slots_ptr + index, mask=ok, other=-2)
    missed = ok & (slots == -1) & (ids >= row_begin) & (ids < row_end)
    estimate = sketch_estimate(ids, missed, seeds_ptr, sketch_ptr, width, DEPTH, MIX)
    sets = mix32(ids, MIX) % num_sets
    previous = tl.atomic_xchg(heads_ptr + sets, (epoch.to(tl.int64) << 32) + index, mask=missed)
    tl.store(next_ptr + index, tl.where(missed, previous, -1), mask=ok)
    tl.store(estimate_ptr + index, tl.where(missed, estimate.to(tl.int64), -1), mask=ok)


@triton.jit(do_not_specialize=["n", "num_sets", "epoch"])
def _first_kernel(
    ids_ptr,  # [n] int64
    estimate_ptr,  # [n] int64: >= 0 for a candidate
    heads_ptr,  # [num_sets] int64
    next_ptr,  # [n] int64
    first_ptr,  # [n] uint8 out: a candidate at the first position of its id
    n,
    num_sets,
    epoch,
    MIX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, ok = program_block(n, BLOCK)
    ids = tl.load(ids_ptr + index, mask=ok, other=0)
    candidate = ok & (tl.load(estimate_ptr + index, mask=ok, other=-1) >= 0)
    cursor = tl.load(heads_ptr + mix32(ids, MIX) % num_sets, mask=candidate, other=-1)
    active = candidate & ((cursor >> 32) == epoch)
    repeat = tl.zeros([BLOCK], tl.int1)
    while tl.max(active.to(tl.int32), axis=0) > 0:  # walk the set's list
        at = cursor & 4294967295
        other = tl.load(ids_ptr + at, mask=active, other=0)
        repeat |= active & (other == ids) & (at < index)
        cursor = tl.load(next_ptr + at, mask=active, other=-1)
        active &= (cursor >> 32) == epoch
    tl.store(first_ptr + index, (candidate & ~repeat).to(tl.uint8), mask=ok)


@triton.jit(do_not_specialize=["n", "num_sets", "scratch", "epoch"])
def _batch_victims_kernel(
    ids_ptr,  # [n] int64
    estimate_ptr,  # [n] int64
    first_ptr,  # [n] uint8: the distinct candidates
    heads_ptr,  # [num_sets] int64
    next_ptr,  # [n] int64
    tags_ptr,  # [slots + 1] int64
    counts_ptr,  # [slots + 1] int32
    out_slots_ptr,  # [n] int64
    out_tags_ptr,  # [n] int64
    out_counts_ptr,  # [n] int32
    out_admitted_ptr,  # [n] bool as uint8
    out_evicted_ptr,  # [n] bool as uint8
    n,
    num_sets,
    scratch,
    epoch,
    WAYS: tl.constexpr,
    MIX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, ok = program_block(n, BLOCK)
    ids = tl.load(ids_ptr + index, mask=ok, other=0)
    estimate = tl.load(estimate_ptr + index, mask=ok, other=-1)
    first = ok & (tl.load(first_ptr + index, mask=ok, other=0) != 0)
    sets = mix32(ids, MIX) % num_sets

    # Rank in the set: the distinct candidates that sort before this one (a higher
    # estimate, or the same and a lower id: plan()'s order over sorted ids).
    cursor = tl.load(heads_ptr + sets, mask=first, other=-1)
    active = first & ((cursor >> 32) == epoch)
    rank = tl.zeros([BLOCK], tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        at = cursor & 4294967295
        other = tl.load(ids_ptr + at, mask=active, other=0)
        other_estimate = tl.load(estimate_ptr + at, mask=active, other=-1)
        other_first = tl.load(first_ptr + at, mask=active, other=0) != 0
        ahead = (other_estimate > estimate) | ((other_estimate == estimate) & (other < ids))
        rank += (active & other_first & (at != index) & ahead).to(tl.int64)
        cursor = tl.load(next_ptr + at, mask=active, other=-1)
        active &= (cursor >> 32) == epoch

    victim, victim_count, resident = choose_victim(
        sets, rank, ids, first, tags_ptr, counts_ptr, WAYS
    )
    admitted = first & (rank < WAYS) & (estimate > victim_count) & ~resident
    store_plan(
        index, ok, admitted, victim, victim_count, ids, tl.where(first, estimate, -1), scratch,
        out_slots_ptr, out_tags_ptr, out_counts_ptr, out_admitted_ptr, out_evicted_ptr,
    )  # fmt: skip


_launch_link = CachedLauncher(_link_kernel)
_launch_first = CachedLauncher(_first_kernel)
_launch_batch_victims = CachedLauncher(_batch_victims_kernel)

BATCH_BLOCK = 128
"""Positions per program of the batch-plan kernels."""


def plan_batch_triton(
    policy: Any,
    ids: torch.Tensor,
    slots: torch.Tensor,
    row_begin: int,
    row_end: int | None,
    heads: torch.Tensor,
    epoch: int,
    *,
    mix: int,
) -> tuple[torch.Tensor, ...]:
    """:meth:`SetAssociativeLfu.plan_batch` of ``[n]`` int64 ``ids`` and ``slots`` on the
    policy's device (``1 <= n < 2**32``): link each candidate into its set's list in
    ``heads`` (``[num_sets]`` int64, entries of earlier epochs are stale) under ``epoch``,
    mark each id's first position, then rank, choose and admit (see the module doc).
    Returns the plan's ``slots, tags, counts, order, admitted, evicted``."""
    n = ids.shape[0]
    device = policy.device
    ids, slots = ids.contiguous(), slots.contiguous()
    following = torch.empty(n, dtype=torch.int64, device=device)
    estimate = torch.empty(n, dtype=torch.int64, device=device)
    first = torch.empty(n, dtype=torch.uint8, device=device)
    grid = (_cdiv(n, BATCH_BLOCK),)
    row_end = (1 << 63) - 1 if row_end is None else row_end
    _launch_link(
        grid, ids, slots, policy.sketch_seeds, policy.sketch, heads, following, estimate,
        n, policy.sketch_width, policy.num_sets, row_begin, row_end, epoch,
        DEPTH=policy.sketch_depth, MIX=mix, BLOCK=BATCH_BLOCK,
    )  # fmt: skip
    _launch_first(
        grid, ids, estimate, heads, following, first, n, policy.num_sets, epoch,
        MIX=mix, BLOCK=BATCH_BLOCK,
    )  # fmt: skip
    outputs = _plan_outputs(n, device)
    block = max(1, min(BATCH_BLOCK, 2048 // (policy.ways * policy.ways)))
    _launch_batch_victims(
        (_cdiv(n, block),), ids, estimate, first, heads, following, policy.tags, policy.counts,
        *_written(outputs), n, policy.num_sets, policy.scratch, epoch,
        WAYS=policy.ways, MIX=mix, BLOCK=block,
    )  # fmt: skip
    slots, tags, counts, admitted, evicted = outputs
    return slots, tags, counts, torch.arange(n, device=device), admitted, evicted
