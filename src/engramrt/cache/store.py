"""``CachedRowStore``: hot rows in device memory in front of a slower tier.

One lookup (the critical path; reads the cache, writes nothing to it):

1. probe + gather (:mod:`.kernel`, or :mod:`.reference`): every owned
   ``(token, column)`` finds its row's set, compares the set's ``ways``
   tags, dequantises a hit straight into ``out`` and reports its slot;
   misses report -1 and are left unwritten;
2. miss path: the missed positions are compacted (the one host
   synchronisation, which the host and disk tiers need anyway to gather),
   their ids deduplicated, and *only those* packed rows read from the
   backing tier (:mod:`.backing`); :func:`engramrt.lookup.lookup_rows`
   dequantises them over the compacted index and they are scattered into
   ``out``. Same bytes as the backing tier's own lookup, which uses the
   same dequantisation;
3. the probe's slots, the missed ids and their packed rows are kept as a
   *pending* record for the next :meth:`CachedRowStore.update`.

When the backing tier's rows can be read by the device in place
(:meth:`~engramrt.lookup.tiers.RowStore.device_rows`: device memory, the
UVA tier, the host tier with GPU reads) and the probe runs the Triton
kernel, step 1 reads each miss from them too and step 2 disappears: a
lookup is one launch with no host synchronisation, and so is its update:
the missed ids are found again from the probe's slots as a batch of the
lookups' fixed shape (:func:`~engramrt.cache.policy.fixed_candidates`), and
the device reads the admitted rows from the backing's rows itself. With the
policy's Triton kernels that update runs in place
(:attr:`CachedRowStore.updates_in_place`): the batch is planned in its own
order with no sort (:meth:`~engramrt.cache.policy.SetAssociativeLfu.plan_batch`)
and one launch writes every admitted row, tag and counter
(:func:`~engramrt.cache.kernel.install_rows_triton`), the same slots as the
three phases below give; no lookup runs meanwhile (see the ordering argument).

:meth:`CachedRowStore.update` (off the critical path; can run on a side
stream) consumes the pending records: it counts the accesses (sketch and
per-slot counters), picks which missed rows to admit and where
(:class:`engramrt.cache.policy.SetAssociativeLfu`), and installs them in
three phases, each one pass over the admitted slots, in stream order:

- **invalidate**: the victims' tags become EMPTY;
- **write**: the new packed rows are copied into the victims' slots;
- **publish**: the victims' tags become the new row ids.

Ordering argument. A lookup reads a slot's bytes only when the slot's tag
equals the requested id. Between any two phases every tag is either EMPTY
or names a slot whose bytes are that row's (before *invalidate*: old tag,
old bytes; after it and during *write*: EMPTY, bytes in flux, never read;
after *publish*: new tag, new bytes, because *write* completed before
*publish* started on the same stream). So a lookup ordered anywhere
between phases sees the old row, a miss, or the new row, never a torn one.
A lookup must not overlap a phase *while it runs*: on a GPU, ``update``
on a side stream first waits for everything queued on the compute stream
(the lookups whose records it consumes), and the next ``lookup`` of this
cache waits on the update's completion event, so updates overlap the
model's other work (attention, MLP, other layers' lookups), not this
cache's probes. Tags, bytes and counters change nowhere else, except
:meth:`~CachedRowStore.write_rows` (invalidates first) and
:meth:`~CachedRowStore.warm_up` (the same three phases).

A frozen cache (``frozen=True``) is a static set of hot rows: filled off the serving
path (:meth:`CachedRowStore.warm_up` over a corpus profile, or
:meth:`~CachedRowStore.write_rows`), it admits nothing while serving. Its lookups leave
no record for an update (:attr:`~CachedRowStore.has_update` is False, so a runtime
queues no update job behind them), and when the probe reads its misses a lookup is one
launch with no host synchronisation (:attr:`~CachedRowStore.host_sync` False): a
scheduler runs it where it runs GPU-memory tables, and a whole-step CUDA graph can hold
it. Its hit and miss counts cover the lookups run eagerly, not graph replays.

Rows of any :class:`~engramrt.family.RowFormat` (the backing's): slots hold
``row_bytes`` opaque bytes and every fill (update, warm-up) copies them whole.
The probe above dequantises fp8 rows; rows of another format (bf16) are read
through :meth:`CachedRowStore.gather_packed`, where a hit copies its slot's
bytes and a miss the backing's, and the misses feed the same updates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engramrt import memory
from engramrt._backend import BACKENDS, resolve_backend
from engramrt._device import capturing
from engramrt.cache.backing import packed_row_reader
from engramrt.cache.policy import (
    EMPTY_TAG,
    MISS,
    AdmissionPlan,
    SetAssociativeLfu,
    check_sketch,
    fixed_candidates,
    probe_slots,
)
from engramrt.cache.reference import probe_gather_reference
from engramrt.cache.stats import CacheStats
from engramrt.errors import CapacityError, ValidationError
from engramrt.lookup import check_row_ids_in_shard, lookup_rows
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelConfig, check_kernel_config
from engramrt.lookup.tiers import RowStore, TierOptions
from engramrt.packed import word_dtype_for

if TYPE_CHECKING:
    from engramrt.config import EngramConfig

__all__ = ["PHASES", "CacheUpdate", "CachedRowStore", "cached_stores"]

FOLD_BATCH = 32
"""Lookups whose hit and miss counts are folded together (those an update consumed,
and those dropped past ``max_pending`` by a cache nobody updates): folding one at a
time costs more launches per lookup than the probe itself
(BENCHMARKS.md#the-hot-row-cache-on-the-h200)."""

PHASES: tuple[str, ...] = ("invalidate", "write", "publish")
"""The phases of installing rows, in the only order :meth:`CachedRowStore.update` uses."""


@dataclass
class _Pending:
    """What one lookup leaves for the next update (all on the cache's device)."""

    row_ids: torch.Tensor  # [T * C] as looked up
    slots: torch.Tensor  # [T * C] int64: slot, MISS or NOT_OWNED
    miss_ids: torch.Tensor | None  # [U] int64, distinct, sorted (None: misses read in the probe)
    miss_rows: torch.Tensor | None  # [U, row_bytes] uint8, stored rows of miss_ids
    num_cols: int  # C, to count hits and misses per column (1 for gather_packed)
    counted: bool = False  # folded into the hit and miss counters yet

    def tensors(self) -> tuple[torch.Tensor, ...]:
        kept = (self.row_ids, self.slots, self.miss_ids, self.miss_rows)
        return tuple(t for t in kept if t is not None)


@dataclass
class CacheUpdate:
    """One update, planned and not yet applied.

    Attributes:
        plan: victims, new tags and counters (see :class:`AdmissionPlan`).
        rows: ``[U, row_bytes]`` uint8, the packed row of each plan entry.
    """

    plan: AdmissionPlan
    rows: torch.Tensor


class CachedRowStore(RowStore):
    """A set-associative, frequency-managed cache of stored rows in front of ``backing``.

    Serves the :class:`RowStore` contract (``[T, C]`` row ids -> ``[T, C, E]``
    bf16, bit for bit what ``backing.lookup`` returns) for the same rows and
    columns as ``backing``, and :meth:`gather_packed` (the stored bytes, bit for
    bit the backing's) in the backing's :attr:`row_format`, whichever it is.

    Args:
        backing: the tier holding every row (device, uva, host or disk, or
            any store with ``gather_packed``).
        capacity_bytes: bytes of packed rows to cache; rounded down to
            whole sets: ``num_sets = capacity_bytes // row_bytes // ways``.
            Tags, counters and the sketch come on top (12 B per slot plus
            ``4 * sketch_depth * sketch_width``).
        ways: slots per set, a power of two in 1..64.
        n_heads: hash heads per n-gram order (8 for V4.1), to report
            statistics per order.
        layer_id: the Engram layer served (a label for statistics).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the probe and
            the miss dequantisation.
        validate: check every batch's shapes, dtypes and devices on the host
            (never synchronises); default the backing's setting.
        check_ids: check every batch's owned ids (synchronises); default the
            backing's setting. Out-of-range ids that miss are caught anyway
            on the miss path, whose ids come to the host; a probe that reads
            misses itself (:attr:`probe_reads_misses`) checks them only with
            ``check_ids``, as the device and UVA tiers do, and otherwise
            reads them as rows of zeros (never admitted).
        sketch_width, sketch_depth, decay_period: policy settings, see
            :class:`SetAssociativeLfu`.
        max_pending: lookups remembered for the next update; older ones are
            dropped (they only inform admission).
        kernel: the probe's and the miss lookup's kernel settings (see
            :class:`~engramrt.lookup.settings.LookupKernelConfig`).
        read_misses: let the probe read misses from the backing's rows
            (:attr:`probe_reads_misses`). None (default): when the backing
            offers rows the device reads in place and the probe runs the
            Triton kernel; False: always the miss path; True: required.
        policy_backend: how an update counts and plans
            (:class:`~engramrt.cache.policy.SetAssociativeLfu`'s ``backend``):
            None (default) follows ``backend``; ``"reference"`` runs the
            policy's torch definition (about 110 small launches per update
            on a GPU instead of a few: the same tags, counters and rows).
        frozen: a static cache (see the module doc): lookups admit nothing and
            keep nothing for :meth:`update`; fill it with :meth:`warm_up` or
            :meth:`write_rows` before serving.

    Raises:
        CapacityError: ``capacity_bytes`` below one set, or not enough memory.
        ValidationError: a bad argument.
    """

    tier = "cached"
    _update_every = 1

    def __init__(
        self,
        backing: RowStore,
        capacity_bytes: int,
        ways: int = 8,
        *,
        n_heads: int = 8,
        layer_id: int | None = None,
        backend: str = "auto",
        validate: bool | None = None,
        check_ids: bool | None = None,
        sketch_width: int | None = None,
        sketch_depth: int = 4,
        decay_period: int | None = None,
        max_pending: int = 4,
        kernel: LookupKernelConfig = DEFAULT_KERNEL,
        read_misses: bool | None = None,
        policy_backend: str | None = None,
        frozen: bool = False,
    ) -> None:
        if not isinstance(backing, RowStore):
            raise ValidationError(
                f"backing is {type(backing).__name__}; expected a RowStore (see make_store)"
            )
        if backing.has_update:
            raise ValidationError(
                f"backing is a {type(backing).__name__}, which has work after each lookup (a "
                f"cache); expected the tier it caches"
            )
        super().__init__(
            backing.num_rows,
            backing.E,
            TierOptions(
                validate=backing.validate if validate is None else validate,
                check_ids=backing.check_ids if check_ids is None else check_ids,
            ),
            device=backing.device,
            row_begin=backing.row_begin,
            col_begin=backing.col_begin,
            col_end=backing.col_end,
            row_format=backing.row_format,
        )
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ValidationError(
                f"capacity_bytes = {capacity_bytes!r}; expected an int number of bytes"
            )
        if isinstance(ways, bool) or not isinstance(ways, int) or ways < 1 or ways & (ways - 1):
            raise ValidationError(f"ways = {ways!r}; expected a power of two in 1..64")
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValidationError(f"n_heads = {n_heads!r}; expected a positive int")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValidationError(f"max_pending = {max_pending!r}; expected >= 1")
        if not isinstance(frozen, bool):
            raise ValidationError(f"frozen = {frozen!r}; expected a bool")
        self.frozen = frozen
        resolve_backend(backend, self.device)  # an unknown backend fails here, not mid-step
        if policy_backend is not None and policy_backend not in BACKENDS:
            raise ValidationError(
                f"policy_backend = {policy_backend!r}; expected None (the cache's backend) or "
                f"one of {', '.join(BACKENDS)}"
            )
        num_sets = max(capacity_bytes, 0) // self.row_bytes // ways
        if num_sets < 1:
            raise CapacityError(
                f"capacity_bytes = {capacity_bytes} holds {max(capacity_bytes, 0) // self.row_bytes} "
                f"rows of {self.row_bytes} B; expected at least one set of ways = {ways} rows "
                f"({ways * self.row_bytes} bytes)"
            )
        self.backing = backing
        self.n_heads = n_heads
        self.layer_id = layer_id
        self.backend = backend
        self.max_pending = max_pending
        self.kernel = check_kernel_config(kernel)
        self._read_packed = packed_row_reader(backing)
        self._read_misses = read_misses
        self._bind_miss_source()
        if read_misses and self._miss_source is None:
            raise ValidationError(
                f"read_misses=True with backing tier={backing.tier!r} and backend={backend!r}; "
                f"expected the Triton probe over a backing whose rows the device reads in "
                f"place (device, uva, or host with gpu_reads)"
            )
        # Sized before anything is allocated: the policy's tags, counters and sketch
        # are as large as the cache can make them (capacity_bytes=2**62 would fail
        # inside torch's allocator otherwise).
        if ways > 64:
            raise ValidationError(f"ways = {ways!r}; expected a power of two in 1..64")
        num_slots = num_sets * ways
        sketch_width, sketch_depth = check_sketch(num_slots, sketch_width, sketch_depth)
        slots = num_slots + 1  # + the scratch slot
        needed = slots * (self.row_bytes + 12) + 4 * sketch_depth * sketch_width
        what = (
            f"CachedRowStore ({num_slots} slots = {num_sets} sets x {ways} ways of "
            f"{self.row_bytes} B, plus index, and a {sketch_depth} x {sketch_width} sketch)"
        )
        if self.device.type == "cuda":
            memory.require(what, needed, memory.device_free_bytes(self.device), str(self.device))
        else:
            memory.require(what, needed, memory.host_available_bytes(), "host memory")
        self.policy = SetAssociativeLfu(
            num_sets,
            ways,
            self.device,
            sketch_width=sketch_width,
            sketch_depth=sketch_depth,
            decay_period=decay_period,
            backend=backend if policy_backend is None else policy_backend,
        )
        self.cache_rows = torch.zeros(
            (slots, self.row_bytes), dtype=torch.uint8, device=self.device
        )
        self._pending: list[_Pending] = []
        self._update_done: torch.cuda.Event | None = None
        self.reset_stats()

    # -- capabilities --------------------------------------------------------

    @property
    def has_update(self) -> bool:  # type: ignore[override]  # a class attribute elsewhere
        """Whether :meth:`update` has work after a lookup: False for a frozen cache."""
        return not self.frozen

    @property
    def host_sync(self) -> bool:  # type: ignore[override]  # a class attribute elsewhere
        """Whether a lookup or its update makes the host wait for the device: planning an
        admission reads the missed ids on the host, and the miss path gathers them there.
        False only for a frozen cache whose probe reads its misses (one launch)."""
        return not (self.frozen and self._miss_source is not None)

    # -- geometry ----------------------------------------------------------

    @property
    def num_sets(self) -> int:
        return self.policy.num_sets

    @property
    def ways(self) -> int:
        return self.policy.ways

    @property
    def num_slots(self) -> int:
        """Rows the cache holds (``num_sets * ways``)."""
        return self.policy.num_slots

    @property
    def update_every(self) -> int:
        """Lookups :meth:`update` waits for before it plans and installs (default 1): fewer,
        larger updates, each over the misses of that many lookups. Settable between
        steps, to an int in ``[1, max_pending]``."""
        return self._update_every

    @update_every.setter
    def update_every(self, count: int) -> None:
        if (
            isinstance(count, bool)
            or not isinstance(count, int)
            or not 1 <= count <= self.max_pending
        ):
            raise ValidationError(
                f"update_every = {count!r}; expected an int in [1, max_pending = "
                f"{self.max_pending}]"
            )
        self._update_every = count

    def _bind_miss_source(self) -> None:
        """The backing's rows as the probe kernel can read them (misses read in the
        probe), or None (the miss path gathers them)."""
        self._miss_source = None
        self._miss_words = None  # the same rows as words, for the update's row reads
        if self._read_misses is not False:
            triton = resolve_backend(self.backend, self.device) == "triton"
            self._miss_source = self.backing.device_rows() if triton else None
            if self._miss_source is not None:  # a device tensor or mapped host rows
                self._miss_words = self._miss_source.view(word_dtype_for(self.row_bytes))

    def use_gpu_reads(self, on: bool) -> bool:
        """Switch the backing's GPU reads of host memory (see
        :meth:`engramrt.source.RowSource.use_gpu_reads`), and with them whether the probe
        reads the misses (a read of host memory beside the model) or the miss path
        gathers them on the CPU; returns whether the cache has that choice (not with
        ``read_misses=True``, nor over a backing with one way: GPU memory, UVA, disk).
        Lookups not yet consumed by an update are counted and dropped: an update plans
        from one kind of record."""
        if self._read_misses or not self.backing.use_gpu_reads(on):
            return False
        self._wait_for_update()
        self._queue_for_counting(self._pending)
        self._pending.clear()
        self._bind_miss_source()
        return True

    @property
    def probe_reads_misses(self) -> bool:
        """Whether a lookup's probe reads its misses from the backing's rows itself (one
        launch, no host synchronisation; see the module doc)."""
        return self._miss_source is not None

    @property
    def capacity_bytes(self) -> int:
        """Bytes of packed rows the cache holds after rounding (``num_slots * row_bytes``)."""
        return self.num_slots * self.row_bytes

    def __repr__(self) -> str:
        return (
            f"CachedRowStore(slots={self.num_slots} ({self.num_sets} sets x {self.ways} ways, "
            f"{self.capacity_bytes} bytes), backing={self.backing!r})"
        )

    # -- statistics ----------------------------------------------------------

    def reset_stats(self) -> None:
        """Zero the hit, miss, fetch and admission counts."""
        for record in getattr(self, "_pending", ()):
            record.counted = True  # looked up before the reset
        self._unfolded: list[tuple[torch.Tensor, int, bool]] = []
        self._hits = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._misses = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._rows_fetched = 0
        self._rows_read_on_device = torch.zeros((), dtype=torch.int64, device=self.device)
        self._admitted = torch.zeros((), dtype=torch.int64, device=self.device)
        self._evicted = torch.zeros((), dtype=torch.int64, device=self.device)

    def stats(self) -> CacheStats:
        """Counts so far (synchronises with the device)."""
        self._wait_for_update()
        self._count(self._pending)
        return CacheStats(
            layer_id=self.layer_id,
            n_heads=self.n_heads,
            row_bytes=self.row_bytes,
            hits=tuple(int(v) for v in self._hits.tolist()),
            misses=tuple(int(v) for v in self._misses.tolist()),
            rows_fetched=self._rows_fetched + int(self._rows_read_on_device),
            admitted=int(self._admitted),
            evicted=int(self._evicted),
        )

    def _count(self, records: Iterable[_Pending]) -> None:
        """Fold records into the hit and miss counters (off the lookup's path)."""
        self._queue_for_counting(records)
        self._fold()

    def _count_in_batches(self, records: Iterable[_Pending]) -> None:
        """Queue records for the counters, folding them once :data:`FOLD_BATCH` are queued
        (bounded memory, launches amortised; :meth:`stats` folds the rest)."""
        self._queue_for_counting(records)
        if len(self._unfolded) >= FOLD_BATCH:
            self._fold()

    def _queue_for_counting(self, records: Iterable[_Pending]) -> None:
        for record in records:
            if not record.counted:
                record.counted = True
                self._unfolded.append((record.slots, record.num_cols, record.miss_ids is None))

    def _fold(self) -> None:
        """Add the queued records' hits and misses per column, a few launches per kind of
        record however many there are."""
        queued, self._unfolded = self._unfolded, []
        for num_cols, read_in_probe in {(c, r) for _, c, r in queued}:
            slots = torch.cat(
                [s.view(-1, c) for s, c, r in queued if (c, r) == (num_cols, read_in_probe)]
            )
            if self._hits.shape[0] < num_cols:
                grow = num_cols - self._hits.shape[0]
                self._hits = torch.cat([self._hits, self._hits.new_zeros(grow)])
                self._misses = torch.cat([self._misses, self._misses.new_zeros(grow)])
            self._hits[:num_cols] += (slots >= 0).sum(dim=0)
            missed = (slots == MISS).sum(dim=0)
            self._misses[:num_cols] += missed
            if read_in_probe:  # the probe read every missed lookup's row
                self._rows_read_on_device += missed.sum()

    # -- lookup ------------------------------------------------------------

    def _wait_for_update(self) -> None:
        """Order this stream after the last side-stream update (see the module doc)."""
        if self._update_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._update_done)
            self._update_done = None

    def _probe(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if resolve_backend(self.backend, self.device) == "reference":
            slots.copy_(
                probe_gather_reference(
                    row_ids,
                    self.policy.tags,
                    self.cache_rows,
                    out,
                    num_sets=self.num_sets,
                    ways=self.ways,
                    col_begin=self.col_begin,
                    col_end=col_end,
                )
            )
            return
        from engramrt.cache.kernel import probe_gather_triton  # imports Triton

        probe_gather_triton(
            row_ids,
            self.policy.tags,
            self.cache_rows,
            out,
            slots,
            num_sets=self.num_sets,
            ways=self.ways,
            col_begin=self.col_begin,
            col_end=col_end,
            kernel=self.kernel,
            backing=self._miss_source,
            backing_row_begin=self.row_begin,
        )

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        row_ids = row_ids.to(self.device, non_blocking=True)
        self._wait_for_update()
        num_tokens, num_cols = row_ids.shape
        if out is None:
            out = torch.empty(
                (num_tokens, num_cols, self.E), dtype=torch.bfloat16, device=self.device
            )
        slots = torch.empty((num_tokens, num_cols), dtype=torch.int64, device=self.device)
        if num_tokens * num_cols == 0:
            return out
        self._probe(row_ids, col_end, out, slots)

        flat_ids = row_ids.reshape(-1)
        if self._miss_source is not None:  # the probe read the misses: nothing to sync on
            self._remember(_Pending(flat_ids, slots.view(-1), None, None, num_cols))
            return out
        miss_pos = torch.nonzero(slots.view(-1) == MISS).squeeze(1)  # the host sync
        if miss_pos.shape[0] > 0:
            miss_ids, inverse = torch.unique(
                flat_ids.index_select(0, miss_pos).to(torch.int64), sorted=True, return_inverse=True
            )
            # One trip to the host serves the range check (sorted: the ends
            # bound them all) and a host tier's gather.
            miss_host = miss_ids.cpu()
            lowest, highest = int(miss_host[0]), int(miss_host[-1])
            if lowest < self.row_begin or highest >= self.row_end:
                check_row_ids_in_shard(
                    row_ids, self.col_begin, col_end, self.row_begin, self.row_end
                )
            miss_rows = self._read_packed(miss_host - self.row_begin)  # [U, row_bytes]
            rows = lookup_rows(
                inverse.view(-1, 1),
                miss_rows,
                backend=self.backend,
                validate=False,  # internal: the ids are the cache's, checked above
                kernel=self.kernel,
            )  # [M, 1, E]
            out.view(-1, self.E).index_copy_(0, miss_pos, rows.view(-1, self.E))
        else:
            miss_ids = torch.empty(0, dtype=torch.int64, device=self.device)
            miss_rows = torch.empty((0, self.row_bytes), dtype=torch.uint8, device=self.device)
        self._rows_fetched += miss_ids.shape[0]
        self._remember(_Pending(flat_ids, slots.view(-1), miss_ids, miss_rows, num_cols))
        return out

    def _remember(self, record: _Pending) -> None:
        if self.frozen:  # nothing to admit: the record only counts hits and misses
            if not capturing(self.device):  # a graph's replays run no Python to count them
                self._count_in_batches([record])
            return
        self._pending.append(record)
        if len(self._pending) > self.max_pending:  # forgotten, but still counted
            self._count_in_batches(self._pending[: -self.max_pending])
            del self._pending[: -self.max_pending]

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[U, row_bytes]`` uint8 of local ids ``[U]`` int64 (each in
        ``[0, num_rows)``), read through the cache: a hit copies its slot's bytes, a miss
        the backing's, so the rows are bit for bit ``backing.gather_packed``'s in any
        :attr:`row_format` (the way to read bf16 rows, which :meth:`lookup` does not
        dequantise). The probe is remembered for the next :meth:`update` as a lookup's
        is (hits and misses counted in column 0 of :meth:`stats`).

        Misses: when the probe reads them (:attr:`probe_reads_misses`) the device copies
        them out of the backing's rows, with no host synchronisation; otherwise their
        positions come to the host and only the distinct missed rows are read from the
        backing (:meth:`RowStore.gather_packed`).
        """
        self._wait_for_update()
        ids = local_ids.to(self.device, torch.int64) + self.row_begin  # [U] global
        slots = probe_slots(ids, self.policy.tags, self.num_sets, self.ways)  # [U]
        hit = slots >= 0
        # A miss copies the scratch slot here and its own row below.
        rows = self.cache_rows.index_select(0, torch.where(hit, slots, self.num_slots))
        if ids.shape[0] == 0:
            return rows
        if self._miss_words is not None:
            from engramrt.lookup.kernel import gather_packed_rows_triton  # imports Triton

            missed = torch.empty_like(rows)
            # A hit asks for EMPTY_TAG (-1, outside every table): a row of zeros, read
            # from nowhere.
            gather_packed_rows_triton(
                torch.where(hit, EMPTY_TAG, ids),
                self._miss_words,
                missed,
                row_begin=self.row_begin,
                num_rows=self.num_rows,
            )
            self._remember(_Pending(ids, slots, None, None, 1))
            return torch.where(hit[:, None], rows, missed)
        miss_pos = torch.nonzero(~hit).squeeze(1)  # the host sync
        miss_ids, inverse = torch.unique(
            ids.index_select(0, miss_pos), sorted=True, return_inverse=True
        )
        if miss_ids.shape[0]:
            miss_rows = self._read_packed(miss_ids - self.row_begin)  # [M, row_bytes]
            rows.index_copy_(0, miss_pos, miss_rows.index_select(0, inverse))
        else:
            miss_rows = rows.new_empty((0, self.row_bytes))
        self._rows_fetched += miss_ids.shape[0]
        self._remember(_Pending(ids, slots, miss_ids, miss_rows, 1))
        return rows

    # -- update ------------------------------------------------------------

    def plan_update(self) -> CacheUpdate | None:
        """Consume the pending lookups: count their accesses and choose what to admit.

        Changes the counters and the sketch (metadata no lookup reads), not
        the tags or rows. None when nothing is pending. No host
        synchronisation when the probes read their misses themselves (the
        missed ids are found again from the slots, and the device reads only
        the admitted rows from the backing), or when one lookup is pending
        (several need a ``torch.unique`` over their misses).
        """
        pending = self._consume_pending()
        if not pending:
            return None
        if pending[0].miss_ids is None:  # every record of this cache is alike
            return self._plan_from_slots(pending)
        if len(pending) == 1:
            candidates, rows = pending[0].miss_ids, pending[0].miss_rows
            assert candidates is not None and rows is not None
        else:
            all_ids = torch.cat([p.miss_ids for p in pending if p.miss_ids is not None])
            all_rows = torch.cat([p.miss_rows for p in pending if p.miss_rows is not None])
            candidates, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
            positions = torch.arange(all_ids.shape[0], device=self.device)
            first = torch.full_like(candidates, all_ids.shape[0]).scatter_reduce_(
                0, inverse, positions, "amin"
            )
            rows = all_rows.index_select(0, first)
        plan = self._plan(candidates)
        return CacheUpdate(plan, rows.index_select(0, plan.order))

    def _consume_pending(self) -> list[_Pending]:
        """Take the pending lookups (after the last update) and count them: their hits and
        misses queued for the statistics, their accesses recorded by the policy."""
        self._wait_for_update()
        pending, self._pending = self._pending, []
        # Hits and misses are folded in batches (stats() folds the rest): per update,
        # that sum costs more launches than the policy's kernels.
        self._count_in_batches(pending)
        for record in pending:
            self.policy.record(record.row_ids, record.slots)
        return pending

    @staticmethod
    def _looked_up(pending: list[_Pending]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending lookups' row ids and probe slots, ``[n]`` each, in lookup order."""
        if len(pending) == 1:
            return pending[0].row_ids.reshape(-1), pending[0].slots.reshape(-1)
        ids = torch.cat([p.row_ids.reshape(-1) for p in pending])
        return ids, torch.cat([p.slots.reshape(-1) for p in pending])

    def _plan(self, candidates: torch.Tensor, valid: torch.Tensor | None = None) -> AdmissionPlan:
        """The policy's plan for ``candidates``, counted in the admission statistics."""
        plan = self.policy.plan(candidates, valid=valid)
        self._admitted += plan.admitted.sum()
        self._evicted += plan.evicted.sum()
        return plan

    def _plan_from_slots(self, pending: list[_Pending]) -> CacheUpdate:
        """Plan from lookups whose probe read its misses, with no host synchronisation:
        every looked-up position is a candidate, the missed ids sorted and each kept
        once (repeats, hits and ids outside the shard become placeholders the plan
        never admits), and the device reads the admitted rows from the backing's rows
        (the others read as zeros from nowhere), so every shape is the lookups'."""
        ids, slots = self._looked_up(pending)
        ids = ids.to(torch.int64)
        missed = slots == MISS
        # Ids outside the shard read zeros in the probe (unchecked lookups): never admitted.
        missed &= (ids >= self.row_begin) & (ids < self.row_end)
        candidates, valid = fixed_candidates(ids, missed)
        plan = self._plan(candidates, valid)
        # The plan's tags are the admitted ids and EMPTY_TAG (-1, outside every table:
        # a row of zeros) for the rest.
        rows = torch.empty(
            (plan.tags.shape[0], self.row_bytes), dtype=torch.uint8, device=self.device
        )
        from engramrt.lookup.kernel import gather_packed_rows_triton  # imports Triton

        gather_packed_rows_triton(
            plan.tags, self._miss_words, rows, row_begin=self.row_begin, num_rows=self.num_rows
        )
        self._rows_read_on_device += plan.admitted.sum()
        return CacheUpdate(plan, rows)  # rejected entries write zeros to the scratch slot

    def apply_update(self, update: CacheUpdate, phases: Iterable[str] = PHASES) -> None:
        """Install a planned update: ``phases`` in the order given.

        :meth:`update` always passes :data:`PHASES` (invalidate, write,
        publish). Other orders exist for tests that interleave lookups
        between phases, or break the order on purpose to show the check
        catches a torn update.
        """
        self._wait_for_update()
        for phase in phases:
            if phase == "invalidate":
                self.policy.invalidate(update.plan)
            elif phase == "write":
                self.cache_rows.index_copy_(0, update.plan.slots, update.rows)
            elif phase == "publish":
                self.policy.publish(update.plan)
            else:
                raise ValidationError(f"phase = {phase!r}; expected one of {', '.join(PHASES)}")

    def update(self, stream: torch.cuda.Stream | None = None) -> None:
        """Admit the rows the pending lookups missed, if they beat the victims.

        Args:
            stream: a CUDA stream to run on (the runtime's side stream). It
                first waits for the work queued so far on the current
                stream; the next :meth:`lookup` waits for it. None: run in
                order on the current stream (always, on a CPU device).

        Does nothing until :attr:`update_every` lookups are pending.
        """
        if not self._pending or len(self._pending) < self.update_every:
            return
        if stream is None or self.device.type != "cuda":
            self._update_now()
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for record in self._pending:
            for tensor in record.tensors():  # allocated on the compute stream
                tensor.record_stream(stream)
        for slots, _, _ in self._unfolded:  # dropped lookups, counted on the stream too
            slots.record_stream(stream)
        with torch.cuda.stream(stream):
            self._update_now()
        done = torch.cuda.Event()
        done.record(stream)
        self._update_done = done

    @property
    def updates_in_place(self) -> bool:
        """Whether :meth:`update` plans and installs in four launches with no sort (the
        probe reads its misses and the policy runs its Triton kernels:
        :meth:`~engramrt.cache.policy.SetAssociativeLfu.plan_batch` and
        :func:`~engramrt.cache.kernel.install_rows_triton`); otherwise it runs
        :meth:`plan_update` and :meth:`apply_update`. The same tags, counters and
        rows either way (the scratch slot aside)."""
        return self._miss_source is not None and self.policy.uses_kernels

    def _update_now(self) -> None:
        """The update on the current stream: in place when :attr:`updates_in_place`."""
        if not self.updates_in_place:
            update = self.plan_update()
            if update is not None:
                self.apply_update(update)
            return
        pending = self._consume_pending()
        if not pending:
            return
        plan = self.policy.plan_batch(*self._looked_up(pending), self.row_begin, self.row_end)
        from engramrt.cache.kernel import install_rows_triton  # imports Triton

        install_rows_triton(
            plan,
            self._miss_words,
            self.cache_rows,
            self.policy.tags,
            self.policy.counts,
            (self._admitted, self._evicted, self._rows_read_on_device),
            row_begin=self.row_begin,
            num_rows=self.num_rows,
        )

    # -- warm-up and writes --------------------------------------------------

    def warm_up(self, row_id_batches: Iterable[torch.Tensor]) -> int:
        """Fill the cache from a pass over a stream of ``[T, C]`` row-id batches.

        The policy runs on a copy of the tags alone (no row bytes move per
        batch), exactly as lookups followed by updates would; then the rows
        that ended resident are read from the backing tier in one go and
        installed with the three phases. Statistics are not counted.

        Returns:
            The number of rows installed.

        Raises:
            ValidationError: a batch of the wrong shape, or an owned id
                outside the backing's rows.
        """
        self._wait_for_update()
        shadow = self.policy.clone()
        for batch in row_id_batches:
            if not isinstance(batch, torch.Tensor) or batch.dim() != 2:
                found = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch)
                raise ValidationError(f"warm_up batch has shape {found}; expected [T, C] row ids")
            batch = batch.to(self.device)
            col_end = batch.shape[1] if self.col_end is None else min(self.col_end, batch.shape[1])
            check_row_ids_in_shard(batch, self.col_begin, col_end, self.row_begin, self.row_end)
            cols = torch.arange(batch.shape[1], device=self.device)
            owned = ((cols >= self.col_begin) & (cols < col_end)).expand_as(batch)
            shadow.access(batch, owned)
        changed = torch.nonzero(shadow.tags != self.policy.tags).squeeze(1)
        new_tags = shadow.tags[changed]
        installing = new_tags != EMPTY_TAG
        rows = torch.zeros(
            (changed.shape[0], self.row_bytes), dtype=torch.uint8, device=self.device
        )
        installed = int(installing.sum())
        if installed:
            rows[installing] = self._read_packed(new_tags[installing] - self.row_begin)
        none = torch.zeros_like(installing)
        plan = AdmissionPlan(
            slots=changed,
            tags=new_tags,
            counts=shadow.counts[changed],
            order=torch.arange(changed.shape[0], device=self.device),
            admitted=installing,
            evicted=none,
        )
        self.apply_update(CacheUpdate(plan, rows))
        self.policy.adopt_counters(shadow)
        self._pending.clear()
        return installed

    def _write(self, start: int, packed: torch.Tensor) -> None:
        """Write through to the backing tier; cached copies of those rows are dropped."""
        self._wait_for_update()
        self.backing.write_rows(start, packed)
        self.policy.invalidate_rows(
            self.row_begin + start, self.row_begin + start + packed.shape[0]
        )
        self._pending.clear()  # their packed rows may be the old bytes


def cached_stores(
    stores: Sequence[RowStore], config: EngramConfig, capacity_bytes: int
) -> list[CachedRowStore]:
    """A :class:`CachedRowStore` of ``capacity_bytes`` in front of each Engram layer's store
    (``stores[i]`` is layer ``config.layer_ids[i]``), with the config's heads per n-gram
    order and the cache's default settings (build :class:`CachedRowStore` directly for
    others)."""
    return [
        CachedRowStore(
            store, capacity_bytes, n_heads=config.n_heads, layer_id=config.layer_ids[index]
        )
        for index, store in enumerate(stores)
    ]
