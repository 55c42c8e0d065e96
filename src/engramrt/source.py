"""``RowSource``: where one Engram layer's rows come from, one step at a time.

Every way of producing a layer's rows ``[T, C, E]`` (bf16, dequantised)
is a row source: each storage tier (:class:`~engramrt.lookup.tiers.RowStore`),
the hot-row cache in front of one, and the parallel exchanges that rebuild
rows from other ranks' column shards (:mod:`engramrt.exchange`). A layer's
head (:class:`~engramrt.layer.EngramHead`) takes rows as input and does not
care which source made them; :class:`~engramrt.layer.EngramLayer` is a head
plus a source, and :class:`~engramrt.runtime.EngramRuntime` starts every
layer's source at once and hands each layer its rows when it runs.

The contract has two halves:

- :meth:`RowSource.fetch` ``(row_ids [T, C], out [T_local, C, E])`` writes
  the rows on the current stream. ``T_local`` is
  :meth:`RowSource.local_tokens` of ``T``: ``T``, or this rank's token share
  under sequence parallelism;
- :meth:`RowSource.start` runs ``fetch`` now, or on a side stream, and
  returns :class:`PendingRows`, whose :meth:`PendingRows.wait` makes the
  caller's stream wait for the rows and returns them.

Capability flags tell a scheduler how a source may be run, so that no
caller needs to know which class it holds:

- :attr:`RowSource.host_sync`: a lookup (or its :meth:`RowSource.update`)
  makes the host wait for the device (it must learn the ids: the host and
  disk tiers, the cache's admission). Such a source cannot be captured in a
  CUDA graph and an engine runs it on a worker thread; otherwise it runs on
  a side stream.
- :attr:`RowSource.has_update`: :meth:`RowSource.update` has work to do after
  each lookup, off the layer's path (a cache admitting the rows it missed).
- :attr:`RowSource.collective`: every rank of a process group must call
  ``fetch`` in the same order (the exchanges); a scheduler must issue all
  such sources from one thread, in layer order.
- :attr:`RowSource.host_ids`: ``fetch`` also takes row ids on the host (a
  CPU tensor) and then never waits for the device: the CPU gathers the rows
  from ids it already has (the host and disk tiers). A scheduler that can
  hash a step on the host hands them over (a step's host mirror,
  :attr:`~engramrt.step.EngineStep.host`).
- :attr:`RowSource.splits_lookup`: a lookup's transfers (copies, host
  functions) can be queued apart from its kernels:
  :meth:`RowSource.queue_copies` queues the first on the current stream and
  returns the function that queues the second on the caller's (the host tiers'
  queued gather). A scheduler then keeps the kernels off the streams beside the
  model's blocks (``EngramRuntime(lookup_overlap="copies")`` or ``"layer"``).

A scheduler may also ask a source how to read small batches from host memory
(:meth:`RowSource.use_gpu_reads`); sources with one way ignore it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PendingRows", "RowSource"]


@dataclass
class PendingRows:
    """Rows of one step that a source started and nobody has waited for yet.

    Attributes:
        rows: ``[T_local, C, E]`` bf16 where the rows land.
        num_tokens: ``T``, the tokens of the step's row ids.
        event: a CUDA event recorded after the rows were written, or None
            when they were written on the caller's stream (or the CPU).
        future: a worker thread's lookup to join first, or None.
        keep_alive: tensors the lookup still reads (the row ids), held so the
            caching allocator cannot hand their memory out before the wait.
        deferred: the lookup itself, not started yet: the first :meth:`wait`
            runs it on the waiting thread and current stream (a scheduler's
            deferred lookups, ``EngramRuntime(lookup_overlap="deferred")``).
    """

    rows: torch.Tensor
    num_tokens: int
    event: Any = None
    future: Future[Any] | None = None
    keep_alive: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    deferred: Callable[[], Any] | None = None

    def wait(self) -> torch.Tensor:
        """The rows, once the caller's current stream is ordered after them.

        Runs a deferred lookup first (once), then joins the worker thread
        (when there is one: its host work must have issued the copies), then
        makes the current stream wait for the event. No host synchronisation
        on the device work itself, but for what a deferred lookup does.
        """
        if self.deferred is not None:
            lookup, self.deferred = self.deferred, None
            lookup()
        if self.future is not None:
            self.future.result()
        if self.event is not None:
            torch.cuda.current_stream(self.rows.device).wait_event(self.event)
        return self.rows


class RowSource(ABC):
    """Rows ``[T, C, E]`` of one Engram layer from row ids ``[T, C]``.

    Attributes:
        E: values per row (``engram_head_dim``).
        device: the device the rows are written on.
        host_sync, has_update, collective, host_ids, splits_lookup: capability flags (see
            the module doc).
    """

    E: int
    device: torch.device
    host_sync: bool = False
    has_update: bool = False
    collective: bool = False
    host_ids: bool = False
    splits_lookup: bool = False

    def served_columns(self, num_cols: int) -> tuple[int, int]:
        """Hash columns ``[begin, end)`` of ``num_cols`` whose rows this source returns
        (the others read as zeros): a column shard's store serves its own, an
        exchange all of them."""
        return 0, num_cols

    def local_tokens(self, num_tokens: int) -> int:
        """Tokens of rows this source writes for a step of ``num_tokens`` row-id tokens."""
        return num_tokens

    @abstractmethod
    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write the rows of ``row_ids [T, C]`` on the current stream.

        ``out``, when given, is contiguous bf16 ``[local_tokens(T), C, E]`` on
        :attr:`device`; returns it (or a new tensor).
        """

    def queue_copies(
        self, row_ids: torch.Tensor, out: torch.Tensor | None = None, *, in_flight: int = 1
    ) -> Callable[[], torch.Tensor]:
        """:meth:`fetch` in two halves (a source with :attr:`splits_lookup`): queue its
        copies and host functions on the current stream now, no kernel among them, and
        return the function that queues the rest, its kernels, on the stream current
        when it is called, which must be ordered after the stream current now (after
        waiting for an event recorded there). The same arguments and checks as
        :meth:`fetch`; the function returns what :meth:`fetch` would. ``in_flight``: how
        many of this source's lookups may be queued whose functions have not been
        called yet (the source keeps buffers for each). A source without the
        capability runs the whole of :meth:`fetch` in the returned function."""
        return lambda: self.fetch(row_ids, out)

    def update(self, stream: torch.cuda.Stream | None = None) -> None:  # noqa: B027
        """Work due after a lookup, off the layer's path (see :attr:`has_update`)."""

    def stats(self) -> Any:
        """The source's own counters (a cache's hits and misses), or None when it keeps none."""
        return None

    def use_gpu_reads(self, on: bool) -> bool:
        """Ask for small batches' rows to be read from host memory by the GPU itself
        (``on``) or gathered by the CPU and copied in bulk (off); returns whether the
        source has that choice (False: it has one way, and the request changes nothing).

        GPU reads need no host synchronisation and finish sooner, but while they are
        in flight they slow the model running beside them; the CPU's gather costs the
        GPU only a bulk copy but must wait for the ids, on a thread beside the one
        launching the model. A scheduler (:class:`~engramrt.runtime.EngramRuntime`,
        ``gpu_reads``) asks for GPU reads in every layer, or only where the rows are
        needed soonest (the first Engram layer) and for the CPU's gather elsewhere.
        """
        return False

    def use_waited_gathers(self, on: bool) -> bool:
        """Tell the source whether its CPU gathers run on the thread that waits for their
        rows (``on``: a lookup deferred to its layer, ``EngramRuntime(lookup_overlap=
        "deferred")``, which that thread runs while it does nothing else) or beside the
        thread launching the model (off: a worker thread); returns whether the source has
        that choice. A gather on several CPU threads takes as many as the batch can use
        when on; off, decode batches take few, as they would compete with the launching
        thread (the ``host`` tier: :data:`~engramrt.lookup.tiers.host_gather.ROWS_PER_WAITED_GATHER_THREAD`)."""
        return False

    def waits_on_host(self, row_ids: torch.Tensor) -> bool:
        """Whether a lookup of ``row_ids [T, C]`` makes the host wait for the device
        (:attr:`host_sync` for this batch); reads shapes and settings only. A source whose
        small batches are read by the GPU itself (the ``host`` tier with
        :meth:`use_gpu_reads`) waits for large batches only; a scheduler may run a
        lookup that does not wait where it likes (``EngramRuntime(lookup_overlap="none")``
        runs it on the step's stream at plan, ``"layer"`` on the step's stream at its
        layer)."""
        return self.host_sync

    def start(
        self,
        row_ids: torch.Tensor,
        out: torch.Tensor,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> PendingRows:
        """Start writing the rows of ``row_ids`` into ``out``; :meth:`PendingRows.wait` joins.

        Args:
            row_ids: ``[T, C]`` int32/int64.
            out: contiguous bf16 ``[local_tokens(T), C, E]`` on :attr:`device`.
            stream: a CUDA stream to run on: it first waits for the work
                queued on the current stream (the hashing that made
                ``row_ids``, the previous reader of ``out``). None: run on
                the current stream now.
        """
        if stream is None:
            self.fetch(row_ids, out)
            if self.has_update:
                self.update()
            return PendingRows(out, row_ids.shape[0])
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            return self.start_on(row_ids, out, stream)

    def start_on(
        self, row_ids: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream
    ) -> PendingRows:
        """:meth:`start` on ``stream`` for a caller that has already made ``stream``
        current and ordered it after the work that makes ``row_ids`` and last reads
        ``out`` (a scheduler that starts several sources on one side stream does that
        once for all of them: :class:`~engramrt.runtime.EngramRuntime`). Runs
        :meth:`fetch` (and :meth:`update`), records the rows' event on ``stream``."""
        done = torch.cuda.Event()
        self.fetch(row_ids, out)
        done.record(stream)
        if self.has_update:
            self.update(stream)
        return PendingRows(out, row_ids.shape[0], event=done, keep_alive=(row_ids,))
