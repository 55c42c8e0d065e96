"""``EngramRuntime``: what an engine integrates, one object per model.

The runtime splits an engine step in two, the way attention backends do
(flashinfer's ``plan()`` / ``run()``):

- :meth:`EngramRuntime.plan` ``(batch)``, once per step on the host, with
  the batch an adapter returns (:mod:`engramrt.adapters`): the checks, the
  staging slot, the one hash launch of every Engram layer's row ids, and
  every layer's lookup started (on a side stream or a CPU worker). It never
  waits on the device.
- :meth:`EngramRuntime.run` ``(layer, hidden)``, at the layer's block: device
  work only. It waits for that layer's rows through events (and, for a
  source that needs a CPU worker, by joining the worker's host work, which
  issued the copies), then runs ``wkv`` and the fused gate into the layer's
  fixed output buffer. :attr:`EngramRuntime.layers` are ``nn.Module`` skins
  over it for a model's block list::

    plan = runtime.plan(batch)           # hash, start every layer's rows
    ...                                  # blocks before the first Engram layer
    hidden = runtime.run(0, hidden)      # or runtime.layers[0](hidden)
    ...
    hidden = runtime.run(1, hidden)
    ...                                  # sample, then at once:
    runtime.prefetch(next_batch)         # plan the next step into the other slot

Fixed addresses. Row ids and rows live in buffers allocated once for
``max_tokens`` and reused, and each head keeps its outputs the same way
(:meth:`~engramrt.protocols.LayerHead.reserve`); a step writes leading slices of
them, so its addresses depend only on the staging slot and ``T``:
:meth:`~EngramRuntime.staged_row_ids`, :meth:`~EngramRuntime.staged_rows` and
:meth:`~EngramRuntime.output_buffer` give them to an engine that captures
graphs. Pieces of a model captured between Engram layers replay around
eager ``run`` calls (piecewise); where every source can run without a host
synchronisation, ``plan`` and ``run`` can be captured in one graph with the
whole step, one graph per staging slot (the slots alternate).

How a layer's rows are started depends on its source's capability flags
(:mod:`engramrt.source`), never on which class it is:

- no :attr:`~engramrt.source.RowSource.host_sync` (device and UVA tiers,
  exchanges over them): the source runs on a side stream of the runtime's
  ``lookup_priority``, after the hashing; ``run`` waits on the source's
  event (no host synchronisation, capturable in a CUDA graph);
- :attr:`~engramrt.source.RowSource.host_sync` (host and disk tiers, a
  cache, which plans its admissions on the host): a worker thread runs it on
  a stream of its own; ``run`` joins the thread's lookup, then waits on its
  event. A source's :meth:`~engramrt.source.RowSource.update` runs on the
  same thread and stream after every threaded lookup of the step
  (:func:`worker_jobs`), as a job of its own that ``run`` does not join.
  A batch such a source serves without a host wait (the host tier's GPU
  reads of a decode step: :meth:`~engramrt.source.RowSource.waits_on_host`
  False) starts on the side stream from the planning thread instead, when
  the source has no update and no lookup of it is still on its worker: the
  hand-off to the thread and back would cost the step more than the read
  (BENCHMARKS.md, "Step cost in each engine mode");
- with ``lookup_overlap="deferred"``, sources that gather rows on the CPU
  (:func:`deferrable`) start nowhere at plan: ``plan`` queues one copy of
  the step's ids to the host, and a layer's lookup runs on the thread that
  first waits for its rows, at the layer;
- with ``lookup_overlap="copies"``, sources that can split a lookup
  (:attr:`~engramrt.source.RowSource.splits_lookup`: the host tiers' queued
  gather) queue only its copies and host functions on the side stream at
  plan (:meth:`~engramrt.source.RowSource.queue_copies`), and a layer's
  kernel (the dequantisation) runs on the thread and stream that first wait
  for its rows, at the layer;
- with ``lookup_overlap="layer"``, split sources as with ``"copies"`` (their
  GPU reads kept), and a lookup that makes the host wait for nothing (GPU
  memory, the host tier's GPU reads of a decode step) runs whole on the
  thread and stream that first wait for its rows, at the layer: no lookup
  kernel runs beside the blocks;
- :attr:`~engramrt.source.RowSource.collective` (exchanges): every rank
  must issue the collectives in the same order, so all collective sources
  run in layer order on one side stream, or, when any of them needs a host
  synchronisation, on one worker thread shared by them.

Ownership. A :class:`StepPlan` owns its layers' pending rows.
:meth:`EngramRuntime.run` runs each layer of each plan once, oldest plan
first; :meth:`StepPlan.rows` waits for and returns a layer's rows (an engine
that runs its own head builds the runtime without heads). With heads, at most
``num_slots`` planned steps may have layers not yet run: a further ``plan``
would overwrite their rows, and is refused.

Threads. A runtime is one engine's step loop: its staging slots alternate
per ``plan``, so plans from two threads at once would hash into the same
slot and hand each other's row ids back. The first thread that calls
:meth:`EngramRuntime.plan` owns the runtime; ``plan`` from any other thread
is refused (a :class:`~engramrt.errors.ValidationError` naming both threads)
before it touches a buffer. An engine that moves its step loop to another
thread (a new scheduler thread, a restarted worker) calls
:meth:`EngramRuntime.bind_thread` from that thread once the old one has
stopped planning. :meth:`~EngramRuntime.run` and :meth:`StepPlan.rows`
belong to the same step loop.

Custom operators (:mod:`engramrt.custom_ops`) reach the same object through
:attr:`EngramRuntime.handle`: a compiled model calls the same ``plan`` and
``run``.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from engramrt.config import EngramConfig
from engramrt.errors import ValidationError, check_choice
from engramrt.layer.module import check_hidden, pair_head_with_source
from engramrt.protocols import HostRowIdMaker, LayerHead, RowIdMaker
from engramrt.source import PendingRows, RowSource
from engramrt.step import EngineStep

__all__ = [
    "GPU_READS",
    "LOOKUP_OVERLAP",
    "LOOKUP_WORKERS",
    "VIEW_CACHE_SIZE",
    "EngramRuntime",
    "RuntimeLayer",
    "StepPlan",
    "deferrable",
    "lookup_cpu_set",
    "lookup_worker",
    "runtime_from_handle",
    "worker_jobs",
    "worker_plan",
]

_T = TypeVar("_T")
_COLLECTIVE_WORKER = -1  # the worker key shared by collective sources that need a thread
_SHARED_WORKER = -2  # the worker key of every other threaded source, with lookup_workers="shared"
VIEW_CACHE_SIZE = 256
"""(staging slot, step size) sets of views :meth:`EngramRuntime.plan` keeps before it clears
them (:attr:`EngramRuntime.cached_views`)."""
LOOKUP_WORKERS = ("per-layer", "shared")
"""How sources that need a thread are spread over worker threads (see :func:`worker_plan`)."""
GPU_READS = ("first", "all", "sources")
"""Which layers' small batches the GPU reads from host memory itself (see
:class:`EngramRuntime`, ``gpu_reads``)."""
LOOKUP_OVERLAP = ("side", "none", "deferred", "copies", "layer")
"""Where the lookups of sources without a worker thread run (see :class:`EngramRuntime`,
``lookup_overlap``)."""


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


def deferrable(source: RowSource) -> bool:
    """Whether ``source``'s lookups can be deferred to its layer
    (``EngramRuntime(lookup_overlap="deferred")``): it gathers rows on the CPU from ids
    it may be given on the host (:attr:`~engramrt.source.RowSource.host_ids`, the host
    and disk tiers), makes the host wait for them otherwise, and has no update to run
    after a lookup and no collective to order."""
    return source.host_ids and source.host_sync and not source.has_update and not source.collective


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


_HANDLES: weakref.WeakValueDictionary[int, EngramRuntime] = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


def runtime_from_handle(handle: int) -> EngramRuntime:
    """The live runtime whose :attr:`EngramRuntime.handle` is ``handle``.

    Custom operators take the handle (an int the compiler can bake into a
    graph) instead of the object; the table holds runtimes weakly, so a
    handle never keeps a runtime alive.
    """
    try:
        return _HANDLES[handle]
    except (KeyError, TypeError):
        raise ValidationError(
            f"handle={handle!r} names no live EngramRuntime; expected runtime.handle of a "
            f"runtime that still exists"
        ) from None


@dataclass
class StepPlan:
    """One planned step: its row ids and, per layer, rows once ready.

    Attributes:
        row_ids: ``[T, L, C]`` row ids of every Engram layer (a view of the
            runtime's fixed :meth:`~EngramRuntime.staged_row_ids`).
        num_tokens: T.
        slot: the staging slot the rows land in.
        pending: per layer, its :class:`~engramrt.source.PendingRows`.
        step: the :class:`~engramrt.step.EngineStep` planned (the heads read it).
    """

    row_ids: torch.Tensor
    num_tokens: int
    slot: int
    pending: list[PendingRows]
    step: EngineStep | None = None
    _ran: list[bool] = field(default_factory=list, repr=False)

    def rows(self, layer_index: int) -> torch.Tensor:
        """``[T_local, C, E]`` bf16 rows of Engram layer ``layer_index`` (its position in
        the config), for an engine that runs its own head (a runtime built without
        heads) or a check.

        The current stream waits for this layer's lookup only; other layers'
        lookups keep running. The tensor is a view of the fixed
        :meth:`~EngramRuntime.staged_rows` of this slot, valid until a later
        plan reuses the slot.
        """
        if not 0 <= layer_index < len(self.pending):
            raise ValidationError(
                f"layer_index={layer_index} must be in [0, {len(self.pending)}) (Engram layers)"
            )
        return self.pending[layer_index].wait()

    @property
    def done(self) -> bool:
        """Whether :meth:`EngramRuntime.run` has run every layer of this step."""
        return all(self._ran)


class RuntimeLayer(nn.Module):
    """Engram layer ``index`` of a runtime, as a module for a model's block list:
    ``layer(hidden)`` is ``runtime.run(index, hidden)``.

    Attributes:
        head: the layer's head (a :class:`~engramrt.protocols.LayerHead`: its weights).
        index: the layer's position among the model's Engram layers.
    """

    def __init__(self, runtime: EngramRuntime, index: int, head: LayerHead) -> None:
        super().__init__()
        self.head = head
        self.index = index
        self._runtime = weakref.ref(runtime)  # the runtime owns its layers, not the reverse

    @property
    def source(self) -> RowSource:
        """Where this layer's rows come from."""
        return self._runtime_or_raise().sources[self.index]

    def load_weights(self, **weights: Any) -> None:
        """The head's ``load_weights`` (:meth:`~engramrt.layer.EngramHead.load_weights`)."""
        self.head.load_weights(**weights)

    def forward(
        self,
        hidden: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """:meth:`EngramRuntime.run` of this layer."""
        return self._runtime_or_raise().run(
            self.index, hidden, token_mask, out=out, return_kv=return_kv
        )

    def _runtime_or_raise(self) -> EngramRuntime:
        runtime = self._runtime()
        if runtime is None:
            raise ValidationError(f"Engram layer {self.index}: its EngramRuntime no longer exists")
        return runtime

    def extra_repr(self) -> str:
        return f"index={self.index}"


def lookup_cpu_set(cpus: Collection[int], name: str = "lookup_cpus") -> frozenset[int]:
    """``cpus`` checked as a set of CPUs a thread of this process may be moved to: a
    non-empty collection of CPU numbers, each one this process may run on
    (``os.sched_getaffinity``; Linux only)."""
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - not Linux
        raise ValidationError(f"{name} needs os.sched_setaffinity (Linux); leave it None here")
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Collection):
        raise ValidationError(
            f"{name}={cpus!r}; expected a collection of CPU numbers, e.g. range(1, 16)"
        )
    wrong = [c for c in cpus if isinstance(c, bool) or not isinstance(c, int)]
    if wrong:
        raise ValidationError(f"{name} holds {wrong[0]!r}; expected CPU numbers (ints)")
    allowed = os.sched_getaffinity(0)
    chosen = frozenset(cpus)
    if not chosen:
        raise ValidationError(
            f"{name} is empty; expected at least one of the CPUs this process may use "
            f"({_cpu_ranges(allowed)})"
        )
    outside = sorted(chosen - allowed)
    if outside:
        raise ValidationError(
            f"{name} names CPUs {_cpu_ranges(outside)}, which this process may not use; "
            f"expected CPUs of {_cpu_ranges(allowed)}"
        )
    return chosen


def _cpu_ranges(cpus: Collection[int]) -> str:
    """``0-3,8`` for {0, 1, 2, 3, 8}."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def lookup_worker(name: str, cpus: frozenset[int] | None = None) -> ThreadPoolExecutor:
    """A lookup worker: one thread named ``name``, run on ``cpus`` when given (moved there
    before its first job, so every thread it starts, a gather's included, starts there)."""
    if cpus is None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=os.sched_setaffinity, initargs=(0, cpus)
    )


class EngramRuntime:
    """Hash ids, rows and (with heads) the Engram layers of one model.

    Args:
        hasher: the model's row-id maker (a :class:`~engramrt.protocols.RowIdMaker`:
            the :class:`~engramrt.hashing.NgramHasher` of its layout).
        sources: one :class:`~engramrt.source.RowSource` per Engram layer
            (a store, a cache, an exchange), all on the hasher's device.
        max_tokens: the most tokens one step may hold (sizes the staging).
        max_requests: the most requests one step may hold.
        history: the id maker's history object (for the hasher a
            :class:`~engramrt.hashing.SlotHashCache` or a
            :class:`~engramrt.hashing.RequestHistory`), or None when batches
            carry ``lookback_token_ids``.
        heads: optional, one head per layer (a :class:`~engramrt.protocols.LayerHead`
            such as :class:`~engramrt.layer.EngramHead`, or an
            :class:`EngramConfig` to build an unloaded ``EngramHead``); then
            :meth:`run` and :attr:`layers` compute the model's Engram layers.
        validate: host-side checks of ``hidden`` in :meth:`run` and of the
            heads' and gate's arguments (shapes, dtypes, devices; they never
            synchronise). The checks that keep the fixed buffers in bounds
            (``max_tokens``, ``max_requests``, unconsumed steps) read host
            ints only and always run. The hasher's own checks are the
            hasher's settings.
        num_slots: staging slots; 2 lets a prefetch overlap the current step.
        lookup_priority: CUDA stream priority of the side streams the
            lookups run on (lower numbers are higher priority in torch). The
            default, 0, is the lowest, the same as a default stream's: an
            engine that runs its model on a higher-priority stream keeps
            precedence over the lookups.
        lookup_workers: ``"shared"`` (default): one worker thread for every
            layer whose source needs one (host and disk tiers, caches), in layer
            order, so the first layer's lookup runs alone and fewer threads
            contend with the one launching the model; ``"per-layer"``: a worker
            thread per such layer, so the layers' lookups run at once (see
            :func:`worker_plan`). Collective sources keep their own rule. One
            thread cost less of a decode step with host tables than one per layer
            (BENCHMARKS.md, "One lookup thread at decode").
        gpu_reads: for sources that can read a small batch's rows from host
            memory either with the GPU or by a CPU gather and a bulk copy
            (:meth:`~engramrt.source.RowSource.use_gpu_reads`: the ``host``
            tier): ``"all"`` (default), GPU reads for every Engram layer's small
            batches (a decode step), started from the planning thread with no
            host wait; ``"first"``, GPU reads for the first Engram layer only,
            whose rows have the fewest blocks to hide behind, and the CPU's
            gather on a worker thread for the later ones; ``"sources"``: each
            source as it was built. Large batches (prefill) are gathered by the
            CPU either way. The choice is set on the sources when the runtime is
            built (sources shared with another runtime take the later one's).
            GPU reads in flight slow the blocks running beside them, but the
            CPU's gather costs the thread launching the model more where the
            engine's host time is on the step's path (compiled and piecewise
            modes): measured in BENCHMARKS.md, "Step cost in each engine mode".
        lookup_overlap: where lookups that make the host wait for nothing (GPU
            memory; a batch the GPU reads from host memory itself, see
            :meth:`~engramrt.source.RowSource.waits_on_host`) run: ``"side"``
            (default) on a side stream or the source's worker, beside the blocks
            before each Engram layer; ``"none"`` on the step's stream inside
            :meth:`plan` (after the jobs the source's worker has queued; a source
            with an update, a cache, stays on its worker), so they
            finish before the blocks queued after it start. ``"none"`` adds the
            lookups' time and their host work to the step but keeps GPU reads of
            host memory from running beside the blocks, whose kernels those reads
            slow; at decode the first costs more than the second saves
            (BENCHMARKS.md#step-cost-with-host-memory-tables). ``"deferred"``: as
            ``"side"``, but the lookups of sources that gather rows on the CPU
            (:func:`deferrable`: the host and disk tiers with ``gather="thread"``)
            start nowhere at plan: their ids are copied to the host when the step is
            planned, and each layer's lookup runs when its rows are first waited
            for (:meth:`run`, :meth:`StepPlan.rows`), on the waiting thread (the one
            launching the model, after it has launched the blocks before the
            layer): the CPU's gather, its copies to the device on the source's copy
            stream and the dequantisation on the current stream, so no kernel of
            the lookup runs beside the blocks and no worker thread runs beside the
            launching one. Such layers take no GPU reads (``gpu_reads`` does not
            apply to them). ``"copies"``: as ``"side"``, but sources that can split
            a lookup into its transfers and its kernels
            (:attr:`~engramrt.source.RowSource.splits_lookup`: the host and disk
            tiers with ``HostOptions(gather="queued")``) queue the transfers on the
            side stream at plan, the ids' copy to the host, the CPU's gather (a host
            function, run by a thread of the CUDA driver) and the rows' copy back,
            and their dequantising kernel runs when the layer's rows are first
            waited for, on the step's stream: no kernel of theirs runs beside the
            blocks, and the launching thread neither gathers nor waits. Such layers
            take no GPU reads either. Capturable in one CUDA graph with the step.
            ``"layer"``: as ``"copies"`` for sources that split a lookup, but their
            GPU reads kept as ``gpu_reads`` says, and every lookup that makes the host
            wait for nothing (GPU memory, the GPU's reads of host memory, from a source
            with no update and no collective) runs whole when its rows are first waited
            for, on the step's stream: no lookup kernel runs beside the blocks, and
            each such lookup adds its own time to the step instead of slowing the
            blocks it would run beside (a kernel beside them cost them about as much as
            the read took alone, or more: BENCHMARKS.md, "What slows the blocks beside a
            GPU read"). Large batches that make the host wait (prefill) keep their
            worker. Not the default: on an H100 the reads' own time cost a compiled
            decode step more than the default's reads beside the blocks did
            (BENCHMARKS.md, "Lookups at their layer").
        lookup_cpus: the CPUs the lookup worker threads run on, and with them the
            CPU gathers those threads run (a gather's intra-op threads are started
            by the worker and take its CPUs): for an engine that pins the thread
            launching the model to CPUs of its own, pass the others, so that no
            gather thread competes with it. None (default): the process's CPUs.
            Lookups on the launching thread (``lookup_overlap="deferred"``) and
            gathers queued in stream order (``HostOptions(gather="queued")``, run
            by a thread of the CUDA driver) stay where they are. See
            :func:`lookup_cpu_set`.

    Attributes:
        layers: the Engram layers as modules (empty without ``heads``).
        heads: the layers' heads (empty without ``heads``).
        handle: an int naming this runtime to the custom operators.
    """

    def __init__(
        self,
        hasher: RowIdMaker,
        sources: Sequence[RowSource],
        *,
        max_tokens: int,
        max_requests: int,
        history: Any = None,
        heads: Sequence[LayerHead | EngramConfig] | None = None,
        validate: bool = True,
        num_slots: int = 2,
        lookup_priority: int = 0,
        lookup_workers: str = "shared",
        gpu_reads: str = "all",
        lookup_overlap: str = "side",
        lookup_cpus: Collection[int] | None = None,
    ) -> None:
        if not isinstance(hasher, RowIdMaker):
            raise ValidationError(
                f"hasher is a {type(hasher).__name__}; expected a row-id maker "
                f"(engramrt.protocols.RowIdMaker, e.g. an NgramHasher)"
            )
        n_layers = hasher.n_layers
        if len(sources) != n_layers:
            raise ValidationError(
                f"sources has {len(sources)} entries; expected one per Engram layer ({n_layers})"
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
        check_choice("lookup_workers", lookup_workers, LOOKUP_WORKERS)
        check_choice("gpu_reads", gpu_reads, GPU_READS)
        check_choice("lookup_overlap", lookup_overlap, LOOKUP_OVERLAP)
        self.lookup_cpus = None if lookup_cpus is None else lookup_cpu_set(lookup_cpus)
        devices = {s.device for s in sources}
        if devices != {hasher.device}:
            raise ValidationError(
                f"sources compute on {sorted(map(str, devices))} but the hasher runs on "
                f"{hasher.device}; expected one device"
            )
        head_dims = {s.E for s in sources}
        if len(head_dims) != 1:
            raise ValidationError(f"sources have head dims {sorted(head_dims)}; expected one E")
        if heads is not None and len(heads) != n_layers:
            raise ValidationError(
                f"heads has {len(heads)} entries; expected one per Engram layer ({n_layers})"
            )
        self.hasher = hasher
        # Checked once: isinstance against a protocol costs microseconds a call.
        self._hashes_on_host = isinstance(hasher, HostRowIdMaker)
        self.sources = list(sources)
        self.gpu_reads = gpu_reads
        self.lookup_overlap = lookup_overlap
        # Layers whose CPU gather runs at the layer, on the thread that waits for its rows.
        self._deferred_layers = frozenset(
            index
            for index, s in enumerate(self.sources)
            if lookup_overlap == "deferred" and deferrable(s)
        )
        # Layers whose transfers start at plan and whose kernels run at the layer.
        self._split_layers = frozenset(
            index
            for index, s in enumerate(self.sources)
            if lookup_overlap in ("copies", "layer") and s.splits_lookup
        )
        for index, source in enumerate(self.sources):
            if index in self._split_layers and lookup_overlap == "copies":
                source.use_gpu_reads(False)  # a GPU read is a kernel beside the blocks
            elif gpu_reads != "sources":
                source.use_gpu_reads(gpu_reads == "all" or index == 0)
            # A deferred layer's gather runs on the thread that waits for its rows, which
            # does nothing else meanwhile: as many CPU threads as help.
            source.use_waited_gathers(index in self._deferred_layers)
        self.device = hasher.device
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.history = history
        self.n_layers = n_layers
        self.n_cols = hasher.num_cols
        self.head_dim = head_dims.pop()
        self.num_slots = num_slots
        self.validate = validate
        self.heads: list[LayerHead] = [
            self._head(index, head, validate) for index, head in enumerate(heads or [])
        ]
        self.layers: list[RuntimeLayer] = [
            RuntimeLayer(self, index, head) for index, head in enumerate(self.heads)
        ]

        # Fixed buffers, NaN-poisoned so a slice that was never written shows.
        def staging(*shape: int) -> torch.Tensor:
            return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=self.device)

        self._row_ids = [
            torch.empty(
                (max_tokens, self.n_layers, self.n_cols), dtype=hasher.out_dtype, device=self.device
            )
            for _ in range(num_slots)
        ]
        self._staging = [
            [staging(s.local_tokens(max_tokens), self.n_cols, self.head_dim) for s in self.sources]
            for _ in range(num_slots)
        ]
        # Each head owns its workspace (its output and whatever else it computes into).
        for head, source in zip(self.heads, self.sources, strict=False):
            head.reserve(source.local_tokens(max_tokens))
        self._planned: list[StepPlan] = []  # plans with unconsumed layers, oldest first
        self._next_slot = 0
        self._schedule_lookups(lookup_priority, lookup_workers)
        self._waits_for_hash = bool(self._workers or self._side_layers)
        # (slot, tokens) -> the step's views of the fixed buffers (a decode step repeats
        # its size; slicing them again costs microseconds per tensor).
        self._view_cache: dict[
            tuple[int, int], tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]
        ] = {}
        # Layers that take row ids hashed on the host (a step's host mirror).
        self._host_id_layers = frozenset(
            index for index, s in enumerate(self.sources) if s.host_ids and not s.collective
        )
        self._updates: list[Future[None]] = []
        self._last_fetch: dict[int, Future[None]] = {}  # each threaded layer's newest lookup
        self._plan_owner: threading.Thread | None = None  # the planning thread
        self._plan_thread: int | None = None  # its threading.get_ident()
        self._plan_thread_name = ""
        self._bind_lock = threading.Lock()
        self.handle = next(_NEXT_HANDLE)
        _HANDLES[self.handle] = self

    def _head(self, index: int, head: LayerHead | EngramConfig, validate: bool) -> LayerHead:
        head = pair_head_with_source(
            head,
            self.sources[index],
            validate=validate,
            head_name=f"heads[{index}]",
            source_name=f"sources[{index}]",
        )
        if head.num_cols != self.n_cols:
            raise ValidationError(
                f"heads[{index}] has C={head.num_cols} hash columns; the hasher makes {self.n_cols}"
            )
        return head

    # -- fixed addresses ---------------------------------------------------

    def staged_row_ids(self, slot: int) -> torch.Tensor:
        """The fixed ``[max_tokens, L, C]`` row-id buffer of staging slot ``slot``; a
        step of T tokens planned into it writes its first T rows."""
        return self._row_ids[self._slot(slot)]

    def staged_rows(self, slot: int, layer_index: int) -> torch.Tensor:
        """The fixed ``[local_tokens(max_tokens), C, E]`` bf16 rows buffer of staging
        slot ``slot``, Engram layer ``layer_index``."""
        return self._staging[self._slot(slot)][self._layer(layer_index)]

    def output_buffer(self, layer_index: int) -> torch.Tensor:
        """The fixed ``[local_tokens(max_tokens), hc, D]`` buffer :meth:`run` writes
        layer ``layer_index``'s output into (unless given ``out``): the head's own
        (:meth:`~engramrt.protocols.LayerHead.output_buffer`)."""
        self._need_heads("output_buffer")
        index = self._layer(layer_index)
        return self.heads[index].output_buffer(self.sources[index].local_tokens(self.max_tokens))

    @property
    def worker_assignment(self) -> dict[int, int]:
        """``{layer: worker key}`` for the layers whose source runs on a CPU worker thread
        (see :func:`worker_plan`); the other layers run on the side stream."""
        return dict(self._worker_of)

    @property
    def next_slot(self) -> int:
        """The staging slot the next :meth:`plan` writes (the slots alternate)."""
        return self._next_slot

    def _slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValidationError(f"slot={slot!r} must be an int in [0, {self.num_slots})")
        return slot

    def _layer(self, layer_index: int) -> int:
        if (
            isinstance(layer_index, bool)
            or not isinstance(layer_index, int)
            or not 0 <= layer_index < self.n_layers
        ):
            raise ValidationError(
                f"layer_index={layer_index!r} must be an int in [0, {self.n_layers}) "
                f"(Engram layers)"
            )
        return layer_index

    def _need_heads(self, what: str) -> None:
        if not self.heads:
            raise ValidationError(
                f"{what}() needs the layers' heads: build the runtime with heads=[...] (or use "
                f"StepPlan.rows to run your own head)"
            )

    # -- plan ----------------------------------------------------------------

    def _check(self, batch: EngineStep) -> None:
        if not isinstance(batch, EngineStep):
            raise ValidationError(
                f"batch is a {type(batch).__name__}; expected an EngineStep (engramrt.step; "
                f"HashBatch is its older name), what the adapters in engramrt.adapters return"
            )
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
        if self.heads and len(self._planned) >= self.num_slots:
            waiting = [index for index, p in enumerate(self._planned[0].pending) if p is not None]
            raise ValidationError(
                f"{len(self._planned)} planned steps have layers whose rows were not consumed "
                f"(oldest: Engram layers {waiting}); a new plan would overwrite them "
                f"(num_slots={self.num_slots}): run every layer once per step"
            )

    def _schedule_lookups(self, lookup_priority: int, lookup_workers: str) -> None:
        """Where each layer's lookups run: the side stream, the worker threads and their
        streams, or deferred to the layer (see the module doc)."""
        cuda = self.device.type == "cuda"
        self._lookup_stream = (
            torch.cuda.Stream(self.device, priority=lookup_priority)
            if cuda and self.lookup_overlap != "none"
            else None  # lookups on the step's stream, in order
        )
        self.lookup_workers = lookup_workers
        self._worker_of = {
            index: key
            for index, key in (
                worker_plan(self.sources, shared=lookup_workers == "shared") if cuda else {}
            ).items()
            if index not in self._deferred_layers
        }
        # Deferred layers' row ids on the host, per slot: copied from the device when
        # the step is planned, read by the CPU's gather at the layer.
        self._host_row_ids = (
            [
                torch.empty(
                    (self.max_tokens, self.n_layers, self.n_cols),
                    dtype=self.hasher.out_dtype,
                    pin_memory=True,
                )
                for _ in range(self.num_slots)
            ]
            if cuda and self._deferred_layers
            else None
        )
        self._workers = {
            key: lookup_worker(f"engramrt-rows-{key}", self.lookup_cpus)
            for key in set(self._worker_of.values())
        }
        self._worker_streams = {
            key: torch.cuda.Stream(self.device, priority=lookup_priority) for key in self._workers
        }
        self._jobs = worker_jobs(self.sources, self._worker_of)
        # Layers started on the side stream (no worker thread), in layer order.
        self._side_layers = (
            tuple(
                index
                for index in range(self.n_layers)
                if index not in self._worker_of and index not in self._deferred_layers
            )
            if self._lookup_stream is not None
            else ()
        )

    def plan(
        self,
        batch: EngineStep,
        *,
        history: Any = None,
        host_batch: EngineStep | None = None,
    ) -> StepPlan:
        """Hash ``batch`` and start every layer's rows: the host half of a step.

        ``batch`` is the step (:class:`~engramrt.step.EngineStep`), what an adapter
        returns (:func:`~engramrt.adapters.from_vllm_step`,
        :func:`~engramrt.adapters.from_sglang_batch`). Launches the hash kernel and the
        lookups and returns at once; nothing here waits on the device (a source that must learn the ids does so on its worker thread).
        Call :meth:`run` for each layer at its block, or :meth:`StepPlan.rows`.

        ``history``: this step's history object instead of the runtime's, of the same
        kind and geometry over other tensors (the custom operators pass the tensors
        the compiler sees); None uses the runtime's.

        ``batch.host``: the step's host mirror (:attr:`~engramrt.step.EngineStep.host`:
        the same step on the CPU, its history in ``lookback_token_ids``; an engine that
        keeps its requests' token ids on the host). The row ids of the
        layers whose source gathers rows on the CPU
        (:attr:`~engramrt.source.RowSource.host_ids`: the host and disk tiers) are then
        hashed here, on the host, in one pass
        (the id maker's ``hash_on_host``, :class:`~engramrt.protocols.HostRowIdMaker`:
        :meth:`~engramrt.hashing.NgramHasher.hash_on_host`, bit for bit the device's),
        and those sources gather from them at once, never waiting for the step's
        hashing on the device and never reading host memory from the GPU beside the
        blocks. The device still hashes every layer (:attr:`StepPlan.row_ids`). Whether
        it pays depends on the host: the hash and a decode step's gather are host work
        on the step's path (measured in BENCHMARKS.md, "Ids hashed on the host").
        With ``validate`` the runtime checks that the host mirror matches the step's
        shape and that its lookback ids cover every position a history store would
        supply (host arrays only). ``host_batch=`` is the older way to give the mirror
        (deprecated: it warns, and goes in a later release).

        The first thread that plans owns the runtime (see the module doc, "Threads");
        a plan from another thread is refused before any buffer is touched, unless
        that thread called :meth:`bind_thread`.
        """
        if self._plan_owner is not threading.current_thread():
            self._claim_thread()
        self._check(batch)
        host = batch.host
        if host_batch is not None:
            warnings.warn(
                "EngramRuntime.plan(batch, host_batch=host) is deprecated; give the step its "
                "host mirror instead: plan(batch.with_host(host))",
                DeprecationWarning,
                stacklevel=2,
            )
            host = host_batch
        if host is not None:
            self._check_host(host, batch, self.history if history is None else history)
        self._raise_failed_updates()
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.num_slots
        num_tokens = batch.num_tokens
        row_ids, layer_ids, outs = self._views(slot, num_tokens)
        self.hasher(batch, self.history if history is None else history, out=row_ids)
        ready = None  # marks the hash ids done, for the side stream and the workers' streams
        if self._waits_for_hash:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        host_ids = self._host_ids(host) if host is not None else {}
        pending: list[PendingRows | None] = [None] * self.n_layers
        if self._deferred_layers:
            self._defer(slot, row_ids, host_ids, outs, pending)
        side: list[int] = []
        for index, source in enumerate(self.sources):
            if index in self._deferred_layers:
                continue
            ids = host_ids.get(index, layer_ids[index])
            if self._at_layer(index, source, ids):
                pending[index] = PendingRows(
                    outs[index],
                    ids.shape[0],
                    keep_alive=(ids,),
                    deferred=functools.partial(
                        self._deferred_lookup, source, ids, outs[index], None
                    ),
                )
            elif index in self._side_layers:
                side.append(index)
            elif index in self._split_layers:  # no side stream (a CPU device): in order
                pending[index] = self._queue_copies(source, ids, outs[index])
            elif self._beside(index, source, ids):
                side.append(index)
            else:
                pending[index] = self._start(index, source, ids, outs[index], ready)
        if side:
            # Every side-stream lookup behind one wait, in one stream context: on a slow
            # host each costs about as much as a launch.
            assert ready is not None and self._lookup_stream is not None
            stream = self._lookup_stream
            stream.wait_event(ready)  # after the step's hashing and the slots' last readers
            with torch.cuda.stream(stream):
                for index in sorted(side):
                    ids = host_ids.get(index, layer_ids[index])
                    if index in self._split_layers:
                        pending[index] = self._queue_copies(self.sources[index], ids, outs[index])
                    else:
                        pending[index] = self.sources[index].start_on(ids, outs[index], stream)
        for job, index in self._jobs:
            if job == "update":  # after every threaded lookup of the step; nobody joins it
                key = self._worker_of[index]
                self._updates.append(
                    self._workers[key].submit(
                        self._update_on_worker, self.sources[index], self._worker_streams[key]
                    )
                )
        step = StepPlan(
            row_ids=row_ids,
            num_tokens=num_tokens,
            slot=slot,
            pending=pending,  # type: ignore[arg-type]  # every layer started above
            step=batch,
        )
        step._ran = [False] * self.n_layers
        if self.heads:
            self._planned.append(step)
        return step

    def _claim_thread(self) -> None:
        """Bind the calling thread when no thread owns the runtime yet; refuse any other."""
        current = threading.current_thread()
        with self._bind_lock:  # two threads planning first at once: one of them wins
            if self._plan_owner is None:
                self._bind(current)
                return
            owner, owner_name = self._plan_thread, self._plan_thread_name
        # Threads compared as objects: a new thread may reuse a finished one's ident.
        if self._plan_owner is not current:
            raise ValidationError(
                f"plan() called from thread {current.name!r} (ident {current.ident}) but this "
                f"EngramRuntime plans on thread {owner_name!r} (ident {owner}): its staging "
                f"slots alternate per plan, so plans from two threads would overwrite each "
                f"other's row ids; expected one step loop per runtime (call bind_thread() "
                f"from the new thread when the engine moves its step loop there)"
            )

    def bind_thread(self) -> None:
        """Make the calling thread the one that plans (see the module doc, "Threads").

        For an engine that moves its step loop to another thread: call it from the
        new thread, after the old one has stopped planning (its planned steps stay
        valid and are run in order).
        """
        with self._bind_lock:
            self._bind(threading.current_thread())

    def _bind(self, thread: threading.Thread) -> None:
        self._plan_owner = thread
        self._plan_thread = thread.ident
        self._plan_thread_name = thread.name

    @property
    def plan_thread(self) -> int | None:
        """``threading.get_ident()`` of the thread that plans (None before the first plan)."""
        return self._plan_thread

    prefetch = plan
    """Plan the next step now, right after sampling (an alias of :meth:`plan`: the
    staging slots alternate, so the current step's rows stay valid until the step
    after the prefetched one, and :meth:`run` consumes planned steps in order)."""

    # -- run -----------------------------------------------------------------

    def run(
        self,
        layer_index: int,
        hidden: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """Engram layer ``layer_index`` of the oldest planned step that has not run it:
        ``out [Tl, hc, D]`` bf16 = gate(hidden, wkv(rows)). Device work only.

        Args:
            layer_index: the layer's position among the model's Engram layers.
            hidden: ``[Tl, hc, D]`` hidden streams (bf16; fp16/fp32 accepted),
                contiguous, ``Tl = source.local_tokens(T)``: ``T``, or this
                rank's ``ceil(T / tp)`` tokens under sequence parallelism.
            token_mask: optional bool ``[Tl]``; False passes the token through.
            out: optional contiguous bf16 ``[Tl, hc, D]`` to write instead of
                the fixed :meth:`output_buffer`.
            return_kv: also return kv ``[Tl, (hc+1)*D]`` (a view of a fixed buffer).

        Returns:
            ``out`` (by default a view of :meth:`output_buffer`, overwritten by
            the next step), or ``(out, kv)``.
        """
        self._need_heads("run")
        index = self._layer(layer_index)
        step = next((s for s in self._planned if not s._ran[index]), None)
        if step is None:
            raise ValidationError(
                f"run({index}) but no planned step has Engram layer {index}'s rows waiting; "
                f"call plan(batch) first, once per step"
            )
        local = self.sources[index].local_tokens(step.num_tokens)
        if self.validate:
            check_hidden(
                hidden, self.heads[index], local, step.num_tokens, where=f"Engram layer {index}"
            )
        step._ran[index] = True
        rows = step.pending[index].wait()
        while self._planned and self._planned[0].done:
            self._planned.pop(0)
        head = self.heads[index]
        return head.compute(
            hidden,
            rows,
            token_mask,
            step=step.step,
            out=head.output_buffer(local) if out is None else out,
            return_kv=return_kv,
        )

    @property
    def pending_steps(self) -> int:
        """Planned steps some layer has not run yet (always 0 without heads)."""
        return len(self._planned)

    @property
    def cached_views(self) -> int:
        """Sets of views of the fixed buffers :meth:`plan` keeps, one per (staging slot,
        step size) seen since it last cleared them (at most :data:`VIEW_CACHE_SIZE`)."""
        return len(self._view_cache)

    def abandon(self) -> int:
        """Forget every planned step whose layers will not all run (an engine that aborts
        a step, or drops a prefetched one); returns how many.

        Joins the worker threads' lookups of those steps, so none is still being
        issued; the device work already queued stays in order on each layer's
        stream, ahead of any later lookup into the same staging slot.
        """
        abandoned, self._planned = self._planned, []
        for step in abandoned:
            for pending in step.pending:
                if pending.future is not None:
                    pending.future.exception()  # wait; the error, if any, belonged to the step
        return len(abandoned)

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

    def _views(
        self, slot: int, num_tokens: int
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Staging ``slot``'s views for a step of ``num_tokens`` tokens: the hash ids
        ``[T, L, C]``, each layer's ids ``[T, C]`` and each layer's rows
        ``[local_tokens(T), C, E]``."""
        key = (slot, num_tokens)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= VIEW_CACHE_SIZE:
                self._view_cache.clear()
            row_ids = self._row_ids[slot][:num_tokens]
            views = self._view_cache[key] = (
                row_ids,
                [row_ids[:, index] for index in range(self.n_layers)],
                [
                    self._staging[slot][index][: source.local_tokens(num_tokens)]
                    for index, source in enumerate(self.sources)
                ],
            )
        return views

    def _check_host(self, host: EngineStep, batch: EngineStep, history: Any) -> None:
        if not self._hashes_on_host:
            raise ValidationError(
                f"the step has a host mirror, but the runtime's id maker "
                f"({type(self.hasher).__name__}) cannot make ids on the host; expected a "
                f"HostRowIdMaker (engramrt.protocols: hash_on_host, check_host_step), e.g. "
                f"an NgramHasher"
            )
        if self.validate:
            self.hasher.check_host_step(  # type: ignore[attr-defined]  # _hashes_on_host
                host, batch, has_history=history is not None
            )

    def _host_ids(self, host_batch: EngineStep) -> dict[int, torch.Tensor]:
        """``{layer: [T, C] row ids}`` of ``host_batch`` for the layers that take ids on the
        host, hashed here in one pass (on the calling thread: the hash is many small numpy
        operations that hold the interpreter's lock, which worker threads hashing at once
        would pass back and forth)."""
        layers = sorted(self._host_id_layers)
        if not layers:
            return {}
        ids = self.hasher.hash_on_host(host_batch, layers)  # type: ignore[attr-defined]
        return {index: torch.from_numpy(ids[:, at]) for at, index in enumerate(layers)}

    def _defer(
        self,
        slot: int,
        row_ids: torch.Tensor,
        host_ids: dict[int, torch.Tensor],
        outs: list[torch.Tensor],
        pending: list[PendingRows | None],
    ) -> None:
        """The deferred layers' lookups (``lookup_overlap="deferred"``), into ``pending``:
        each runs when its rows are first waited for. Their ids come to the host now, in
        one copy queued after the hashing (none when the step's host mirror hashed them,
        or on a CPU device), and the lookup waits for that copy only."""
        landed = None
        on_host = row_ids
        if self._host_row_ids is not None and any(
            index not in host_ids for index in self._deferred_layers
        ):
            on_host = self._host_row_ids[slot][: row_ids.shape[0]]
            on_host.copy_(row_ids, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(self.device))
        for index in self._deferred_layers:
            ids = host_ids.get(index)
            if ids is None:
                ids = on_host[:, index]
            pending[index] = PendingRows(
                outs[index],
                row_ids.shape[0],
                deferred=functools.partial(
                    self._deferred_lookup, self.sources[index], ids, outs[index], landed
                ),
            )

    @staticmethod
    def _deferred_lookup(
        source: RowSource,
        ids: torch.Tensor,
        out: torch.Tensor,
        landed: torch.cuda.Event | None,
    ) -> None:
        """A deferred layer's lookup, on the thread and stream that wait for its rows:
        the ids' copy to the host joined, the CPU's gather, its copies to the device on
        the source's copy stream and the dequantisation on the current stream."""
        if landed is not None:
            landed.synchronize()
        source.fetch(ids, out)

    def _queue_copies(self, source: RowSource, ids: torch.Tensor, out: torch.Tensor) -> PendingRows:
        """A split layer's transfers, queued on the current (side) stream now; its kernels
        when its rows are first waited for (``lookup_overlap="copies"`` or ``"layer"``)."""
        finish = source.queue_copies(ids, out, in_flight=self.num_slots)
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
        return PendingRows(
            out,
            ids.shape[0],
            keep_alive=(ids,),
            deferred=functools.partial(self._finish_split, finish, copied),
        )

    def _finish_split(
        self, finish: Callable[[], torch.Tensor], copied: torch.cuda.Event | None
    ) -> None:
        """A split layer's kernels, on the waiting thread's stream, after its copies."""
        if copied is not None:
            torch.cuda.current_stream(self.device).wait_event(copied)
        finish()

    def _at_layer(self, index: int, source: RowSource, ids: torch.Tensor) -> bool:
        """Whether layer ``index``'s lookup of ``ids`` waits, whole, for its layer
        (``lookup_overlap="layer"``): a lookup that makes the host wait for nothing (GPU
        memory, the GPU's reads of host memory), from a source with no update to queue
        behind it and no collective to keep in order. Such a lookup reads no state a
        worker's lookup of the same source writes (the GPU's reads use no staging), so it
        may run on the launching thread while the worker serves a later step."""
        return (
            self.lookup_overlap == "layer"
            and index not in self._split_layers
            and not source.has_update
            and not source.collective
            and ids.device.type == self.device.type
            and not source.waits_on_host(ids)
        )

    def _beside(self, index: int, source: RowSource, ids: torch.Tensor) -> bool:
        """Whether layer ``index``, whose source has a worker thread, starts this batch on
        the side stream from the planning thread: the batch makes the host wait for
        nothing (GPU reads), the source has no update to queue behind it, and no lookup
        of this source is still on its worker (whose staging the source would share
        with this thread)."""
        if (
            self._lookup_stream is None
            or index not in self._worker_of
            or source.has_update
            or source.collective
            or ids.device.type != self.device.type  # ids hashed on the host: the worker
            or source.waits_on_host(ids)
        ):
            return False
        last = self._last_fetch.get(index)
        return last is None or last.done()

    def _start(
        self,
        index: int,
        source: RowSource,
        ids: torch.Tensor,
        out: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> PendingRows:
        """Start layer ``index``'s lookup of ``ids`` (on the device, or hashed on the host)."""
        key = self._worker_of.get(index)
        inline = self.lookup_overlap == "none" and not source.has_update
        if key is not None and inline and not source.waits_on_host(ids):
            # A lookup that needs no host wait (GPU reads of a small batch) runs on the
            # step's stream, after the jobs its worker has queued for the source. A source
            # with an update stays on its worker: the update job plan() queues there must
            # follow the lookup on one stream.
            self._workers[key].submit(lambda: None).result()
            return source.start(ids, out, stream=None)
        if key is None:
            # No side stream (a CPU device, or lookup_overlap="none"): in order, now.
            # Side-stream sources are started together by plan().
            return source.start(ids, out, stream=None)
        assert ready is not None
        done = torch.cuda.Event()
        future = self._workers[key].submit(
            self._run_on_worker, source, ids, out, ready, self._worker_streams[key], done
        )
        self._last_fetch[index] = future
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
            stream.wait_event(ready)  # after the step's hashing and the slot's last reader
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
        if self._lookup_stream is not None:  # later plans start every layer on the side stream
            self._side_layers = tuple(
                index for index in range(self.n_layers) if index not in self._deferred_layers
            )
        self._raise_failed_updates()
