"""``EngramRuntime``: what an engine integrates, one object per model.

Each engine step makes one call, :meth:`EngramRuntime.step`, with its
batch. The runtime computes the row ids of every Engram layer in one launch
and starts every layer's rows at once; each of the model's Engram layers
(:attr:`EngramRuntime.layers`, when the runtime was given heads) is then
called at its block with ``hidden`` alone and waits only for its own rows::

    runtime.step(batch)                 # hash, start every layer's rows
    ...                                 # blocks before the first Engram layer
    hidden = runtime.layers[0](hidden)  # wait for layer 0's rows, wkv, gate
    ...
    hidden = runtime.layers[1](hidden)

How a layer's rows are started depends on its source's capability flags
(:mod:`engramrt.source`), never on which class it is:

- no :attr:`~engramrt.source.RowSource.host_sync` (device and UVA tiers,
  exchanges over them): the source runs on a side stream of the runtime's
  ``lookup_priority``, after an event that marks the hash ids ready; the
  layer's wait is a stream wait on the source's event (no host
  synchronisation, capturable in a CUDA graph);
- :attr:`~engramrt.source.RowSource.host_sync` (host and disk tiers, a
  cache, which plans its admissions on the host): a worker thread per layer
  runs it on a stream of its own; the layer's wait joins the thread's
  lookup, then waits on its event. A source's
  :meth:`~engramrt.source.RowSource.update` runs on the same thread and
  stream after every threaded lookup of the step (:func:`worker_jobs`), as
  a job of its own that the layer does not join: the layer's wait never
  includes an update's host synchronisation;
- :attr:`~engramrt.source.RowSource.collective` (exchanges): every rank
  must issue the collectives in the same order, so all collective sources
  run in layer order on one side stream, or, when any of them needs a host
  synchronisation, on one worker thread shared by them.

:meth:`EngramRuntime.prefetch` starts the next step's rows as soon as its
tokens exist (right after sampling), into the other of two staging slots,
so they overlap the rest of the current step; layers consume started steps
oldest first. Staging buffers are allocated once for ``max_tokens`` and
reused, so the addresses are fixed: a captured graph replays into the same
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engramrt.config import EngramConfig
from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, NgramHasher, RequestHistory, SlotHashCache
from engramrt.layer import EngramHead, EngramLayer
from engramrt.source import PendingRows, RowSource

__all__ = [
    "GPU_READS",
    "LOOKUP_WORKERS",
    "EngramRuntime",
    "StepRows",
    "worker_jobs",
    "worker_plan",
]

_T = TypeVar("_T")
_COLLECTIVE_WORKER = -1  # the worker key shared by collective sources that need a thread
_SHARED_WORKER = -2  # the worker key of every other threaded source, with lookup_workers="shared"
LOOKUP_WORKERS = ("per-layer", "shared")
"""How sources that need a thread are spread over worker threads (see :func:`worker_plan`)."""
GPU_READS = ("first", "all", "sources")
"""Which layers' small batches the GPU reads from host memory itself (see
:class:`EngramRuntime`, ``gpu_reads``)."""


def worker_plan(sources: Sequence[RowSource], *, shared: bool = False) -> dict[int, int]:
    """Which layers' sources run on a worker thread, and which thread: ``{layer: key}``.

    A source with :attr:`~engramrt.source.RowSource.host_sync` gets a worker
    of its own (a source owns its staging buffers and is used by one thread
    at a time, so a prefetch queues behind the same layer's previous lookup
    instead of racing it). Collective sources must issue their collectives
    in layer order on every rank: when any of them needs a thread, all of
    them share one worker (key -1); otherwise they stay on the side stream,
    which keeps the order too. Layers not in the plan run on the side stream.

    ``shared``: every non-collective source that needs a thread runs on one
    worker (key -2) instead, in layer order: the first Engram layer's lookup,
    the one with the fewest blocks to hide behind, then has the host's gather
    threads and the copy engine to itself instead of sharing them with the
    later layers' lookups, which have many more blocks to hide behind.
    """
    plan: dict[int, int] = {}
    threaded_collectives = any(s.collective and s.host_sync for s in sources)
    for index, source in enumerate(sources):
        if source.collective:
            if threaded_collectives:
                plan[index] = _COLLECTIVE_WORKER
        elif source.host_sync:
            plan[index] = _SHARED_WORKER if shared else index
    return plan


def worker_jobs(sources: Sequence[RowSource], plan: dict[int, int]) -> list[tuple[str, int]]:
    """The jobs one step submits to worker threads, in order: ``("fetch", layer)`` for
    every layer in ``plan``, then ``("update", layer)`` for those whose source
    :attr:`~engramrt.source.RowSource.has_update`.

    A layer's wait joins its fetch job only. Each worker runs its jobs in
    submission order, so a source's update follows its lookup on the same
    thread and stream, and on a worker shared by several layers no lookup
    queues behind another layer's update.
    """
    fetches = [("fetch", index) for index in range(len(sources)) if index in plan]
    updates = [("update", index) for _, index in fetches if sources[index].has_update]
    return fetches + updates


@dataclass
class StepRows:
    """The lookups of one step: row ids and, per layer, rows once ready.

    Attributes:
        row_ids: ``[T, L, C]`` row ids of every Engram layer (a view of the
            runtime's fixed buffer).
        num_tokens: T.
        slot: the staging slot the rows land in.
        pending: per layer, its :class:`~engramrt.source.PendingRows`.
    """

    row_ids: torch.Tensor
    num_tokens: int
    slot: int
    pending: list[PendingRows]

    def rows(self, layer_index: int) -> torch.Tensor:
        """``[T_local, C, E]`` bf16 rows of Engram layer ``layer_index`` (its position in
        the config), for an engine that runs its own head.

        The current stream waits for this layer's lookup only; other layers'
        lookups keep running.
        """
        if not 0 <= layer_index < len(self.pending):
            raise ValidationError(
                f"layer_index={layer_index} must be in [0, {len(self.pending)}) (Engram layers)"
            )
        return self.pending[layer_index].wait()


class EngramRuntime:
    """Hash ids, rows and (with heads) the Engram layers of one model.

    Args:
        hasher: the :class:`NgramHasher` of the model's layout.
        sources: one :class:`~engramrt.source.RowSource` per Engram layer
            (a store, a cache, an exchange), all on the hasher's device.
        max_tokens: the most tokens one step may hold (sizes the staging).
        max_requests: the most requests one step may hold.
        history: a :class:`SlotHashCache`, a :class:`RequestHistory`, or
            None when batches carry ``lookback_token_ids``.
        heads: optional, one :class:`~engramrt.layer.EngramHead` (or an
            :class:`EngramConfig` to build an unloaded one) per layer; then
            :attr:`layers` holds the model's Engram layers, fed by the
            runtime.
        validate: the layers' host-side shape checks (never synchronise).
            The hasher's own checks are the hasher's settings.
        num_slots: staging slots; 2 lets a prefetch overlap the current step.
        lookup_priority: CUDA stream priority of the side streams the
            lookups run on (lower numbers are higher priority in torch). The
            default, 0, is the lowest, the same as a default stream's: an
            engine that runs its model on a higher-priority stream keeps
            precedence over the lookups.
        lookup_workers: ``"per-layer"`` (default): a worker thread per layer
            whose source needs one (host and disk tiers, caches), so the
            layers' lookups run at once; ``"shared"``: one thread for all of
            them, in layer order, so the first layer's lookup runs alone (see
            :func:`worker_plan`). Collective sources keep their own rule.
        gpu_reads: for sources that can read a small batch's rows from host
            memory either with the GPU or by a CPU gather and a bulk copy
            (:meth:`~engramrt.source.RowSource.use_gpu_reads`: the ``host``
            tier): ``"first"`` (default), GPU reads for the first Engram layer
            only, whose rows have the fewest blocks to hide behind, and the
            CPU's gather for the later ones, which have time for it; ``"all"``:
            GPU reads everywhere; ``"sources"``: each source as it was built.
            The choice is set on the sources when the runtime is built
            (sources shared with another runtime take the later one's).
            GPU reads in flight slow the blocks running beside them; on one
            H200, decode of 256 tokens with host-memory tables cost 1.1-1.7%
            with ``"first"`` against 3.7-4.4% with ``"all"``
            (BENCHMARKS.md, "Step cost with host-memory tables").

    Attributes:
        layers: the Engram layers (empty without ``heads``).
    """

    def __init__(
        self,
        hasher: NgramHasher,
        sources: Sequence[RowSource],
        *,
        max_tokens: int,
        max_requests: int,
        history: SlotHashCache | RequestHistory | None = None,
        heads: Sequence[EngramHead | EngramConfig] | None = None,
        validate: bool = True,
        num_slots: int = 2,
        lookup_priority: int = 0,
        lookup_workers: str = "per-layer",
        gpu_reads: str = "first",
    ) -> None:
        consts = hasher.consts
        if len(sources) != consts.n_layers:
            raise ValidationError(
                f"sources has {len(sources)} entries; expected one per Engram layer "
                f"({consts.n_layers})"
            )
        for index, source in enumerate(sources):
            if not isinstance(source, RowSource):
                raise ValidationError(
                    f"sources[{index}] is a {type(source).__name__}; expected a RowSource (a "
                    f"store from make_store, a CachedRowStore or an exchange)"
                )
        for name, value in (
            ("max_tokens", max_tokens),
            ("max_requests", max_requests),
            ("num_slots", num_slots),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError(f"{name}={value!r} must be a positive integer")
        if lookup_workers not in LOOKUP_WORKERS:
            raise ValidationError(
                f"lookup_workers={lookup_workers!r}; expected one of {', '.join(LOOKUP_WORKERS)}"
            )
        if gpu_reads not in GPU_READS:
            raise ValidationError(
                f"gpu_reads={gpu_reads!r}; expected one of {', '.join(GPU_READS)}"
            )
        devices = {s.device for s in sources}
        if devices != {hasher.device}:
            raise ValidationError(
                f"sources compute on {sorted(map(str, devices))} but the hasher runs on "
                f"{hasher.device}; expected one device"
            )
        head_dims = {s.E for s in sources}
        if len(head_dims) != 1:
            raise ValidationError(f"sources have head dims {sorted(head_dims)}; expected one E")
        if heads is not None and len(heads) != consts.n_layers:
            raise ValidationError(
                f"heads has {len(heads)} entries; expected one per Engram layer ({consts.n_layers})"
            )
        self.hasher = hasher
        self.sources = list(sources)
        self.gpu_reads = gpu_reads
        if gpu_reads != "sources":
            for index, source in enumerate(self.sources):
                source.use_gpu_reads(gpu_reads == "all" or index == 0)
        self.device = hasher.device
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.history = history
        self.n_layers = consts.n_layers
        self.n_cols = consts.n_cols
        self.head_dim = head_dims.pop()
        self.num_slots = num_slots
        self.layers: list[EngramLayer] = [
            EngramLayer(head, source, max_tokens=max_tokens, validate=validate, rows_buffer=False)
            for head, source in zip(heads or [], self.sources, strict=False)
        ]
        self.row_ids = [
            torch.empty(
                (max_tokens, self.n_layers, self.n_cols), dtype=hasher.out_dtype, device=self.device
            )
            for _ in range(num_slots)
        ]
        self.staging = [
            [
                torch.empty(
                    (s.local_tokens(max_tokens), self.n_cols, self.head_dim),
                    dtype=torch.bfloat16,
                    device=self.device,
                )
                for s in self.sources
            ]
            for _ in range(num_slots)
        ]
        self._next_slot = 0
        cuda = self.device.type == "cuda"
        self._lookup_stream = (
            torch.cuda.Stream(self.device, priority=lookup_priority) if cuda else None
        )
        self.lookup_workers = lookup_workers
        self._worker_of = (
            worker_plan(self.sources, shared=lookup_workers == "shared") if cuda else {}
        )
        self._workers = {
            key: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engramrt-rows-{key}")
            for key in set(self._worker_of.values())
        }
        self._worker_streams = {
            key: torch.cuda.Stream(self.device, priority=lookup_priority) for key in self._workers
        }
        self._jobs = worker_jobs(self.sources, self._worker_of)
        self._updates: list[Future[None]] = []

    # -- steps -------------------------------------------------------------

    def _check(self, batch: HashBatch) -> None:
        if batch.num_tokens > self.max_tokens:
            raise ValidationError(
                f"the batch has {batch.num_tokens} tokens; this runtime was sized for "
                f"max_tokens={self.max_tokens}"
            )
        if batch.num_requests > self.max_requests:
            raise ValidationError(
                f"the batch has {batch.num_requests} requests; this runtime was sized for "
                f"max_requests={self.max_requests}"
            )
        for index, layer in enumerate(self.layers):
            if layer.pending_steps >= self.num_slots:
                raise ValidationError(
                    f"Engram layer {index} has not consumed the rows of {layer.pending_steps} "
                    f"started steps; a new step would overwrite them (num_slots={self.num_slots}): "
                    f"call every layer once per step"
                )

    def step(self, batch: HashBatch) -> StepRows:
        """Hash ``batch`` and start every layer's rows; returns handles to them.

        With :attr:`layers`, each layer also receives its rows: call
        ``runtime.layers[i](hidden)`` at its block. The checks against
        ``max_tokens`` / ``max_requests`` read only tensor shapes (no device
        synchronisation), so they always run.
        """
        self._check(batch)
        self._raise_failed_updates()
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.num_slots
        num_tokens = batch.num_tokens
        row_ids = self.row_ids[slot][:num_tokens]
        self.hasher(batch, self.history, out=row_ids)
        ready = None  # marks the hash ids done, for the worker threads' streams
        if self._workers:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        pending = []
        for index, source in enumerate(self.sources):
            out = self.staging[slot][index][: source.local_tokens(num_tokens)]
            rows = self._start(index, source, row_ids[:, index], out, ready)
            pending.append(rows)
            if self.layers:
                self.layers[index].receive(rows)
        for job, index in self._jobs:
            if job == "update":  # after every threaded lookup of the step; nobody joins it
                key = self._worker_of[index]
                self._updates.append(
                    self._workers[key].submit(
                        self._update_on_worker, self.sources[index], self._worker_streams[key]
                    )
                )
        return StepRows(row_ids=row_ids, num_tokens=num_tokens, slot=slot, pending=pending)

    def _raise_failed_updates(self) -> None:
        """Raise the error of an update that failed (the layers do not join updates);
        forget the updates that finished."""
        finished: list[Future[None]] = []
        running: list[Future[None]] = []
        for future in self._updates:
            (finished if future.done() else running).append(future)
        self._updates = running
        for future in finished:
            error = future.exception()
            if error is not None:
                raise error

    prefetch = step
    """Start the next step's rows now (an alias of :meth:`step`: the staging
    slots alternate, so the current step's rows stay valid until the step
    after the prefetched one, and layers consume started steps in order)."""

    def _start(
        self,
        index: int,
        source: RowSource,
        ids: torch.Tensor,
        out: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> PendingRows:
        key = self._worker_of.get(index)
        if key is None:
            # A side-stream source, ordered after the hashing queued so far (on a
            # CPU device there is no stream: in order, now).
            return source.start(ids, out, stream=self._lookup_stream)
        assert ready is not None
        done = torch.cuda.Event()
        future = self._workers[key].submit(
            self._run_on_worker, source, ids, out, ready, self._worker_streams[key], done
        )
        return PendingRows(out, ids.shape[0], event=done, future=future, keep_alive=(ids,))

    def _run_on_worker(
        self,
        source: RowSource,
        ids: torch.Tensor,
        out: torch.Tensor,
        ready: torch.cuda.Event,
        stream: torch.cuda.Stream,
        done: torch.cuda.Event,
    ) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            source.fetch(ids, out)
            done.record(stream)

    def _update_on_worker(self, source: RowSource, stream: torch.cuda.Stream) -> None:
        """A source's update, on its lookup's thread and stream: queued after the step's
        lookups, so the layers' waits (which join the lookups only) never include it;
        the source's next lookup queues behind it."""
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            source.update(stream)

    def in_order(self, layer_index: int, call: Callable[[], _T]) -> _T:
        """Run ``call`` after the lookups of layer ``layer_index`` queued so far.

        On the layer's worker thread when it has one (so it never races a
        lookup), else now.
        """
        key = self._worker_of.get(layer_index)
        if key is None:
            return call()
        return self._workers[key].submit(call).result()

    def cache_stats(self) -> list[Any]:
        """Per Engram layer, its source's counters (a cache's :class:`CacheStats`;
        None for a source that keeps none).

        Read after the lookups queued so far, so counts never race a
        lookup; synchronises with the device.
        """
        return [self.in_order(index, source.stats) for index, source in enumerate(self.sources)]

    def close(self) -> None:
        """Stop the worker threads (after their queued lookups and updates finish); raises
        the error of an update that failed."""
        for worker in self._workers.values():
            worker.shutdown(wait=True)
        self._workers = {}
        self._worker_of = {}
        self._jobs = []
        self._raise_failed_updates()
