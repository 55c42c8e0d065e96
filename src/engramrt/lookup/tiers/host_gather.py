"""Host-gather tier: CPU threads gather the needed rows, bulk copies move them.

For tables larger than device memory. One lookup:

1. the owned ids are made local (``id - row_begin``) and deduplicated,
   sorted, with ``torch.unique(..., return_inverse=True)`` on the device
   that holds them (real text repeats n-grams, and sorted ids read the
   table front to back);
2. the unique ids come to the host (the one host synchronisation: the CPU
   cannot gather rows it has not been told about, so this tier is not
   capturable in a CUDA graph);
3. the sorted unique ids are split into ``num_threads`` contiguous slices,
   one task per gather thread (a thread-pool task costs ~10 µs, so there is
   one per thread per lookup, not one per chunk); each thread walks its
   slice in chunks of ``chunk_rows``: ``torch.index_select`` into one of its
   two pinned staging buffers, then a ``non_blocking`` copy to the device
   on its own side stream, so the copy of one chunk runs while the next
   one gathers (an event per buffer keeps it from being refilled before
   its copy has left it);
4. the lookup kernel, given the unique rows as its table and the inverse
   index as row ids, dequantises them and scatters them back to
   ``[T, C, E]`` (zeros for columns this shard does not own).

Only unique rows cross the bus, each as one 264-byte packed row. On a
CPU-only machine the same path runs without the copy, and the last step
is the reference (or the kernel under ``TRITON_INTERPRET=1``).

Out-of-range ids are always caught here, for free: the unique ids are
sorted, so checking the first and the last is enough.

A store is meant to be used from one thread at a time (it owns the
staging buffers).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from engramrt.errors import ValidationError
from engramrt.lookup import check_row_ids_in_shard, lookup_rows
from engramrt.lookup.tiers import memory
from engramrt.lookup.tiers.base import RowStore

__all__ = ["DEFAULT_CHUNK_ROWS", "HostGatherRowStore", "default_num_threads"]

DEFAULT_CHUNK_ROWS = 4096
"""Rows per staged chunk and thread: 1.08 MB at 264 B. One thread gathers
it in ~0.3 ms (200 M rows/s measured with 16 threads, ~12 M rows/s each)
and the copy takes ~20 µs at 55 GB/s, so 16 threads together keep the bus
busy; 8192 tokens x 24 columns is three chunks per thread."""

_MIN_ROWS_PER_TASK = 1024
"""A thread's slice is at least this long; fewer rows are gathered inline."""


def default_num_threads() -> int:
    """One gather thread per CPU this process may use, at most 16."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        available = os.cpu_count() or 1
    return max(1, min(16, available))


def _single_threaded_worker() -> None:
    # Each worker gathers its own slice; with OpenMP, torch.set_num_threads
    # only changes the calling thread, so workers do not each start a team
    # of intra-op threads (num_threads x cores threads in all).
    if "OpenMP" in torch.__config__.parallel_info():
        torch.set_num_threads(1)


class HostGatherRowStore(RowStore):
    """Packed rows in host memory (pageable), gathered by CPU threads per lookup.

    Args:
        num_rows, E, device, row_begin, col_begin, col_end, validate: see
            :class:`RowStore`.
        chunk_rows: rows per staged chunk.
        num_threads: gather threads (default :func:`default_num_threads`).
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
        num_threads = default_num_threads() if num_threads is None else num_threads
        if chunk_rows < 1:
            raise ValidationError(f"chunk_rows = {chunk_rows}; expected >= 1")
        if num_threads < 1:
            raise ValidationError(f"num_threads = {num_threads}; expected >= 1")
        self.chunk_rows = int(chunk_rows)
        self.num_threads = int(num_threads)
        self.backend = backend
        self.source = self._allocate_source()  # [num_rows, row_bytes] uint8, CPU
        self._pool: ThreadPoolExecutor | None = None
        # Per gather thread, created on the first CUDA lookup: two pinned
        # staging buffers, an event per buffer (its copy is done) and a side stream.
        self._staging: list[list[torch.Tensor]] = []
        self._staging_free: list[list[torch.cuda.Event]] = []
        self._copy_streams: list[torch.cuda.Stream] = []

    def _allocate_source(self) -> torch.Tensor:
        what = f"tier='{self.tier}' ({self.num_rows} rows of {self.row_bytes} B)"
        memory.require(what, self.nbytes, memory.host_available_bytes(), "host memory")
        return torch.empty((self.num_rows, self.row_bytes), dtype=torch.uint8)

    def _write(self, start: int, packed: torch.Tensor) -> None:
        self.source[start : start + packed.shape[0]].copy_(packed)

    # -- gathering ---------------------------------------------------------

    def _thread_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.num_threads,
                thread_name_prefix=f"engramrt-{self.tier}-gather",
                initializer=_single_threaded_worker,
            )
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def _split(self, count: int) -> list[tuple[int, int]]:
        """Contiguous ``[lo, hi)`` slices of ``count`` rows, one per gather task."""
        parts = min(self.num_threads, max(1, count // _MIN_ROWS_PER_TASK))
        bounds = [count * k // parts for k in range(parts + 1)]
        return list(itertools.pairwise(bounds))

    def _run_tasks(
        self, task: Callable[[int, int, int], None], slices: list[tuple[int, int]]
    ) -> None:
        """``task(worker, lo, hi)`` per slice: inline when there is one, else on the pool."""
        if len(slices) == 1:
            task(0, *slices[0])
            return
        pool = self._thread_pool()
        futures = [pool.submit(task, worker, lo, hi) for worker, (lo, hi) in enumerate(slices)]
        for future in futures:
            future.result()

    def _ensure_staging(self, workers: int) -> None:
        chunk = min(self.chunk_rows, max(self.num_rows, 1))
        while len(self._staging) < workers:
            self._staging.append(
                [
                    torch.empty((chunk, self.row_bytes), dtype=torch.uint8, pin_memory=True)
                    for _ in range(2)
                ]
            )
            self._staging_free.append([torch.cuda.Event(), torch.cuda.Event()])
            self._copy_streams.append(torch.cuda.Stream(self.device))

    def _gather_to_device(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``source[local_ids]`` as ``[U, row_bytes]`` uint8 on :attr:`device`."""
        unique_count = local_ids.shape[0]
        slices = self._split(unique_count)
        if self.device.type != "cuda":
            rows = torch.empty((unique_count, self.row_bytes), dtype=torch.uint8)

            def gather(worker: int, lo: int, hi: int) -> None:
                torch.index_select(self.source, 0, local_ids[lo:hi], out=rows[lo:hi])

            self._run_tasks(gather, slices)
            return rows if self.device.type == "cpu" else rows.to(self.device)

        self._ensure_staging(len(slices))
        rows = torch.empty((unique_count, self.row_bytes), dtype=torch.uint8, device=self.device)
        compute_stream = torch.cuda.current_stream(self.device)
        streams = self._copy_streams[: len(slices)]
        for stream in streams:
            # ``rows`` may reuse memory whose last reader is still queued on
            # the compute stream: the copies must start after it.
            stream.wait_stream(compute_stream)

        def gather_and_copy(worker: int, lo: int, hi: int) -> None:
            staging, staging_free = self._staging[worker], self._staging_free[worker]
            chunk = staging[0].shape[0]
            with torch.cuda.device(self.device), torch.cuda.stream(streams[worker]):
                for index, start in enumerate(range(lo, hi, chunk)):
                    slot = index % 2
                    stop = min(start + chunk, hi)
                    buffer = staging[slot][: stop - start]
                    staging_free[slot].synchronize()  # its previous copy has left the buffer
                    torch.index_select(self.source, 0, local_ids[start:stop], out=buffer)
                    rows[start:stop].copy_(buffer, non_blocking=True)
                    staging_free[slot].record(streams[worker])

        self._run_tasks(gather_and_copy, slices)
        for stream in streams:
            compute_stream.wait_stream(stream)
        return rows

    # -- lookup ------------------------------------------------------------

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens, num_cols = row_ids.shape
        owned = row_ids[:, self.col_begin : col_end].to(torch.int64) - self.row_begin
        if owned.numel() > 0:
            unique, inverse = torch.unique(owned, sorted=True, return_inverse=True)
        else:
            unique, inverse = owned.reshape(0), owned
        local_ids = unique.cpu()  # the host synchronisation of this tier
        if local_ids.numel() > 0 and (local_ids[0] < 0 or local_ids[-1] >= self.num_rows):
            check_row_ids_in_shard(row_ids, self.col_begin, col_end, self.row_begin, self.row_end)
        rows = self._gather_to_device(local_ids)  # [U, row_bytes] on the compute device
        compact_ids = torch.zeros((num_tokens, num_cols), dtype=torch.int64, device=self.device)
        compact_ids[:, self.col_begin : col_end] = inverse.to(self.device, non_blocking=True)
        return lookup_rows(
            compact_ids,
            rows,
            col_begin=self.col_begin,
            col_end=col_end,
            row_begin=0,
            out=out,
            backend=self.backend,
        )
