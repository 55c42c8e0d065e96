"""Host-gather tier: the CPU gathers the needed rows, bulk copies move them.

For tables larger than device memory. One lookup:

1. from :data:`DEDUP_MIN_ROWS` owned ids up (and with ``dedup``, the
   default), they are sorted and deduplicated on the device that holds
   them with ``torch.unique(..., return_inverse=True)`` (real text repeats
   n-grams, and sorted ids read the table front to back); fewer are
   gathered as they come;
2. the ids come to the host (the tier's host synchronisation: the CPU
   cannot gather rows it has not been told about, so this tier is not
   capturable in a CUDA graph); they are made local (``id - row_begin``)
   there;
3. the rows are gathered into a persistent pinned staging buffer in
   pieces of ``chunk_rows`` rows, each by one ``torch.index_select`` that
   runs on torch's intra-op thread pool (``num_threads`` threads), over the
   widest integer view of a row (:func:`~engramrt.packed.word_dtype_for`:
   int64 words for 264-byte fp8 rows and 320-byte bf16 rows); each piece is
   copied to the device on a side stream while the next one is gathered;
4. the lookup kernel, given the unique rows as its table and the inverse
   index as row ids, dequantises them and scatters them back to
   ``[T, C, E]`` (zeros for columns this shard does not own). A batch
   gathered as it comes is pieced by whole tokens instead, and each piece
   is dequantised as soon as its copy lands, beside the next piece's copy.

GPU reads (``gpu_reads``, on by default on a CUDA device): the rows are
also page-locked and mapped for the device (``cudaHostRegister``, as the
UVA tier does), and the GPU reads some of them itself:

- a batch of fewer than :data:`DEDUP_MIN_ROWS` owned ids (decode) skips all
  of the above: the lookup kernel reads its rows straight from host memory,
  with no host synchronisation, from a bounded grid that leaves most of the
  GPU to the model beside it (:data:`HOST_READ_KERNEL`);
- in a larger batch, the GPU can copy the highest ``gpu_share`` of the
  unique rows out of host memory on its own stream while the CPU gathers
  the others (step 3), both feeding step 4 (off by default: see
  :data:`GPU_SHARE`).

GPU reads in flight slow the model running beside them, so
:class:`~engramrt.runtime.EngramRuntime` keeps them for the first Engram
layer only and switches later layers' stores to the CPU's gather
(:meth:`use_gpu_reads`; ``EngramRuntime(gpu_reads=)``).

Why this shape: one multi-threaded ``index_select`` over integer words
gathers faster than Python threads, per-thread pipelines, byte views or
numpy; the stages could overlap, but the deduplication must finish before
the first gather and the dequantisation waits for the last copy, which
bounds a lookup; smaller pieces shorten the last copy but each costs
gather start-up. The measurements, and the designs tried and dropped
(sort-based deduplication, token groups), are in
BENCHMARKS.md#the-host-tier-where-the-time-goes.

Row ids given on the host (a CPU tensor, :attr:`~engramrt.source.RowSource.host_ids`:
hashed there by :meth:`~engramrt.hashing.NgramHasher.hash_on_host`) need no
trip from the device: whatever their number and the ``gpu_reads`` setting,
the CPU gathers them as they come, in pieces (the path of ``dedup=False``), and
the lookup never waits for the device.

Ids outside the shard follow the rule of every tier: refused with
``check_ids``, read as rows of zeros without it. Where the ids come to the
host they are bounded nearly for free (sorted unique ids need only their
first and last checked, a plain batch its minimum and maximum) before the
GPU reads any of them, and only a batch that holds such an id pays for
masking it; the GPU's direct reads of a small batch mask them in the
kernel, as on the device and UVA tiers.

Queued gathers (``gather="queued"``, on a CUDA device): the CPU's gather is queued
on the lookup's stream instead of run by the calling thread. The ids' copy to
pinned memory, the gather (a host function, :mod:`engramrt.lookup.host_function`,
that CUDA runs on its own thread once the ids have landed), the rows' copy back
and the dequantisation are all queued at once, in stream order: nothing waits
for the device, so the store has no :attr:`host_sync`, a scheduler runs it on a
side stream like GPU-memory tables, and a step that uses it can be captured in
one CUDA graph. Every batch is gathered as it comes (no deduplication, which
would need the unique count on the host), into buffers at fixed addresses sized
by the largest batch seen (or ``queued_rows``). The lookups of one store must be
queued on one stream, as a scheduler's side stream does (its buffers are reused
in stream order).

A store is meant to be used from one thread at a time (it owns the
staging buffer).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from engramrt import memory
from engramrt._device import capturing
from engramrt.errors import CapacityError, ValidationError
from engramrt.lookup import lookup_rows
from engramrt.lookup.host_function import HostFunction, host_functions_available
from engramrt.lookup.mapped import MappedHostRows, gather_mapped_rows
from engramrt.lookup.settings import tuned_lookup_config
from engramrt.lookup.tiers.base import KernelRowStore, register_tier
from engramrt.lookup.tiers.options import KernelTierOptions, TierOptions, check_int
from engramrt.packed import word_dtype_for

__all__ = [
    "DEDUP",
    "DEFAULT_CHUNK_ROWS",
    "GATHER",
    "GATHER_MODES",
    "GPU_SHARE",
    "HOST_READ_KERNEL",
    "HostGatherRowStore",
    "HostOptions",
]

DEFAULT_CHUNK_ROWS = 65536
"""Rows per pipelined piece (17 MB at 264 B): 8,192 tokens x 24 columns is
three pieces, so the copy of one overlaps the gather of the next while each
gather is still long enough to keep 16 threads busy. Chosen by measurement:
BENCHMARKS.md#the-host-tier-where-the-time-goes."""

DEDUP_MIN_ROWS = 32768
"""Owned ids below which a lookup skips deduplication (the ``dedup_min_rows``
attribute of a store, read at every lookup; 0 always deduplicates): for a
small batch, sorting and the extra wait cost more than the rows they save.
Chosen by measurement: BENCHMARKS.md#the-host-tier-where-the-time-goes."""

ROWS_PER_GATHER_THREAD = 8192
"""With ``num_threads=None`` the gather uses one intra-op thread per this many
unique rows (at most the CPUs this process may use): alone, a lookup is
faster on more threads, but in a serving loop the gather runs beside the
model and competes with it, so decode batches get one thread and prefill
chunks many. Chosen by measurement:
BENCHMARKS.md#what-keeping-the-tables-off-the-gpu-costs (runs B, C)."""

ROWS_PER_WAITED_GATHER_THREAD = 1536
"""With ``num_threads=None`` and :meth:`HostGatherRowStore.use_waited_gathers` on (a
lookup deferred to its layer, gathered by the thread that waits for its rows), the gather
uses one intra-op thread per this many rows, at most the CPUs this process may use: the
waiting thread does nothing else meanwhile, and one thread left the step waiting for its
first Engram layer. A decode-256 layer's 6,144 rows take 4 threads: in the prototype and
in the runtime's step alike, 4 threads cost the step less than 16 (an ``index_select``
of a decode layer's rows splits into a few pieces, and threads beyond them only wait
beside the launching thread). Chosen by measurement:
BENCHMARKS.md#deferred-lookups-on-4-and-16-threads-and-where-the-layers-time-goes-2026-12-07-afternoon,
``bench/host_inline_reads.py``."""

HOST_READ_KERNEL = tuned_lookup_config("host")
"""The lookup kernel's settings for the host tier's GPU reads of a small batch, from
the default ``lookup_rows`` file (a store on a GPU with a file of its own takes
that file's entry). Its programs mostly wait on the bus, and while they wait
they hold multiprocessors a model running beside them would use: a bounded
grid, each program serving its tiles in turn, reads as fast alone and takes
less from the model. Chosen by measurement:
BENCHMARKS.md#what-keeping-the-tables-off-the-gpu-costs (run E); the bench's
``lookup/host/T=256`` case times
:data:`engramrt.bench.cases_lookup.DECODE_READ_SWEEP` beside it."""

GPU_SHARE = 0.0
"""Default share of a deduplicated batch's unique rows that the GPU reads from
host memory itself (the highest ids) while the CPU gathers the rest. Off: the
GPU's reads of scattered rows share the link and the host memory with the
CPU's gather and copies, and gained nothing on the H200 host. A machine with
slower CPUs may differ: the lookup bench times other shares beside the
default. Chosen by measurement: BENCHMARKS.md#the-host-tier-where-the-time-goes."""

DEDUP = True
"""Default of :class:`HostOptions` ``dedup``: large batches are deduplicated on the
device before the CPU gathers them. Chosen by measurement:
BENCHMARKS.md#the-host-tier-where-the-time-goes."""


GATHER_MODES = ("thread", "queued")
"""How the CPU's gathers are driven (:class:`HostOptions` ``gather``): ``"thread"``, by
the thread that calls the lookup once it has waited for the ids; ``"queued"``, by a
host function queued on the lookup's stream (see the module doc)."""

GATHER = "thread"
"""Default of :class:`HostOptions` ``gather``."""


def _word_view(rows: torch.Tensor) -> torch.Tensor:
    """``rows [N, B]`` uint8 viewed as the widest integer words that divide B."""
    return rows.view(word_dtype_for(rows.shape[1]))


def _cpu_count() -> int:
    """CPUs this process may run on (torch's default thread count may be lower), shared
    with the other processes of its node when a launcher says how many there are
    (``LOCAL_WORLD_SIZE``, set by torchrun): oversubscribed gather threads spin
    against each other."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        processes = 1
    return max(1, cpus // processes)


@contextlib.contextmanager
def _intra_op_threads(count: int | None) -> Iterator[None]:
    """Run with ``count`` torch intra-op threads (None: leave torch's setting)."""
    if count is None or count == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class HostOptions(KernelTierOptions):
    """Settings of tier ``"host"``.

    Attributes:
        chunk_rows: rows per pipelined piece (gather of one piece overlaps
            the copy of the previous); an int >= 1.
        num_threads: torch intra-op threads for the gather; None picks one
            per :data:`ROWS_PER_GATHER_THREAD` unique rows (per
            :data:`ROWS_PER_WAITED_GATHER_THREAD` rows for a gather on the thread
            that waits for them: ``use_waited_gathers``), at most the number of
            CPUs this process may use.
        gpu_reads: page-lock the rows and map them for the device
            (``cudaHostRegister``) so that the GPU reads rows itself: whole
            batches below ``dedup_min_rows`` owned ids (the lookup kernel
            over host memory, no host synchronisation) and ``gpu_share`` of
            a larger batch's unique rows beside the CPU's gather. None
            (default): on for a CUDA device with the Triton backend, falling
            back to CPU gathers with a warning when the registration fails;
            True: required (a failure raises).
        gpu_share: the fraction of a deduplicated batch's unique rows the
            GPU reads (see :data:`GPU_SHARE`); 0 leaves them all to the CPU.
        dedup: whether a batch of :data:`DEDUP_MIN_ROWS` owned ids or more is
            sorted and deduplicated on the device before the CPU gathers it
            (fewer rows to gather and copy where ids repeat, as n-grams of text
            do); False gathers every batch as it comes, piece by piece, each
            piece dequantised as soon as it lands (no wait for the sort, and
            the dequantisation overlaps the copies): see :data:`DEDUP`.
        backend, kernel: see :class:`~engramrt.lookup.tiers.options.KernelTierOptions`
            (``backend`` for the final dequantise-and-scatter; ``kernel`` for
            the GPU's reads of a small batch, default :data:`HOST_READ_KERNEL`,
            a bounded grid).
        gather: ``"thread"`` or ``"queued"`` (see :data:`GATHER_MODES` and the
            module doc); ``"queued"`` needs a CUDA device and its driver, and
            elsewhere gathers as ``"thread"`` does.
        queued_rows: rows the queued gather's fixed buffers hold from the start
            (None: sized by the first batch and grown, outside a CUDA graph's
            capture, by a larger one).
        validate, check_ids: see :class:`~engramrt.lookup.tiers.options.TierOptions`.
    """

    tier = "host"
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    num_threads: int | None = None
    gpu_reads: bool | None = None
    gpu_share: float = GPU_SHARE
    dedup: bool = DEDUP
    gather: str = GATHER
    queued_rows: int | None = None

    def _check(self) -> None:
        super()._check()
        check_int(self, "chunk_rows", 1)
        check_int(self, "num_threads", 1, optional=True)
        if self.gpu_reads is not None and not isinstance(self.gpu_reads, bool):
            raise self.error("gpu_reads", "None, True or False")
        if isinstance(self.gpu_share, bool) or not (
            isinstance(self.gpu_share, (int, float)) and 0.0 <= self.gpu_share <= 1.0
        ):
            raise self.error("gpu_share", "a fraction in [0, 1]")
        if not isinstance(self.dedup, bool):
            raise self.error("dedup", "True or False")
        if self.gather not in GATHER_MODES:
            raise self.error("gather", " or ".join(repr(mode) for mode in GATHER_MODES))
        check_int(self, "queued_rows", 1, optional=True)


@register_tier
class HostGatherRowStore(KernelRowStore):
    """Packed rows in host memory (pageable), gathered by the CPU per lookup.

    Args: see :class:`RowStore`; options: :class:`HostOptions`;
    ``host_rows``: where the rows live (default: a private allocation).

    Raises:
        CapacityError: less available host memory (``MemAvailable``) than
            the table needs; ``gpu_reads=True`` without a CUDA device or
            with a failed registration.
    """

    tier = "host"
    options_type: ClassVar[type[TierOptions]] = HostOptions
    takes_host_rows = True
    host_sync = True  # the CPU gathers large batches: it must learn their ids
    host_ids = True  # ... unless it is given them on the host

    def _setup(self) -> None:
        super()._setup()
        options = self.options
        assert isinstance(options, HostOptions)
        self.chunk_rows = options.chunk_rows
        self.num_threads = options.num_threads
        self._waited = False  # use_waited_gathers
        self.gpu_share = float(options.gpu_share)
        self.dedup = options.dedup
        self.dedup_min_rows = DEDUP_MIN_ROWS
        self._arange: torch.Tensor | None = None
        what = f"tier='{self.tier}' ({self.num_rows} rows of {self.row_bytes} B)"
        self.source = self.host_rows.rows(self.num_rows, self.row_bytes, what)  # uint8, CPU
        # The source as the device reads it (bytes for the lookup kernel,
        # words for packed copies) when it is registered, and the stream the
        # GPU's share of a gather runs on.
        self._mapped: MappedHostRows | None = None
        self._mapped_words: MappedHostRows | None = None
        self._read_stream: torch.cuda.Stream | None = None
        self._map_for_gpu(options.gpu_reads)
        self._gpu_reads = self._mapped is not None
        # Created on the first CUDA lookup and grown on demand: a pinned
        # staging buffer, the side stream that copies out of it and an event
        # marking when its last copy has left it.
        self._staging: torch.Tensor | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._staging_free: torch.cuda.Event | None = None
        # Where rows gathered from ids given on the host land on the device, kept across
        # lookups, and an event marking when its last reader (the previous such lookup's
        # dequantisation) is done: the copies into it wait for that event only, not for
        # everything queued on the lookup's stream (which, for a lookup run at its layer
        # on the step's stream, is the blocks before the layer).
        self._landing: torch.Tensor | None = None
        self._landing_free: torch.cuda.Event | None = None
        # The queued gather (gather="queued" on a CUDA device): fixed buffers and the
        # host function that gathers into them.
        self._queued: _QueuedGather | None = None
        if options.gather == "queued":
            if self.device.type == "cpu" or host_functions_available(self.device):
                self._queued = _QueuedGather(self, options.queued_rows)
                self.host_sync = False  # every lookup is queued: nothing waits for the device
                self.splits_lookup = self._dequantises  # queue_copies: copies, then a kernel
            else:
                warnings.warn(
                    f"gather='queued' on {self.device}, where CUDA host functions are not "
                    f"available; the calling thread gathers (gather='thread')",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def _write(self, start: int, packed: torch.Tensor) -> None:
        self.host_rows.check_writable()
        memory.copy_into_host(self.source[start : start + packed.shape[0]], packed)

    def flush(self) -> None:
        self.host_rows.flush()

    @property
    def gpu_reads(self) -> bool:
        """Whether the GPU reads rows from host memory itself (see ``gpu_reads``); can be
        switched off, and on again, on a store whose rows are mapped for the device."""
        return self._gpu_reads

    @gpu_reads.setter
    def gpu_reads(self, on: bool) -> None:
        if on and self._mapped is None:
            raise ValidationError(
                f"gpu_reads = True on a store whose rows are not mapped for the GPU (device "
                f"{self.device}); expected one built with gpu_reads=True or None on a CUDA device"
            )
        self._gpu_reads = bool(on)

    def use_gpu_reads(self, on: bool) -> bool:
        """Switch :attr:`gpu_reads` when the rows are mapped for the device (see
        :meth:`engramrt.source.RowSource.use_gpu_reads`); returns whether they are."""
        if self._mapped is None:
            return False
        self.gpu_reads = on
        return True

    @property
    def queued(self) -> bool:
        """Whether the CPU's gathers are queued on the lookup's stream (``gather="queued"``
        on a CUDA device): no lookup of ids on the device makes the host wait."""
        return self._queued is not None

    @property
    def queued_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The queued gather's fixed buffers, ``(staging, rows)``: ``[capacity, row_bytes]``
        uint8, in pinned host memory and on the device (``None`` unless :attr:`queued`).
        A graph captures their addresses; they grow only outside a capture."""
        if self._queued is None:
            return None
        return self._queued.buffers

    def queue_copies(
        self,
        row_ids: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        in_flight: int = 1,
    ) -> Callable[[], torch.Tensor]:
        """:meth:`lookup` in two halves (see :meth:`engramrt.source.RowSource.queue_copies`):
        with a queued gather (:attr:`queued`), the ids' copy to the host, the CPU's gather
        and the rows' copy to the device are queued on the current stream now, and the
        returned function queues the dequantising kernel on its caller's stream. A batch
        with no row to gather (the GPU reads it, ids given on the host, nothing owned) is
        looked up whole by the returned function. ``in_flight``: how many lookups of this
        store may be queued whose functions have not been called yet (each holds device
        buffers of its rows until then; a scheduler of ``num_slots`` steps passes that)."""
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValidationError(f"in_flight={in_flight!r}; expected an int >= 1")
        if self._queued is None or not self._dequantises:
            return super().queue_copies(row_ids, out)
        col_end = self._checked(row_ids, out)
        num_tokens, num_cols = row_ids.shape
        owned = num_tokens * max(0, col_end - self.col_begin)
        if (
            row_ids.device.type != self.device.type
            or not (self.num_rows and owned)
            or self._gpu_reads_batch(owned)
        ):
            return functools.partial(self._lookup, row_ids, col_end, out)
        queued = self._queued
        queued.allow_in_flight(in_flight)
        turn, rows = queued.queue_rows(row_ids, col_end)
        return functools.partial(queued.dequantise, turn, rows, num_tokens, num_cols, col_end, out)

    def waits_on_host(self, row_ids: torch.Tensor) -> bool:
        """No wait for a batch the GPU reads itself (below :attr:`dedup_min_rows` owned ids,
        with :attr:`gpu_reads`) or one whose gather is queued; the CPU's gather waits for
        the ids."""
        if self._queued is not None:
            return False
        col_end = row_ids.shape[1] if self.col_end is None else self.col_end
        return not self._gpu_reads_batch(row_ids.shape[0] * max(0, col_end - self.col_begin))

    def _gpu_reads_batch(self, owned: int) -> bool:
        """Whether a lookup of ``owned`` ids is read by the GPU itself (no host wait)."""
        return self._gpu_reads and 0 < owned < self.dedup_min_rows

    def _map_for_gpu(self, gpu_reads: bool | None) -> None:
        required = bool(gpu_reads)
        if gpu_reads is None:
            gpu_reads = (
                self.host_rows.map_by_default
                and self.device.type == "cuda"
                and self.backend != "reference"
                and self.nbytes > 0
            )
        if not gpu_reads:
            return
        memory.require_cuda_mapping("gpu_reads=True", self.device)
        if self.backend == "reference":
            raise ValidationError(
                "gpu_reads=True with backend='reference'; the GPU reads rows with Triton "
                "kernels: expected backend 'auto' or 'triton'"
            )
        try:
            self.host_rows.map_for_device(self.source, self, f"tier='{self.tier}'")
        except CapacityError as error:
            if required:
                raise
            warnings.warn(f"{error}; the CPU gathers every row", RuntimeWarning, stacklevel=4)
            return
        pointer = self.source.data_ptr()
        self._mapped = MappedHostRows(pointer, self.num_rows)
        self._mapped_words = self._mapped.view(word_dtype_for(self.row_bytes))

    # -- gathering ---------------------------------------------------------

    def _staging_for(self, count: int) -> torch.Tensor:
        """A pinned ``[>= count, row_bytes]`` buffer no copy is still reading."""
        if self._staging_free is not None:
            self._staging_free.synchronize()
        if self._staging is None or self._staging.shape[0] < count:
            self._staging = torch.empty((count, self.row_bytes), dtype=torch.uint8, pin_memory=True)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._staging_free = torch.cuda.Event()
        return self._staging

    def device_rows(self) -> MappedHostRows | None:
        return self._mapped if self._gpu_reads else None

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Read by the device from host memory when it may (no host synchronisation),
        else the tier's tuned gather: pinned staging, pieces overlapped with copies."""
        if self._gpu_reads:
            assert self._mapped_words is not None
            return gather_mapped_rows(local_ids, self._mapped_words, self.row_bytes, self.device)
        return self._gather_to_device(local_ids.cpu())

    def _gather_to_device(
        self, local_ids: torch.Tensor, device_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``source[local_ids]`` as ``[U, row_bytes]`` uint8 on :attr:`device`.

        ``device_ids``: the same rows' global ids on the device, in the same
        order, when the GPU may read its share of them (``gpu_share``, the
        last ones) while the CPU gathers the others.
        """
        unique_count = local_ids.shape[0]
        if self.device.type != "cuda":
            rows = torch.empty((unique_count, self.row_bytes), dtype=torch.uint8)
            self._cpu_gather(local_ids, rows)
            return rows if self.device.type == "cpu" else rows.to(self.device)

        rows = torch.empty((unique_count, self.row_bytes), dtype=torch.uint8, device=self.device)
        gpu_count = 0
        if device_ids is not None and self._gpu_reads:
            gpu_count = int(unique_count * self.gpu_share)
        cpu_count = unique_count - gpu_count
        compute = torch.cuda.current_stream(self.device)
        read_stream = None
        if gpu_count:
            assert device_ids is not None
            read_stream = self._gpu_read(device_ids[cpu_count:], rows[cpu_count:], compute)
        if cpu_count:
            self._staged_gather(local_ids[:cpu_count], rows[:cpu_count], compute)
        if read_stream is not None:
            compute.wait_stream(read_stream)
        return rows

    def _gpu_read(
        self, device_ids: torch.Tensor, rows: torch.Tensor, compute: torch.cuda.Stream
    ) -> torch.cuda.Stream:
        """Start the device's copy of rows ``device_ids`` (global) from host memory into
        ``rows`` on the read stream; returns that stream."""
        assert self._mapped_words is not None
        read_stream = self._read_stream
        if read_stream is None:
            read_stream = self._read_stream = torch.cuda.Stream(self.device)
        read_stream.wait_stream(compute)  # ``rows`` and the ids are the compute stream's
        with torch.cuda.stream(read_stream):
            gather_mapped_rows(
                device_ids,
                self._mapped_words,
                self.row_bytes,
                self.device,
                row_begin=self.row_begin,
                out=rows,
            )
        rows.record_stream(read_stream)
        device_ids.record_stream(read_stream)
        return read_stream

    def _gather_threads(self, count: int) -> int:
        if self.num_threads is not None:
            return self.num_threads
        per_thread = ROWS_PER_WAITED_GATHER_THREAD if self._waited else ROWS_PER_GATHER_THREAD
        return max(1, min(_cpu_count(), count // per_thread))

    def use_waited_gathers(self, on: bool) -> bool:
        """Size the CPU's gathers for the thread that waits for their rows (``on``:
        :data:`ROWS_PER_WAITED_GATHER_THREAD`) or for a thread beside the one launching
        the model (off, the default: :data:`ROWS_PER_GATHER_THREAD`); see
        :meth:`engramrt.source.RowSource.use_waited_gathers`. ``num_threads`` overrides
        both. Returns True."""
        self._waited = bool(on)
        return True

    def _cpu_gather(self, local_ids: torch.Tensor, rows: torch.Tensor) -> None:
        with _intra_op_threads(self._gather_threads(local_ids.shape[0])):
            torch.index_select(_word_view(self.source), 0, local_ids, out=_word_view(rows))

    def _staged_gather(
        self, local_ids: torch.Tensor, rows: torch.Tensor, compute: torch.cuda.Stream
    ) -> None:
        """CPU gathers into pinned staging, piece by piece, each piece copied to ``rows``
        (on the device) on the copy stream while the next is gathered."""
        count = local_ids.shape[0]
        source = _word_view(self.source)
        staging = self._staging_for(count)
        staged = _word_view(staging)
        copy_stream = self._copy_stream
        assert copy_stream is not None and self._staging_free is not None
        # ``rows`` may reuse memory whose last reader is still queued on the
        # compute stream: the copies must start after it.
        copy_stream.wait_stream(compute)
        # The copy stream is current for the whole loop (the gathers run on
        # the CPU, whatever the stream): entering a stream context per piece
        # costs host time each (BENCHMARKS.md#the-host-tier-where-the-time-goes).
        with _intra_op_threads(self._gather_threads(count)), torch.cuda.stream(copy_stream):
            for lo in range(0, count, self.chunk_rows):
                hi = min(lo + self.chunk_rows, count)
                torch.index_select(source, 0, local_ids[lo:hi], out=staged[lo:hi])
                rows[lo:hi].copy_(staging[lo:hi], non_blocking=True)
        self._staging_free.record(copy_stream)
        compute.wait_stream(copy_stream)
        rows.record_stream(copy_stream)

    # -- lookup ------------------------------------------------------------

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens, num_cols = row_ids.shape
        owned_count = num_tokens * (col_end - self.col_begin)
        if row_ids.device.type == "cpu" and self.device.type == "cuda" and owned_count:
            # Ids already on the host: the CPU gathers them as they come, no device wait.
            return self._streamed_lookup(
                row_ids, row_ids[:, self.col_begin : col_end], col_end, out
            )
        row_ids = row_ids.to(self.device, non_blocking=True)
        owned = row_ids[:, self.col_begin : col_end]
        if self._queued is not None and self.num_rows and owned.numel():
            if self._gpu_reads_batch(owned.numel()):
                assert self._mapped is not None
                return self._read_mapped(self._mapped, row_ids, col_end, out)
            return self._queued.lookup(row_ids, col_end, out)
        if self._gpu_reads_batch(owned.numel()):
            assert self._mapped is not None
            # Small batches: the lookup kernel reads the rows from host
            # memory itself, with no host synchronisation (ids are checked
            # in validate mode only, as on the device and UVA tiers).
            return self._read_mapped(self._mapped, row_ids, col_end, out)
        if owned.numel() == 0:
            return lookup_rows(
                row_ids,
                self._empty_rows(),
                col_begin=self.col_begin,
                col_end=col_end,
                out=out,
                backend=self.backend,
                validate=False,  # checked once, by lookup()
            )
        if not (self.dedup and owned.numel() >= self.dedup_min_rows):
            # Small batches, or deduplication off: gathered as they come.
            return self._streamed_lookup(row_ids, owned, col_end, out)
        # Sorted and deduplicated on the device; the unique ids' trip to the
        # host is the tier's synchronisation (see the module doc).
        unique, inverse = torch.unique(owned, sorted=True, return_inverse=True)
        device_ids: torch.Tensor | None = unique
        ids = unique.cpu()
        lowest, highest = int(ids[0]), int(ids[-1])  # sorted: these bound them all
        ids, outside = self._inside_shard(ids, lowest, highest)
        if outside is not None:
            device_ids = None
        local_ids = ids - self.row_begin if self.row_begin else ids
        # [U, row_bytes] on the compute device; the ids were bounded before
        # the GPU reads any of them.
        if self.num_rows == 0:
            rows = torch.zeros(
                (ids.shape[0], self.row_bytes), dtype=torch.uint8, device=self.device
            )
        else:
            rows = self._gather_to_device(local_ids, device_ids)
        if outside is not None:
            rows[outside.nonzero().view(-1).to(self.device)] = 0
        if self.col_begin == 0 and col_end == num_cols:
            compact_ids = inverse
        else:
            compact_ids = torch.zeros((num_tokens, num_cols), dtype=torch.int64, device=self.device)
            compact_ids[:, self.col_begin : col_end] = inverse
        return lookup_rows(
            compact_ids,
            rows,
            col_begin=self.col_begin,
            col_end=col_end,
            row_begin=0,
            out=out,
            backend=self.backend,
            validate=False,  # checked once, by lookup()
        )

    def _inside_shard(
        self, ids: torch.Tensor, lowest: int, highest: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ids`` (on the host) with those outside the shard replaced by its first row,
        and the mask of those (None when ``[lowest, highest]`` is inside: the common case,
        which costs nothing). Unchecked ids (lookup() refused them with check_ids) outside
        the shard read as rows of zeros, as on every tier: their slots gather a row that
        is then zeroed or never read."""
        if lowest >= self.row_begin and highest < self.row_end:
            return ids, None
        outside = (ids < self.row_begin) | (ids >= self.row_end)
        return torch.where(outside, self.row_begin, ids), outside

    def _streamed_lookup(
        self, row_ids: torch.Tensor, owned: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """A batch gathered as it comes, in pieces of whole tokens: the CPU gathers a
        piece while the previous one is copied to the device, and the lookup kernel
        dequantises each piece as soon as its copy lands, so only the last piece's
        dequantisation follows the last copy (the deduplicated path must wait for
        all of them: its rows serve any token)."""
        num_tokens, num_cols = row_ids.shape
        owned_cols = col_end - self.col_begin
        ids = owned.reshape(-1).cpu()  # the tier's host synchronisation (none for host ids)
        count = ids.shape[0]
        ids, outside = self._inside_shard(ids, int(ids.min()), int(ids.max()))
        local_ids = ids - self.row_begin if self.row_begin else ids
        # Slot ``i`` of the batch reads row ``i`` of ``rows``; a slot outside the
        # shard reads past the end of ``rows``, which the kernel reads as zeros.
        positions = self._positions(count)
        if outside is not None:
            positions = torch.where(outside.to(self.device), count, positions)
        positions = positions.view(num_tokens, owned_cols)
        if self.col_begin == 0 and col_end == num_cols:
            compact_ids = positions
        else:
            compact_ids = torch.zeros((num_tokens, num_cols), dtype=torch.int64, device=self.device)
            compact_ids[:, self.col_begin : col_end] = positions
        if out is None:
            out = torch.empty(
                (num_tokens, num_cols, self.E), dtype=torch.bfloat16, device=self.device
            )
        landing = row_ids.device.type == "cpu" and self.device.type == "cuda"
        if landing:
            rows, after = self._landing_for(count)
        else:
            rows = torch.empty((count, self.row_bytes), dtype=torch.uint8, device=self.device)
            after = None
        tokens_per_piece = max(1, self.chunk_rows // owned_cols)
        with self._piece_copies(count, after) as copy_piece:
            for first in range(0, num_tokens, tokens_per_piece):
                last = min(num_tokens, first + tokens_per_piece)
                lo, hi = first * owned_cols, last * owned_cols
                if self.num_rows:  # an empty shard: every slot is outside and reads zeros
                    copy_piece(local_ids[lo:hi], rows[lo:hi], lo)
                lookup_rows(
                    compact_ids[first:last],
                    rows,
                    col_begin=self.col_begin,
                    col_end=col_end,
                    row_begin=0,
                    out=out[first:last],
                    backend=self.backend,
                    validate=False,  # checked once, by lookup()
                )
        if landing:
            assert self._landing_free is not None
            self._landing_free.record(torch.cuda.current_stream(self.device))
        return out

    def _landing_for(self, count: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``[count, row_bytes]`` of the device buffer rows gathered from host ids land
        in, and the event the copies into it wait for (None: a buffer just allocated on
        the current stream, which the copies wait for instead)."""
        if self._landing is None or self._landing.shape[0] < count:
            if self._landing is not None and self._landing_free is not None:
                # Its last reader may be queued on another stream than the one it was
                # allocated on: done before the allocator may hand its memory out again.
                self._landing_free.synchronize()
            self._landing = torch.empty(
                (max(count, 1024), self.row_bytes), dtype=torch.uint8, device=self.device
            )
            self._landing_free = torch.cuda.Event()
            return self._landing[:count], None
        return self._landing[:count], self._landing_free

    @contextlib.contextmanager
    def _piece_copies(
        self, count: int, after: torch.cuda.Event | None = None
    ) -> Iterator[Callable[[torch.Tensor, torch.Tensor, int], None]]:
        """A function ``copy_piece(local_ids, rows, offset)`` that gathers rows
        ``source[local_ids]`` into ``rows`` on :attr:`device`, after which work queued
        on the current stream may read them; ``offset``: where the piece starts in
        the batch (its place in the staging buffer of ``count`` rows). The copies
        start after ``after`` (the rows' last reader), else after the work queued on
        the current stream so far."""
        source = _word_view(self.source)
        threads = _intra_op_threads(self._gather_threads(count))
        if self.device.type != "cuda":

            def gather(local_ids: torch.Tensor, rows: torch.Tensor, offset: int) -> None:
                if self.device.type == "cpu":
                    torch.index_select(source, 0, local_ids, out=_word_view(rows))
                else:
                    rows.copy_(torch.index_select(self.source, 0, local_ids))

            with threads:
                yield gather
            return
        compute = torch.cuda.current_stream(self.device)
        staging = self._staging_for(count)
        copy_stream = self._copy_stream
        assert copy_stream is not None and self._staging_free is not None
        if after is not None:
            copy_stream.wait_event(after)
        else:
            # The rows may reuse memory whose last reader is still queued on the
            # compute stream: the copies must start after it.
            copy_stream.wait_stream(compute)

        def staged_copy(local_ids: torch.Tensor, rows: torch.Tensor, offset: int) -> None:
            piece = staging[offset : offset + local_ids.shape[0]]
            torch.index_select(source, 0, local_ids, out=_word_view(piece))
            with torch.cuda.stream(copy_stream):
                rows.copy_(piece, non_blocking=True)
            compute.wait_stream(copy_stream)

        with threads:
            yield staged_copy
        self._staging_free.record(copy_stream)
        # ``rows`` is a view of one allocation made on the compute stream, which
        # waited for every copy: nothing on the copy stream outlives it.

    def _positions(self, count: int) -> torch.Tensor:
        """``arange(count)`` (int64) on the device, from a buffer kept across lookups."""
        if self._arange is None or self._arange.shape[0] < count:
            self._arange = torch.arange(max(count, 1024), dtype=torch.int64, device=self.device)
        return self._arange[:count]

    def _empty_rows(self) -> torch.Tensor:
        return torch.zeros((1, self.row_bytes), dtype=torch.uint8, device=self.device)


@dataclass(frozen=True)
class _QueuedJob:
    """What the queued gather's host function reads and writes for one shape of batch."""

    ids: torch.Tensor  # [T, owned columns] strided view of the pinned ids' span
    local: torch.Tensor  # [T * owned columns] int64, the local ids (CPU)
    staged: torch.Tensor  # [T * owned columns, words] view of the pinned staging


class _QueuedGather:
    """The queued gather of a :class:`HostGatherRowStore` (``gather="queued"``).

    One lookup queues, on the current stream, copies and one host function only,
    then one kernel:

    1. the copy of the ids to pinned memory: the span of the row-id buffer that holds
       the owned columns, in one copy as they lie (a layer's ids are a strided view of
       the step's row ids; making them contiguous on the device would be a kernel);
    2. the host function (CUDA's thread, once the ids have landed): the owned ids
       made contiguous and local on the CPU, the rows gathered into pinned staging
       by one ``index_select``, and the rows of ids outside the shard zeroed (they
       read as zeros, as on every tier; a batch with none pays one ``aminmax``);
    3. the staging's copy to the device;
    4. the lookup kernel, which dequantises and scatters row ``i`` to slot ``i``
       (its index a view of a fixed buffer, made when the buffers grow).

    So the thread that queues a lookup launches four things, and nothing but the
    last is a kernel: in a step, only that one runs beside the model's blocks.
    :meth:`queue_rows` (steps 1-3) and :meth:`dequantise` (step 4) can be queued
    apart, the kernel at the layer on the model's stream
    (:meth:`HostGatherRowStore.queue_copies`). Buffers sit at fixed addresses
    (capturable) and are reused in stream order; the device rows are a ring of
    buffers, one per lookup that may be queued and not yet dequantised (one, until
    a caller asks for more), each reused once the stream that dequantised it has
    (an event; a whole step captured in one graph replays in order and needs none).
    """

    def __init__(self, store: HostGatherRowStore, rows: int | None) -> None:
        self.store = store
        self.capacity = 0  # rows the staging holds
        self._source = _word_view(store.source)
        # What the host function reads and writes for each shape of batch (its argument
        # is the index here), made on the queuing thread so the function only indexes.
        self._jobs: list[_QueuedJob] = []
        self._job_keys: dict[tuple[int, int, int, torch.dtype], int] = {}
        self._gather = HostFunction(self._gather_rows, name=f"the {store.tier} tier's gather")
        self._staging = self._positions = self._local = torch.empty(0)
        self._rows: list[torch.Tensor] = []  # the ring of device buffers
        self._rows_free: list[torch.cuda.Event | None] = []  # each one's last dequantisation
        self._turn = 0  # the ring's next buffer
        self._in_flight = 1
        self._ids_host: dict[torch.dtype, torch.Tensor] = {}  # pinned spans of row ids
        # num_cols -> [capacity // owned columns, num_cols] slot of each (token, column),
        # zeros in the columns this shard does not serve.
        self._compact: dict[int, torch.Tensor] = {}
        if rows is not None:
            self._grow(rows)

    def _capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph."""
        return capturing(self.store.device)

    def _refuse_in_capture(self, what: str) -> None:
        """Buffers are made only outside a CUDA graph's capture (making them synchronises,
        and a graph must keep reading the buffers it captured)."""
        if self._capturing():
            raise ValidationError(
                f"a queued host gather needs {what} during CUDA-graph capture; expected a "
                f"capture after a step of the largest size and of this shape, or "
                f"HostOptions(queued_rows=) at least the step's rows"
            )

    def _drain(self) -> None:
        """No queued gather still uses the buffers about to be replaced."""
        if self.store.device.type == "cuda":
            torch.cuda.synchronize(self.store.device)

    def _grow(self, count: int) -> None:
        """Buffers for ``count`` rows (called outside any capture: it synchronises)."""
        self._refuse_in_capture(f"buffers for {count} rows (they hold {self.capacity})")
        store = self.store
        cuda = store.device.type == "cuda"
        self._drain()
        self.capacity = count
        self._jobs.clear()
        self._job_keys.clear()
        self._compact.clear()
        self._local = torch.empty(count, dtype=torch.int64)
        self._staging = torch.empty((count, store.row_bytes), dtype=torch.uint8, pin_memory=cuda)
        self._rows = [
            torch.empty((count, store.row_bytes), dtype=torch.uint8, device=store.device)
            for _ in range(self._in_flight)
        ]
        self._rows_free = [None] * self._in_flight
        self._turn = 0
        self._positions = torch.arange(count, dtype=torch.int64, device=store.device)

    def _ids_buffer(self, dtype: torch.dtype, span: int) -> torch.Tensor:
        """The pinned buffer the ids' span of ``dtype`` is copied into (grown to ``span``)."""
        held = self._ids_host.get(dtype)
        if held is None or held.shape[0] < span:
            self._refuse_in_capture(f"a buffer for {span} row ids of {dtype}")
            self._drain()
            size = max([span, *(ids.shape[0] for ids in self._ids_host.values())])
            self._ids_host[dtype] = torch.empty(
                size, dtype=dtype, pin_memory=self.store.device.type == "cuda"
            )
            self._jobs.clear()
            self._job_keys.clear()
        return self._ids_host[dtype]

    def allow_in_flight(self, lookups: int) -> None:
        """Keep device buffers for ``lookups`` lookups queued and not yet dequantised."""
        if lookups > self._in_flight:
            self._in_flight = lookups
            if self.capacity:
                self._grow(self.capacity)

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._staging, self._rows[0]

    def _gather_rows(self, key: int) -> None:
        """The host function: rows ``source[ids]`` into the staging (CUDA's thread).

        A gather that fails leaves all-ones bytes in the staging (NaN in fp8 e4m3, in the
        ue8m0 scales and in bf16), so the step's rows are NaN rather than another step's;
        the error is raised at the store's next lookup."""
        job = self._jobs[key]
        store = self.store
        try:
            local = job.local
            local.view(job.ids.shape).copy_(job.ids)  # contiguous, int64
            if store.row_begin:
                local -= store.row_begin
            lowest, highest = torch.aminmax(local)
            outside = None
            if int(lowest) < 0 or int(highest) >= store.num_rows:
                outside = (local < 0) | (local >= store.num_rows)
                local.masked_fill_(outside, 0)
            with _intra_op_threads(store._gather_threads(local.shape[0])):
                torch.index_select(self._source, 0, local, out=job.staged)
            if outside is not None:
                job.staged[outside] = 0  # zero bytes: a row of zeros, as the tiers read them
        except BaseException:
            job.staged.fill_(-1)
            raise

    def _job(self, ids_host: torch.Tensor, num_tokens: int, owned_cols: int, stride: int) -> int:
        """The key of the host function's job for a batch of this shape."""
        shape = (num_tokens, owned_cols, stride, ids_host.dtype)
        key = self._job_keys.get(shape)
        if key is None:
            key = self._job_keys[shape] = len(self._jobs)
            count = num_tokens * owned_cols
            self._jobs.append(
                _QueuedJob(
                    ids=ids_host.as_strided((num_tokens, owned_cols), (stride, 1)),
                    local=self._local[:count],
                    staged=_word_view(self._staging[:count]),
                )
            )
        return key

    def queue_rows(self, row_ids: torch.Tensor, col_end: int) -> tuple[int, torch.Tensor]:
        """Queue, on the current stream, the copies and the host function that bring the
        owned rows of ``row_ids`` (on the device) to the device, slot ``i`` at row ``i``;
        returns the ring buffer's index and those packed rows ``[T * owned columns,
        row_bytes]``, for :meth:`dequantise`."""
        store = self.store
        num_tokens = row_ids.shape[0]
        owned_cols = col_end - store.col_begin
        count = num_tokens * owned_cols
        if count > self.capacity:
            self._grow(count)
        if row_ids.stride(1) != 1:
            row_ids = row_ids.contiguous()
        # The owned columns' span of the id buffer, from the first token's first owned
        # id to the last token's last: one contiguous copy, whatever the row stride.
        stride = row_ids.stride(0) if num_tokens > 1 else owned_cols
        span = (num_tokens - 1) * stride + owned_cols
        ids_host = self._ids_buffer(row_ids.dtype, span)
        key = self._job(ids_host, num_tokens, owned_cols, stride)
        on_device = row_ids.as_strided((span,), (1,), row_ids.storage_offset() + store.col_begin)
        ids_host[:span].copy_(on_device, non_blocking=True)
        if store.device.type == "cuda":
            self._gather.launch(torch.cuda.current_stream(store.device), key)
        else:  # no stream to queue on: the same function, now
            self._gather.call_now(key)
        turn = self._turn
        self._turn = (turn + 1) % len(self._rows)
        free = self._rows_free[turn]
        if free is not None and not self._capturing():
            torch.cuda.current_stream(store.device).wait_event(free)
        rows = self._rows[turn][:count]
        rows.copy_(self._staging[:count], non_blocking=True)
        return turn, rows

    def compact_ids(self, num_tokens: int, num_cols: int, col_end: int) -> torch.Tensor:
        """``[T, num_cols]``: the row of :meth:`queue_rows`'s result each (token, column)
        reads (zeros in the columns this shard does not serve): a view of a buffer."""
        store = self.store
        owned_cols = col_end - store.col_begin
        if store.col_begin == 0 and col_end == num_cols:
            return self._positions[: num_tokens * owned_cols].view(num_tokens, owned_cols)
        compact = self._compact.get(num_cols)
        if compact is None:
            self._refuse_in_capture(f"the slots of a step of {num_cols} columns")
            tokens = self.capacity // owned_cols
            compact = torch.zeros((tokens, num_cols), dtype=torch.int64, device=store.device)
            compact[:, store.col_begin : col_end] = self._positions[: tokens * owned_cols].view(
                tokens, owned_cols
            )
            self._compact[num_cols] = compact
        return compact[:num_tokens]

    def dequantise(
        self,
        turn: int,
        rows: torch.Tensor,
        num_tokens: int,
        num_cols: int,
        col_end: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The lookup kernel over :meth:`queue_rows`'s ``rows`` (ring buffer ``turn``), on
        the current stream."""
        store = self.store
        out = lookup_rows(
            self.compact_ids(num_tokens, num_cols, col_end),
            rows,
            col_begin=store.col_begin,
            col_end=col_end,
            row_begin=0,
            out=out,
            backend=store.backend,
            validate=False,  # checked once, by lookup()
        )
        if store.device.type == "cuda" and not self._capturing():
            free = self._rows_free[turn]
            if free is None:
                free = self._rows_free[turn] = torch.cuda.Event()
            free.record(torch.cuda.current_stream(store.device))
        return out

    def lookup(self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None) -> torch.Tensor:
        turn, rows = self.queue_rows(row_ids, col_end)
        return self.dequantise(turn, rows, row_ids.shape[0], row_ids.shape[1], col_end, out)

    def raise_failure(self) -> None:
        self._gather.raise_failure()
