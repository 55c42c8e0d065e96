"""The cache's index and its replacement policy, on tags alone (no row bytes).

Index: ``num_sets`` sets of ``ways`` ways. Slot ``s = set * ways + way``
holds one packed row; ``tags[s]`` is the global row id it holds, or
:data:`EMPTY_TAG`. A row id lives only in set ``set_index(row_id)`` =
``mix32(row_id) mod num_sets``, so a probe compares ``ways`` tags. One
extra *scratch* slot (index ``num_slots``) absorbs the writes of rejected
candidates, so an update needs no data-dependent shapes (no host
synchronisation, side-stream friendly).

Policy (W-TinyLFU's admission filter on a set-associative LFU):

- a count-min sketch (``depth`` rows of ``width`` int32 counters) counts
  every access, resident or not: the frequency estimate of a row is the
  minimum of its ``depth`` counters;
- each slot keeps a counter: the estimate of its row when admitted, plus
  one per hit since;
- both are halved every ``decay_period`` accesses (default ten times the
  slots, TinyLFU's window), so the cache forgets old popularity;
- after a lookup, the unique missed rows are *candidates*: within each set
  the candidates sorted by estimate (highest first) meet the ways sorted by
  counter (empty ways first, then lowest); the r-th candidate replaces the
  r-th weakest way when its estimate is strictly higher (empty ways count
  as -1, so they always fill). A row seen once cannot push out a row that
  has been hit.

All of it is plain torch on whatever device holds the tags, and that torch
code defines the policy: the CPU hit-rate study (``bench/cache_hit_study.py``)
runs it. The runtime cache (:class:`engramrt.cache.CachedRowStore`) on a GPU
counts and plans with the Triton kernels of :mod:`engramrt.cache.policy_kernel`
instead (``backend``), which give the same counters and plans bit for bit: an
update then costs a few launches, not about 110.

Hash: ``mix32`` is a 32-bit integer finaliser (two rounds of xor-shift and
multiply by ``0x45D9F3B``) written in int64 so that no product overflows
(``< 2**32 * 2**27``); ids are first folded to 32 bits (``x ^ x >> 32``).
The Triton probe computes the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engramrt._backend import resolve_backend
from engramrt.errors import CapacityError, ValidationError

__all__ = [
    "EMPTY_TAG",
    "MISS",
    "NOT_OWNED",
    "NO_CANDIDATE",
    "SKETCH_SEEDS",
    "Access",
    "AdmissionPlan",
    "SetAssociativeLfu",
    "check_sketch",
    "fixed_candidates",
    "mix32",
    "probe_slots",
    "set_index",
]

EMPTY_TAG = -1
"""Tag of an empty (or invalidated) slot. Row ids are >= 0; a negative id (a bad
input) is a miss by definition, never a match with an empty slot."""

MISS = -1
"""Slot reported for an owned lookup whose row is not cached."""

NOT_OWNED = -2
"""Slot reported for a column the store does not serve (read as zeros)."""

MIX_MULTIPLIER = 0x45D9F3B
SKETCH_SEEDS = (0x2545F491, 0x6C078965, 0x5851F42D, 0x1B873593, 0x3C6EF372, 0x7F4A7C15)
"""Per-row seeds of the count-min sketch (xor-ed into the id before mixing)."""

COUNT_MAX = 1 << 30
"""Bound on every counter: ``decay_period <= MAX_DECAY_PERIOD`` accesses between
halvings keeps a counter below ``2 * MAX_DECAY_PERIOD``, so int32 never overflows
and no clamping pass is needed."""

MAX_DECAY_PERIOD = 1 << 29

EPOCH_LIMIT = 1 << 30
"""Batch plans (:meth:`SetAssociativeLfu.plan_batch` on Triton) before the per-set list
heads are cleared and the epochs start again."""

_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """int64 ids -> well-mixed int64 values in ``[0, 2**32)`` (no overflow)."""
    x = x.to(torch.int64)
    x = (x ^ (x >> 32)) & _MASK32
    x = ((x ^ (x >> 16)) * MIX_MULTIPLIER) & _MASK32
    x = ((x ^ (x >> 16)) * MIX_MULTIPLIER) & _MASK32
    return x ^ (x >> 16)


def set_index(row_ids: torch.Tensor, num_sets: int) -> torch.Tensor:
    """The set each row id lives in: ``mix32(row_id) mod num_sets`` (int64)."""
    return mix32(row_ids) % num_sets


def probe_slots(
    row_ids: torch.Tensor, tags: torch.Tensor, num_sets: int, ways: int
) -> torch.Tensor:
    """Row ids (any shape) -> same-shaped int64 slot holding each, or :data:`MISS`.

    The definition of a probe: ``tags`` is ``[num_sets * ways (+ scratch)]``
    int64 and slot ``set * ways + way`` holds row ``tags[slot]``.
    """
    ids = row_ids.to(device=tags.device, dtype=torch.int64)
    sets = set_index(ids, num_sets).reshape(-1)
    set_tags = tags[: num_sets * ways].view(num_sets, ways).index_select(0, sets)  # [n, ways]
    match = (set_tags == ids.reshape(-1, 1)) & (ids.reshape(-1, 1) >= 0)  # -1 is EMPTY_TAG
    way = torch.arange(ways, device=tags.device)
    found = torch.where(match, way, -1).amax(dim=1)
    return torch.where(found >= 0, sets * ways + found, MISS).view(ids.shape)


class Access(NamedTuple):
    """What :meth:`SetAssociativeLfu.access` saw: ``slots [n]`` and the distinct missed ids."""

    slots: torch.Tensor
    missed: torch.Tensor


@dataclass
class AdmissionPlan:
    """What one update writes, one entry per candidate (all on the cache's device).

    Attributes:
        slots: ``[U]`` int64, the victim slot of an admitted candidate, the
            scratch slot of a rejected one.
        tags: ``[U]`` int64, the candidate's row id if admitted, else ``EMPTY_TAG``.
        counts: ``[U]`` int32, the admitted row's initial counter.
        order: ``[U]`` int64, the candidates' positions in the input they came
            from (the plan is sorted by set; row bytes are gathered through it).
        admitted: ``[U]`` bool.
        evicted: ``[U]`` bool, admitted into a way that held another row.
    """

    slots: torch.Tensor
    tags: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor
    admitted: torch.Tensor
    evicted: torch.Tensor


NO_CANDIDATE = torch.iinfo(torch.int64).max
"""The id of a placeholder candidate (:func:`fixed_candidates`): above every row id."""


def fixed_candidates(
    row_ids: torch.Tensor, missed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of ``row_ids [n]`` where ``missed [n]`` is True, as a batch of the
    same fixed shape: ``(candidates, valid)``, sorted, each missed id once with
    ``valid`` True and every other entry a placeholder (:data:`NO_CANDIDATE`, or a repeat)
    with ``valid`` False. :meth:`SetAssociativeLfu.plan` with ``valid`` admits from it
    exactly what it admits from the distinct ids alone (sorted), with no host
    synchronisation (``torch.unique`` would need one to size its result)."""
    if missed.dtype != torch.bool or missed.shape != row_ids.shape:
        raise ValidationError(
            f"missed is {missed.dtype} {tuple(missed.shape)}; expected bool of row_ids' shape "
            f"{tuple(row_ids.shape)}"
        )
    keys = torch.where(missed, row_ids.to(torch.int64), NO_CANDIDATE)
    candidates, _ = torch.sort(keys)
    valid = candidates != NO_CANDIDATE
    valid[1:] &= candidates[1:] != candidates[:-1]  # the first of equal ids
    return candidates, valid


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_sketch(num_slots: int, sketch_width: Any, sketch_depth: Any) -> tuple[int, int]:
    """The sketch's ``(width, depth)`` for a cache of ``num_slots`` (width None: a power
    of two from ``2**10`` to ``2**24`` near ``num_slots``), or a ValidationError naming the
    bad one. Checked before anything is allocated, so a caller can size the memory first."""
    if sketch_width is None:
        sketch_width = 1 << max(10, min(24, (num_slots - 1).bit_length()))
    if (
        isinstance(sketch_width, bool)
        or not isinstance(sketch_width, int)
        or not _is_power_of_two(sketch_width)
    ):
        raise ValidationError(f"sketch_width = {sketch_width!r}; expected a power of two (int)")
    if (
        isinstance(sketch_depth, bool)
        or not isinstance(sketch_depth, int)
        or not 1 <= sketch_depth <= len(SKETCH_SEEDS)
    ):
        raise ValidationError(
            f"sketch_depth = {sketch_depth!r}; expected an int in 1..{len(SKETCH_SEEDS)}"
        )
    return sketch_width, sketch_depth


class SetAssociativeLfu:
    """Tags, per-slot counters and the frequency sketch of a set-associative cache.

    Args:
        num_sets: sets (>= 1).
        ways: ways per set, a power of two in 1..64 (the Triton probe loads a
            set's tags as one ``tl.arange(0, ways)`` vector).
        device: where the state lives (the compute device).
        sketch_width: counters per sketch row, a power of two; default the
            next power of two >= the slots, clamped to ``[1024, 2**24]``.
        sketch_depth: sketch rows, 1..6.
        decay_period: accesses between halvings; default ``10 * slots``
            (at most ``2**29``).
        backend: ``"reference"`` (default: the plain torch below, which defines
            the policy), ``"triton"`` (:meth:`record` and :meth:`plan` in three
            kernels and a sort instead of about 110 small torch operations: the
            same results, :mod:`engramrt.cache.policy_kernel`) or ``"auto"``
            (Triton on a CUDA device).

    Raises:
        CapacityError: ``num_sets < 1``.
        ValidationError: a bad ``ways``, sketch size or period.
    """

    def __init__(
        self,
        num_sets: int,
        ways: int,
        device: torch.device | str = "cpu",
        *,
        sketch_width: int | None = None,
        sketch_depth: int = 4,
        decay_period: int | None = None,
        backend: str = "reference",
    ) -> None:
        if not isinstance(ways, int) or not _is_power_of_two(ways) or ways > 64:
            raise ValidationError(f"ways = {ways!r}; expected a power of two in 1..64")
        if not isinstance(num_sets, int) or num_sets < 1:
            raise CapacityError(f"num_sets = {num_sets!r}; expected at least 1 set")
        num_slots = num_sets * ways
        sketch_width, sketch_depth = check_sketch(num_slots, sketch_width, sketch_depth)
        if decay_period is None:
            decay_period = min(10 * num_slots, MAX_DECAY_PERIOD)
        if not 1 <= decay_period <= MAX_DECAY_PERIOD:
            raise ValidationError(
                f"decay_period = {decay_period!r}; expected 1..{MAX_DECAY_PERIOD} accesses"
            )
        self.num_sets = num_sets
        self.ways = ways
        self.num_slots = num_slots
        self.scratch = num_slots  # the slot rejected candidates write to
        self.device = torch.device(device)
        self.sketch_width = sketch_width
        self.sketch_depth = sketch_depth
        self.decay_period = decay_period
        self.accesses_since_decay = 0
        self.tags = torch.full((num_slots + 1,), EMPTY_TAG, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros((num_slots + 1,), dtype=torch.int32, device=self.device)
        self.sketch = torch.zeros(
            (sketch_depth, sketch_width), dtype=torch.int32, device=self.device
        )
        self._seed_values = torch.tensor(
            SKETCH_SEEDS[:sketch_depth], dtype=torch.int64, device=self.device
        )
        self._seeds = self._seed_values[:, None]
        self.backend = backend
        self._kernels = resolve_backend(backend, self.device) == "triton"
        # plan_batch's per-set list heads (Triton): allocated at first use, tagged with
        # the epoch of the batch that wrote them so that none needs clearing.
        self._heads: torch.Tensor | None = None
        self._epoch = 0

    @property
    def sketch_seeds(self) -> torch.Tensor:
        """``[sketch_depth]`` int64 seeds of the sketch's rows (:data:`SKETCH_SEEDS`), on
        :attr:`device`."""
        return self._seed_values

    @property
    def uses_kernels(self) -> bool:
        """Whether :meth:`record`, :meth:`plan` and :meth:`plan_batch` run the Triton kernels
        (``backend`` resolved to ``"triton"``) rather than the torch definition."""
        return self._kernels

    @property
    def batch_epoch(self) -> int:
        """The epoch of the latest :meth:`plan_batch` on the Triton backend: the tag its
        per-set list heads carry (0 before any; it starts again at 1 after
        :data:`EPOCH_LIMIT` batches, when the heads are cleared)."""
        return self._epoch

    def clone(self) -> SetAssociativeLfu:
        """An independent copy of the whole state (for a simulation beside the live cache)."""
        other = object.__new__(SetAssociativeLfu)
        other.__dict__.update(self.__dict__)
        other.tags = self.tags.clone()
        other.counts = self.counts.clone()
        other.sketch = self.sketch.clone()
        other._heads = None  # scratch, never shared
        other._epoch = 0
        return other

    def adopt_counters(self, other: SetAssociativeLfu) -> None:
        """Take ``other``'s counters, sketch and decay clock (same geometry)."""
        self.counts.copy_(other.counts)
        self.sketch.copy_(other.sketch)
        self.accesses_since_decay = other.accesses_since_decay

    # -- reading -----------------------------------------------------------

    def probe(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` row ids -> ``[n]`` int64 slot holding each, or :data:`MISS`."""
        return probe_slots(row_ids.reshape(-1), self.tags, self.num_sets, self.ways)

    def estimate(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` row ids -> ``[n]`` int32 count-min frequency estimates."""
        return self.sketch.gather(1, self._sketch_index(row_ids)).amin(dim=0)

    def resident_ids(self) -> torch.Tensor:
        """Row ids held now (sorted), for tests and warm-up (synchronises)."""
        tags = self.tags[: self.num_slots]
        return tags[tags != EMPTY_TAG].sort().values

    # -- counting ----------------------------------------------------------

    def _sketch_index(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``[depth, n]`` int64 counter index of each id in each sketch row."""
        ids = row_ids.reshape(1, -1).to(device=self.device, dtype=torch.int64)
        return mix32(ids ^ self._seeds) & (self.sketch_width - 1)

    def record(self, row_ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Count one batch of accesses: bump the sketch, and the counters of hit slots.

        Args:
            row_ids: ``[n]`` the accessed row ids (any integer dtype).
            slots: ``[n]`` what the probe found: a slot, :data:`MISS` or
                :data:`NOT_OWNED` (not counted at all).

        Halves every counter first when this batch completes a decay period.
        No host synchronisation.
        """
        slots = slots.reshape(-1).to(self.device)
        n = slots.shape[0]
        if n == 0:
            return
        self.accesses_since_decay += n
        if self.accesses_since_decay >= self.decay_period:
            self.decay()
        if self._kernels:
            from engramrt.cache.policy_kernel import record_triton  # imports Triton

            record_triton(self, row_ids.reshape(-1).to(self.device), slots, mix=MIX_MULTIPLIER)
            return
        ones = (slots != NOT_OWNED).to(torch.int32)
        index = self._sketch_index(row_ids)  # [depth, n]
        self.sketch.scatter_add_(1, index, ones.expand(self.sketch_depth, n))
        hit_slots = torch.where(slots >= 0, slots, self.scratch)
        self.counts.index_add_(0, hit_slots, ones)

    def decay(self) -> None:
        """Halve every counter (aging); restarts the decay period."""
        self.sketch.bitwise_right_shift_(1)
        self.counts.bitwise_right_shift_(1)
        self.accesses_since_decay = 0

    # -- replacing ---------------------------------------------------------

    def plan(
        self,
        candidates: torch.Tensor,
        *,
        recheck: bool = True,
        valid: torch.Tensor | None = None,
    ) -> AdmissionPlan:
        """Choose victims for ``[U]`` *distinct* missed row ids (see the module doc).

        With ``recheck``, candidates that are resident already (a miss seen
        before an update that admitted them) are rejected; without it the
        caller promises they are not. ``valid``: ``[U]`` bool, False marks a
        placeholder (any id, repeats allowed) that is never admitted and sorts
        after every real candidate of its set, so a caller can plan over a
        batch of fixed shape; the real candidates are distinct. Reads the
        state, changes nothing; no host synchronisation.
        """
        candidates = candidates.reshape(-1).to(device=self.device, dtype=torch.int64)
        count = candidates.shape[0]
        if count == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            no = torch.empty(0, dtype=torch.bool, device=self.device)
            return AdmissionPlan(empty, empty, empty.to(torch.int32), empty, no, no)
        if valid is not None:
            if valid.dtype != torch.bool or valid.numel() != count:
                raise ValidationError(
                    f"valid is {valid.dtype} {tuple(valid.shape)}; expected {count} bools, one "
                    f"per candidate"
                )
            valid = valid.reshape(-1).to(self.device)
        if self._kernels:
            from engramrt.cache.policy_kernel import plan_triton  # imports Triton

            return AdmissionPlan(
                *plan_triton(
                    self, candidates, recheck, valid, mix=MIX_MULTIPLIER, count_max=COUNT_MAX
                )
            )
        return self._plan_reference(candidates, recheck, valid)

    def _plan_reference(
        self, candidates: torch.Tensor, recheck: bool, valid: torch.Tensor | None
    ) -> AdmissionPlan:
        count = candidates.shape[0]
        estimate = self.estimate(candidates).to(torch.int64)  # [U], >= 0
        if valid is not None:
            estimate = torch.where(valid, estimate, -1)  # below every real candidate
        sets = set_index(candidates, self.num_sets)
        # Sort by set, then by estimate (highest first): 2**31 > any estimate.
        order = torch.argsort(sets * (1 << 31) + (COUNT_MAX - estimate), stable=True)
        sets, estimate, candidates = sets[order], estimate[order], candidates[order]
        rank = torch.arange(count, device=self.device) - torch.searchsorted(sets, sets)
        ways = torch.arange(self.ways, device=self.device)
        set_slots = sets[:, None] * self.ways + ways[None, :]  # [U, ways]
        way_counts = torch.where(
            self.tags[set_slots] == EMPTY_TAG, -1, self.counts[set_slots].to(torch.int64)
        )
        weakest_counts, weakest_ways = torch.sort(way_counts, dim=1, stable=True)
        pick = rank.clamp(max=self.ways - 1)[:, None]
        victim_count = weakest_counts.gather(1, pick).squeeze(1)
        victim = sets * self.ways + weakest_ways.gather(1, pick).squeeze(1)
        admitted = (rank < self.ways) & (estimate > victim_count)
        if valid is not None:
            admitted &= valid[order]
        if recheck:
            admitted &= self.probe(candidates) == MISS
        return AdmissionPlan(
            slots=torch.where(admitted, victim, self.scratch),
            tags=torch.where(admitted, candidates, EMPTY_TAG),
            counts=estimate.to(torch.int32),
            order=order,
            admitted=admitted,
            evicted=admitted & (victim_count >= 0),
        )

    def plan_batch(
        self,
        row_ids: torch.Tensor,
        slots: torch.Tensor,
        row_begin: int = 0,
        row_end: int | None = None,
    ) -> AdmissionPlan:
        """Admission for one batch of looked-up positions, in the batch's order.

        ``row_ids [n]`` and the probe's ``slots [n]`` (:func:`probe_slots`, or
        :data:`MISS` / :data:`NOT_OWNED`): the candidates are the positions that
        missed with an id in ``[row_begin, row_end)``, each distinct id at its first
        such position. The result is :meth:`plan` of those distinct ids (sorted, as
        :func:`fixed_candidates` gives them) with every entry put back at its
        position: entry ``i`` is position ``i``'s (``order`` is ``arange(n)``), and
        every other position is a rejected placeholder (scratch slot, ``EMPTY_TAG``,
        counter -1). Reads the state, changes nothing; no host synchronisation.

        With the Triton backend the candidates of a set find each other through
        per-set lists built with atomics (:mod:`engramrt.cache.policy_kernel`):
        no sort, three launches, the same plan.
        """
        ids = row_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        slots = slots.reshape(-1).to(self.device)
        if slots.shape != ids.shape:
            raise ValidationError(
                f"slots has shape {tuple(slots.shape)}; expected one per row id {tuple(ids.shape)}"
            )
        if ids.shape[0] == 0:
            return self.plan(ids)
        if self._kernels:
            if ids.shape[0] >= 1 << 32:  # the lists hold positions in 32 bits
                raise CapacityError(
                    f"plan_batch of {ids.shape[0]} positions; the Triton backend takes fewer "
                    f"than 2**32 (use backend='reference', or plan smaller batches)"
                )
            from engramrt.cache.policy_kernel import plan_batch_triton  # imports Triton

            if self._heads is None or self._epoch + 1 >= EPOCH_LIMIT:
                self._heads = torch.full(
                    (self.num_sets,), -1, dtype=torch.int64, device=self.device
                )
                self._epoch = 0
            self._epoch += 1
            return AdmissionPlan(
                *plan_batch_triton(
                    self, ids, slots, row_begin, row_end, self._heads, self._epoch,
                    mix=MIX_MULTIPLIER,
                )
            )  # fmt: skip
        missed = (slots == MISS) & (ids >= row_begin)
        if row_end is not None:
            missed &= ids < row_end
        keys = torch.where(missed, ids, NO_CANDIDATE)
        candidates, position = torch.sort(keys, stable=True)  # equal ids: first position first
        valid = candidates != NO_CANDIDATE
        valid[1:] &= candidates[1:] != candidates[:-1]
        plan = self._plan_reference(candidates, True, valid)
        at = position[plan.order]  # each plan entry's position in the batch

        def placed(values: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(values).index_copy_(0, at, values)

        return AdmissionPlan(
            slots=placed(plan.slots),
            tags=placed(plan.tags),
            counts=placed(plan.counts),
            order=torch.arange(ids.shape[0], device=self.device),
            admitted=placed(plan.admitted),
            evicted=placed(plan.evicted),
        )

    def invalidate(self, plan: AdmissionPlan) -> None:
        """Phase 1 of applying a plan: the victims' tags become ``EMPTY_TAG``."""
        self.tags.index_fill_(0, plan.slots, EMPTY_TAG)

    def publish(self, plan: AdmissionPlan) -> None:
        """Phase 3 of applying a plan: the admitted rows' tags and counters appear."""
        self.tags.index_copy_(0, plan.slots, plan.tags)
        self.counts.index_copy_(0, plan.slots, plan.counts)

    def invalidate_rows(self, row_begin: int, row_end: int) -> None:
        """Drop every cached row with id in ``[row_begin, row_end)`` (rows rewritten)."""
        stale = (self.tags >= row_begin) & (self.tags < row_end)
        self.tags.masked_fill_(stale, EMPTY_TAG)
        self.counts.masked_fill_(stale, 0)

    # -- tag-only simulation -------------------------------------------------

    def access(self, row_ids: torch.Tensor, owned: torch.Tensor | None = None) -> Access:
        """One lookup and its update on tags alone (a simulation: no row bytes).

        Probes ``[n]`` row ids against the current tags, records the accesses
        and admits missed rows, exactly as a :class:`CachedRowStore` lookup
        followed by ``update()`` would. Returns the ``[n]`` slots the probe
        found (:data:`MISS` for misses, :data:`NOT_OWNED` where ``owned`` is
        False) and the distinct missed ids (the rows a backing tier would
        have fetched).
        """
        row_ids = row_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        slots = self.probe(row_ids)
        if owned is not None:
            slots = torch.where(owned.reshape(-1).to(self.device), slots, NOT_OWNED)
        self.record(row_ids, slots)
        missed = torch.unique(row_ids[slots == MISS])
        plan = self.plan(missed, recheck=False)  # the probe above saw these tags
        self.invalidate(plan)
        self.publish(plan)
        return Access(slots, missed)
