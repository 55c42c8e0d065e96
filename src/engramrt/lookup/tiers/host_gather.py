"""Host-gather tier: the CPU gathers the needed rows, bulk copies move them.

For tables larger than device memory. One lookup:

1. from :data:`DEDUP_MIN_ROWS` owned ids up, they are sorted and
   deduplicated on the device that holds them with ``torch.unique(...,
   return_inverse=True)`` (real text repeats n-grams, and sorted ids read
   the table front to back); fewer are gathered as they come;
2. the ids come to the host (the tier's host synchronisation: the CPU
   cannot gather rows it has not been told about, so this tier is not
   capturable in a CUDA graph); they are made local (``id - row_begin``)
   there;
3. the rows are gathered into a persistent pinned staging buffer in
   ``pieces`` of ``chunk_rows`` rows, each by one ``torch.index_select``
   that runs on torch's intra-op thread pool (``num_threads`` threads), over
   the widest integer view of a row (int64 words for 264-byte rows); each
   piece is copied to the device on a side stream while the next one is
   gathered;
4. the lookup kernel, given the unique rows as its table and the inverse
   index as row ids, dequantises them and scatters them back to
   ``[T, C, E]`` (zeros for columns this shard does not own).

Why this shape (measured on an H200 host, 16 vCPUs, 196,608 random 264-byte
rows of an 8 GiB table; ``bench/study_host_tier.py``): one ``index_select``
with 16 intra-op threads gathers 172 M rows/s, while 16 Python threads each
running ``index_select`` on a slice reach 98 M rows/s and chunked
per-thread gather-and-copy pipelines 10-45 M rows/s (GIL and per-chunk
overhead); int64 words beat bytes (98 vs 83 M rows/s) and numpy's ``take``
(72 M rows/s); transparent huge pages did not help (48 vs 98 M rows/s).
The pinned copy runs at 205 M rows/s, unique on the GPU and the ids'
trip to the host take ~0.2 ms each.

Where one lookup's time goes (T = 8,192, 196,608 rows, 16 threads): unique
and the ids to the host 0.37 ms, gather and copy in three pieces 1.55 ms,
dequantise-and-scatter 0.2 ms with its launch. Each piece costs the calling
thread ~0.1 ms beside its gather (waking the thread pool, launching the
copy), so smaller pieces lose (12 pieces: +1.2 ms). A sort-based
deduplication that waits once instead of twice was tried and dropped: its
fifteen small operations cost the host more (0.33 vs 0.21 ms at T = 256)
than the wait they save.

Out-of-range ids are always caught here, nearly for free: the ids are on
the host anyway, and sorted unique ids need only their first and last
checked (a plain batch, its minimum and maximum).

A store is meant to be used from one thread at a time (it owns the
staging buffer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from engramrt.errors import ValidationError
from engramrt.lookup import check_row_ids_in_shard, lookup_rows
from engramrt.lookup.tiers import memory
from engramrt.lookup.tiers.base import RowStore

__all__ = ["DEFAULT_CHUNK_ROWS", "HostGatherRowStore"]

DEFAULT_CHUNK_ROWS = 65536
"""Rows per pipelined piece (17 MB at 264 B): 8,192 tokens x 24 columns is
three pieces, so the copy of one overlaps the gather of the next while each
gather is still long enough to keep 16 threads busy."""

DEDUP_MIN_ROWS = 32768
"""Owned ids below which a lookup skips deduplication (the ``dedup_min_rows``
attribute of a store, read at every lookup; 0 always deduplicates). Sorting
and the extra wait cost ~0.2 ms of host time; at T = 256 (6,144 ids) the
whole lookup was 587 µs with it, against 393 µs for a plain gather."""

ROWS_PER_GATHER_THREAD = 8192
"""With ``num_threads=None`` the gather uses one intra-op thread per this many
unique rows (at most the CPUs this process may use). Alone, a lookup is
faster on more threads (6,144 rows: 0.19 ms on 16, 0.39 ms on one), but in
a serving loop the gather runs beside the model and competes with it: on
decode steps of 256 requests (6,144 rows per layer) with a graph-captured
30-block backbone and prefetch, host tables cost 0.0% and 2.8% of
throughput against GPU memory (two runs) with one thread, 4.6% with three
and 2.6% with 16;
prefill chunks of 8,192 tokens get 16 threads and cost 0.2%
(``bench/runtime_overhead.py``, H200 host, 16 vCPUs)."""

_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word_view(rows: torch.Tensor) -> torch.Tensor:
    """``rows [N, B]`` uint8 viewed as the widest integer words that divide B."""
    width = rows.shape[1]
    for size, dtype in _WORD_DTYPES:
        if width % size == 0:
            return rows.view(dtype)
    return rows  # pragma: no cover - size 1 always divides


def _cpu_count() -> int:
    """CPUs this process may run on (torch's default thread count may be lower)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


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


class HostGatherRowStore(RowStore):
    """Packed rows in host memory (pageable), gathered by the CPU per lookup.

    Args:
        num_rows, E, device, row_begin, col_begin, col_end, validate: see
            :class:`RowStore`.
        chunk_rows: rows per pipelined piece (gather of one piece overlaps
            the copy of the previous).
        num_threads: torch intra-op threads for the gather; None picks one
            per :data:`ROWS_PER_GATHER_THREAD` unique rows, at most the
            number of CPUs this process may use.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the final
            dequantise-and-scatter.

    Raises:
        CapacityError: less available host memory (``MemAvailable``) than
            the table needs.
    """

    tier = "host"

    def __init__(
        self,
        num_rows: int,
        E: int,
        *,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = False,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        num_threads: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            num_rows,
            E,
            device=device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
        )
        if chunk_rows < 1:
            raise ValidationError(f"chunk_rows = {chunk_rows}; expected >= 1")
        if num_threads is not None and num_threads < 1:
            raise ValidationError(f"num_threads = {num_threads}; expected >= 1 or None")
        self.chunk_rows = int(chunk_rows)
        self.num_threads = num_threads
        self.backend = backend
        self.dedup_min_rows = DEDUP_MIN_ROWS
        self._arange: torch.Tensor | None = None
        self.source = self._allocate_source()  # [num_rows, row_bytes] uint8, CPU
        # Created on the first CUDA lookup and grown on demand: a pinned
        # staging buffer, the side stream that copies out of it and an event
        # marking when its last copy has left it.
        self._staging: torch.Tensor | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._staging_free: torch.cuda.Event | None = None

    def _allocate_source(self) -> torch.Tensor:
        what = f"tier='{self.tier}' ({self.num_rows} rows of {self.row_bytes} B)"
        memory.require(what, self.nbytes, memory.host_available_bytes(), "host memory")
        return torch.empty((self.num_rows, self.row_bytes), dtype=torch.uint8)

    def _write(self, start: int, packed: torch.Tensor) -> None:
        self.source[start : start + packed.shape[0]].copy_(packed)

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

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """The tier's tuned gather: pinned staging, pieces overlapped with copies."""
        return self._gather_to_device(local_ids.cpu())

    def _gather_to_device(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``source[local_ids]`` as ``[U, row_bytes]`` uint8 on :attr:`device`."""
        unique_count = local_ids.shape[0]
        source = _word_view(self.source)
        threads = self.num_threads
        if threads is None:
            threads = max(1, min(_cpu_count(), unique_count // ROWS_PER_GATHER_THREAD))
        if self.device.type != "cuda":
            rows = torch.empty((unique_count, self.row_bytes), dtype=torch.uint8)
            with _intra_op_threads(threads):
                torch.index_select(source, 0, local_ids, out=_word_view(rows))
            return rows if self.device.type == "cpu" else rows.to(self.device)

        staging = self._staging_for(unique_count)
        staged = _word_view(staging)
        rows = torch.empty((unique_count, self.row_bytes), dtype=torch.uint8, device=self.device)
        compute = torch.cuda.current_stream(self.device)
        copy_stream = self._copy_stream
        assert copy_stream is not None and self._staging_free is not None
        # ``rows`` may reuse memory whose last reader is still queued on the
        # compute stream: the copies must start after it.
        copy_stream.wait_stream(compute)
        with _intra_op_threads(threads):
            for lo in range(0, unique_count, self.chunk_rows):
                hi = min(lo + self.chunk_rows, unique_count)
                torch.index_select(source, 0, local_ids[lo:hi], out=staged[lo:hi])
                with torch.cuda.stream(copy_stream):
                    rows[lo:hi].copy_(staging[lo:hi], non_blocking=True)
        self._staging_free.record(copy_stream)
        compute.wait_stream(copy_stream)
        rows.record_stream(copy_stream)
        return rows

    # -- lookup ------------------------------------------------------------

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens, num_cols = row_ids.shape
        row_ids = row_ids.to(self.device, non_blocking=True)
        owned = row_ids[:, self.col_begin : col_end]
        if owned.numel() == 0:
            return lookup_rows(
                row_ids,
                self._empty_rows(),
                col_begin=self.col_begin,
                col_end=col_end,
                out=out,
                backend=self.backend,
            )
        if owned.numel() >= self.dedup_min_rows:
            # Sorted and deduplicated on the device; the unique ids' trip to
            # the host is the tier's synchronisation (see the module doc).
            unique, inverse = torch.unique(owned, sorted=True, return_inverse=True)
            ids = unique.cpu()
            lowest, highest = int(ids[0]), int(ids[-1])  # sorted: these bound them all
        else:
            # Small batches: deduplicating costs more than the rows it saves.
            ids = owned.reshape(-1).cpu()
            inverse = self._positions(ids.shape[0]).view(owned.shape)
            lowest, highest = int(ids.min()), int(ids.max())
        if lowest < self.row_begin or highest >= self.row_end:
            check_row_ids_in_shard(row_ids, self.col_begin, col_end, self.row_begin, self.row_end)
        local_ids = ids - self.row_begin if self.row_begin else ids
        rows = self._gather_to_device(local_ids)  # [U, row_bytes] on the compute device
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
        )

    def _positions(self, count: int) -> torch.Tensor:
        """``arange(count)`` (int64) on the device, from a buffer kept across lookups."""
        if self._arange is None or self._arange.shape[0] < count:
            self._arange = torch.arange(max(count, 1024), dtype=torch.int64, device=self.device)
        return self._arange[:count]

    def _empty_rows(self) -> torch.Tensor:
        return torch.zeros((1, self.row_bytes), dtype=torch.uint8, device=self.device)
