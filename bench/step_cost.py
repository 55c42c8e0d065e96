"""What host-memory tables cost a model step, in each way engines run one (a GPU machine).

    python bench/step_cost.py [--table-gib 8] [--modes eager,compiled,piecewise,graph]
        [--placements aa,default,thread,queued,gpu-reads] [--workloads decode,prefill]
        [--loops sync,queued] [--ids random,text,zipf] [--rounds 10] [--out PATH]

The synthetic 30-block backbone of ``bench/runtime_overhead.py`` (hidden 4096,
bf16 MLP blocks, ~6 B parameters held as ``nn.Parameter`` as an engine's model
holds them), Engram at the start of blocks 1 and 14 as in V4.1-Flash, V4.1 row
shapes, tables scaled to ``--table-gib`` GiB per layer, run through an
:class:`~engramrt.runtime.EngramRuntime` with heads in four modes:

- ``eager``: blocks launched from Python, ``runtime.run`` at each Engram layer;
- ``compiled``: the forward under ``torch.compile(fullgraph=True)`` (Inductor, no
  CUDA graphs), each Engram layer the ``engramrt::run_layer`` operator;
- ``piecewise``: the pieces between Engram layers captured in CUDA graphs and
  ``runtime.run`` eager between them (vLLM's splitting-op way);
- ``graph``: the whole decode step, ``runtime.plan`` included, in one CUDA graph per
  staging slot, the step's ids copied into fixed inputs first (SGLang's way). Only
  placements whose sources need no host thread can be captured; the others are
  reported as skipped, with the reason.

Loops: ``sync`` waits for each step (its stream, where an engine's sampled tokens are)
before planning the next (the next tokens come from this step's sampling); ``queued``
plans each step as soon as the last was launched; ``sync-prefetch`` waits for each step
as ``sync`` does, but plans the next one right after launching this one, before the wait
(an engine that calls ``runtime.prefetch`` right after sampling, the next step's tokens
being the sampler's output on the device: its hashing and lookups queue behind this
step's kernels and run while the host waits). Workloads: ``decode`` (256 requests x 1
token, ``--ids`` random, text or Zipf) and ``prefill`` (8,192-token chunks of 512
sequences, eager and compiled only, the next chunk prefetched).

Placements, each a runtime over its own tables (a :class:`Placement` in ``PLACEMENTS``):
``device`` (GPU memory, the reference), ``aa`` (a second runtime over the same GPU
tables: the A/A control), ``default`` (host memory, everything as shipped), ``thread``
(host memory, the CPU's gathers driven by a worker thread: ``HostOptions(gather="thread")``),
``queued`` (host memory, gathers queued in stream order:
``HostOptions(gather="queued")``), ``queued-cpu`` (the same with no GPU reads: every
layer's rows gathered by the CPU in stream order), ``queued-cpu-6`` and ``queued-cpu-16``
(``queued-cpu`` with its gathers on 6 and 16 CPU threads, ``HostOptions(num_threads=)``:
a decode layer's gather on the store's own count takes one thread), ``thread-cpu`` (no GPU
reads: every layer's rows gathered by the CPU on the lookup worker thread) and
``thread-cpu-pinned`` (the same with the thread launching the step pinned to the process's
first CPU while the case runs and the lookup worker, with its gathers, on the others:
``EngramRuntime(lookup_cpus=...)``), ``gpu-reads`` (host memory, every layer read
by the GPU: ``EngramRuntime(gpu_reads="all")``), ``default-worker`` and ``gpu-reads-worker``
(the same two with GPU-read batches sent through the worker thread, as the runtime did before
it started them beside it), ``first`` and ``queued-first`` (host memory, GPU reads for the
first Engram layer only and the CPU's gather, on a worker or queued, for the later ones:
``EngramRuntime(gpu_reads="first")``, the default before 2026-12-04), ``default-high`` and
``queued-first-high`` (``default`` and ``queued-first`` with their lookups on side streams of the
highest CUDA priority: ``EngramRuntime(lookup_priority=...)``), ``inline`` (``default`` with
its lookups on the step's stream inside ``plan``, before the blocks:
``EngramRuntime(lookup_overlap="none")``), ``deferred`` (host memory, each layer's rows
gathered by the CPU when the layer runs, by the thread launching the step, copied on a copy
stream and dequantised on the step's stream: ``EngramRuntime(lookup_overlap="deferred")``
with ``HostOptions(gather="thread")``; its gathers take the store's own count of CPU threads,
one per 1,536 rows: 4 for a decode layer), ``deferred-4`` and ``deferred-16`` (the same on 4
and 16 threads: ``HostOptions(num_threads=)``), ``queued-copies``, ``queued-copies-4`` and
``copies-last`` (queued gathers split at their kernel: ``EngramRuntime(lookup_overlap=
"copies")``), ``at-layer``, ``at-layer-queued`` and ``at-layer-copies`` (no lookup kernel
beside the blocks: ``EngramRuntime(lookup_overlap="layer")``), ``frozen-first``,
``frozen-first-queued`` and ``frozen-first-layer`` (layer 0 behind a frozen hot-row cache of
5% of its table, ``CachedRowStore(frozen=True)``, filled before the rounds from
``--frozen-profile-steps`` decode steps of other requests of the run's ``--ids``; the report's
``frozen_caches`` gives what each holds and its hit rate), and with ``--read-kernels``
``read-R-W-P`` (the default with other settings for the GPU's reads: ``R`` rows per program,
``W`` warps, at most ``P`` programs). The host placements share one copy of the tables in host
memory.

Method: paired rounds. Each round times every case (placement x mode x workload x
loop x ids) as a short block (warm-up steps, then timed steps, synchronised at both
ends) in an order shuffled per round; a case's cost in a round is
``100 * (1 - ms_device / ms_case)`` against the ``device`` placement of the same
mode, workload, loop and ids in the same round; the report gives the median and
quartiles over rounds. Before timing, every case's step is checked: its staged rows
equal the GPU-memory tables' rows of the same batch bit for bit and its output is
finite; a case that fails is not timed.

The report (``--out``, default ``bench/results/step-cost-<UTC>.json``, written
atomically after every round) has a top-level ``cases`` list: ``mode``,
``placement``, ``table_gib``, ``workload``, ``loop``, ``ids``, ``rounds``,
``median_pct``, ``p25_pct``, ``p75_pct``, ``ref_ms`` (the reference's median step),
``ms`` (the case's), and the per-round lists. With ``--process-per-mode`` each mode
runs in a process of its own (pairing stays within a mode) and the report merges
them (``process_per_mode`` lists the modes, ``rounds_completed`` is per mode): the
control for costs that depend on what else ran in the process before.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runtime_overhead as ro
from engramrt import custom_ops
from engramrt.bench.runner import environment
from engramrt.distributed.stores import SharedRows
from engramrt.hashing import HashBatch, HashConstants, NgramHasher
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.lookup.settings import LookupKernelConfig
from engramrt.lookup.tiers import HostGatherRowStore, HostOptions, TablePlacement
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap

MODES = ("eager", "compiled", "piecewise", "graph")
# torch maps a stream priority beyond the device's range to the nearest valid one, so this
# is the highest.
HIGHEST_PRIORITY = ro.HIGHEST_PRIORITY


def launcher_cpus() -> tuple[set[int], set[int]]:
    """A pinned placement's CPUs: the process's first CPU for the thread launching the step,
    the others (all of them on a one-CPU machine) for the lookups."""
    allowed = os.sched_getaffinity(0)
    first = {min(allowed)}
    return first, (allowed - first) or allowed


LAUNCHER_CPUS = launcher_cpus()


@dataclass(frozen=True)
class Placement:
    """Where a case's tables are and how its runtime looks rows up in them: what it passes to
    :class:`~engramrt.runtime.EngramRuntime` and, over host memory, to its stores'
    :class:`~engramrt.lookup.tiers.HostOptions`. A setting left at ``None`` (or its default
    here) is the one the runtime or the host tier ships with."""

    name: str
    # The tables in host memory (one copy shared by every host placement), else the GPU's.
    host: bool = True
    # EngramRuntime(gpu_reads=...): the layers the GPU reads from host memory.
    gpu_reads: str | None = None
    # A host store the GPU never reads (no mapping of its rows for the device):
    # HostOptions(gpu_reads=False).
    cpu_only: bool = False
    # Lookups on side streams of the highest CUDA priority
    # (EngramRuntime(lookup_priority=HIGHEST_PRIORITY)), else the default, 0, the lowest.
    high_priority: bool = False
    # EngramRuntime(lookup_overlap=...): "side" (beside the blocks), "none" (on the step's
    # stream inside plan, before the blocks), "deferred" (the host tier's lookups at their
    # layer, on the thread that launches the step), "copies" (a queued gather's copies and
    # host function beside the blocks, its kernel at the layer on the step's stream) or
    # "layer" (as "copies", and GPU reads whole at the layer on the step's stream).
    overlap: str = "side"
    # HostOptions(gather=...): "thread" (driven by a worker thread) or "queued" (in stream
    # order).
    gather: str | None = None
    # The Engram layers (0, 1, ...) whose stores take ``gather``; the others keep the
    # host tier's default. None: every layer.
    gather_layers: tuple[int, ...] | None = None
    # HostOptions(num_threads=): a fixed count of CPU threads for the gathers, else the
    # store's own count.
    gather_threads: int | None = None
    # GPU-read batches sent through the source's worker thread (:class:`WorkerRuntime`), as
    # the runtime did before it started them beside it.
    worker: bool = False
    # HostOptions(kernel=...): settings for the GPU's reads of host memory (--read-kernels).
    kernel: LookupKernelConfig | None = None
    # The thread launching the step pinned to the process's first CPU while the case runs,
    # and the lookup workers, with the gathers they start, kept off it on the other CPUs
    # (EngramRuntime(lookup_cpus=...)).
    pinned: bool = False
    # A frozen hot-row cache (CachedRowStore(frozen=True)) holding this share of each layer
    # of ``frozen_layers``'s table in GPU memory, in front of its host store, filled before
    # the rounds from a profile of other requests of the run's ids kinds (no update while
    # serving). 0: none.
    frozen_cache: float = 0.0
    frozen_layers: tuple[int, ...] = (0,)

    def runtime_options(self) -> dict[str, Any]:
        """The :class:`EngramRuntime` arguments this placement sets (the others as shipped)."""
        return {
            **({"gpu_reads": self.gpu_reads} if self.gpu_reads is not None else {}),
            "lookup_priority": HIGHEST_PRIORITY if self.high_priority else 0,
            "lookup_overlap": self.overlap,
            **({"lookup_cpus": sorted(LAUNCHER_CPUS[1])} if self.pinned else {}),
        }

    def host_options(self, queued_rows: int, layer: int = 0) -> HostOptions:
        """Its host store's settings for Engram layer ``layer``, the queued gather's fixed
        buffers holding ``queued_rows`` rows from the start."""
        chosen = self.gather_layers is None or layer in self.gather_layers
        return HostOptions(
            gather=HostOptions().gather if self.gather is None or not chosen else self.gather,
            queued_rows=queued_rows,
            gpu_reads=False if self.cpu_only else None,
            num_threads=self.gather_threads,
            **({"kernel": self.kernel} if self.kernel is not None else {}),
        )


# The reference every case is paired with: a runtime over the tables in GPU memory.
DEVICE = Placement("device", host=False)
PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in (
        # A second runtime over the same GPU tables: the A/A control.
        Placement("aa", host=False),
        # Host memory, everything as shipped.
        Placement("default"),
        Placement("thread", gather="thread"),
        Placement("queued", gather="queued"),
        # queued with no GPU reads: every layer's rows gathered by the CPU in stream order;
        # then on 6 and 16 CPU threads (a decode layer's gather on the store's own count
        # takes one thread).
        Placement("queued-cpu", gpu_reads="sources", cpu_only=True, gather="queued"),
        Placement(
            "queued-cpu-6", gpu_reads="sources", cpu_only=True, gather="queued", gather_threads=6
        ),
        Placement(
            "queued-cpu-16", gpu_reads="sources", cpu_only=True, gather="queued", gather_threads=16
        ),
        # Every layer read by the GPU.
        Placement("gpu-reads", gpu_reads="all"),
        # default and gpu-reads with GPU-read batches sent through the worker thread.
        Placement("default-worker", worker=True),
        Placement("gpu-reads-worker", gpu_reads="all", worker=True),
        # GPU reads for the first Engram layer only, the CPU's gather (on a worker or queued)
        # for the later ones: the default before 2026-12-04.
        Placement("first", gpu_reads="first"),
        Placement("queued-first", gpu_reads="first", gather="queued"),
        # default and queued-first with their lookups at the highest priority.
        Placement("default-high", high_priority=True),
        Placement("queued-first-high", gpu_reads="first", gather="queued", high_priority=True),
        # default with its lookups on the step's stream inside plan, before the blocks.
        Placement("inline", overlap="none"),
        # No GPU reads: every layer's rows gathered by the CPU on the lookup worker thread,
        # then with the launching thread and the lookups on CPUs of their own.
        Placement("thread-cpu", gpu_reads="sources", cpu_only=True, gather="thread"),
        Placement(
            "thread-cpu-pinned", gpu_reads="sources", cpu_only=True, gather="thread", pinned=True
        ),
        # Each layer's rows gathered by the CPU when the layer runs, on the store's own count
        # of CPU threads, then on 4 and 16.
        Placement("deferred", overlap="deferred", gather="thread"),
        Placement("deferred-4", overlap="deferred", gather="thread", gather_threads=4),
        Placement("deferred-16", overlap="deferred", gather="thread", gather_threads=16),
        # Queued gathers whose transfers start at plan and whose dequantisation runs at the
        # layer: nothing but copies and the CPU's gather beside the blocks; on the store's
        # own thread count (one for a decode layer) and on 4.
        Placement(
            "queued-copies", gpu_reads="sources", cpu_only=True, gather="queued", overlap="copies"
        ),
        Placement(
            "queued-copies-4",
            gpu_reads="sources",
            cpu_only=True,
            gather="queued",
            overlap="copies",
            gather_threads=4,
        ),
        # Layer 0 (one block to hide behind) read by the GPU, layer 1 (thirteen) a queued
        # gather split at its kernel, on 4 threads.
        Placement(
            "copies-last", gather="queued", gather_layers=(1,), overlap="copies", gather_threads=4
        ),
        # No lookup kernel beside the blocks (EngramRuntime(lookup_overlap="layer")): every
        # decode layer read by the GPU at its layer, on the step's stream, with the host
        # tier's worker for large batches, then with queued gathers (capturable); then
        # layer 0 so and layer 1 a queued gather split at its kernel, on 4 threads.
        Placement("at-layer", overlap="layer"),
        Placement("at-layer-queued", gather="queued", overlap="layer"),
        Placement(
            "at-layer-copies",
            gpu_reads="first",
            gather="queued",
            overlap="layer",
            gather_threads=4,
        ),
        # Layer 0 (one block to hide behind) behind a frozen cache of 5% of its table, built
        # from a profile: hits read from GPU memory, misses by the GPU from host memory,
        # in one launch; then with layer 1's gather queued (capturable), then at the layer.
        Placement("frozen-first", frozen_cache=0.05),
        Placement("frozen-first-queued", frozen_cache=0.05, gpu_reads="first", gather="queued"),
        Placement("frozen-first-layer", frozen_cache=0.05, overlap="layer"),
    )
}
LOOPS = ("sync", "queued", "sync-prefetch")
WORKLOADS = ("decode", "prefill")
IDS = ("random", "text", "zipf")
PREFILL_MODES = ("eager", "compiled")
DECODE_TOKENS, PREFILL_TOKENS = 256, 8192


class Backbone(nn.Module):
    """The runtime bench's dense blocks, their weights as parameters (Inductor's CUDA
    graphs treat parameters as static; plain tensors would be copied into the graph's
    inputs at every replay)."""

    def __init__(self, blocks: list[tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            [nn.Parameter(w, requires_grad=False) for block in blocks for w in block]
        )
        self.n_blocks = len(blocks)

    def block(self, x: torch.Tensor, b: int) -> torch.Tensor:
        """Block ``b``, its output RMS-normalised (as the next block's input norm would), so
        thirty blocks of random weights stay finite."""
        x = ro.run_block(x, tuple(self.weights[4 * b + i] for i in range(4)))
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def blocks(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        for b in range(lo, hi):
            x = self.block(x, b)
        return x


def engram_input(x: torch.Tensor) -> torch.Tensor:
    """The backbone's one stream copied to the ``hc`` hyper-connection streams."""
    return x.unsqueeze(1).expand(x.shape[0], ro.HC, x.shape[1]).contiguous()


def forward_fn(backbone: Backbone, runtime: EngramRuntime, compiled_ops: bool) -> Callable:
    """``x [T, D] -> [T, D]``: the blocks, each Engram layer at its block (the first stream of
    its output carried on)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        for b in range(backbone.n_blocks):
            if b in ro.ENGRAM_AT:
                li = ro.ENGRAM_AT[b]
                hidden = engram_input(x)
                if compiled_ops:
                    x = custom_ops.run_layer(runtime, li, hidden)[:, 0]
                else:
                    x = runtime.run(li, hidden)[:, 0]
            x = backbone.block(x, b)
        return x

    return forward


class Runner:
    """One case's way of running steps: ``plan(batch)`` then ``step()``."""

    def __init__(self, runtime: EngramRuntime, x: torch.Tensor) -> None:
        self.runtime, self.x = runtime, x

    def plan(self, batch: HashBatch) -> Any:
        return self.runtime.plan(batch)

    def step(self) -> None:
        raise NotImplementedError

    def staged(self, plan: Any, li: int, num_tokens: int) -> torch.Tensor:
        return self.runtime.staged_rows(plan.slot, li)[:num_tokens]


class Eager(Runner):
    def __init__(self, runtime, x, backbone, compiled: bool) -> None:
        super().__init__(runtime, x)
        fn = forward_fn(backbone, runtime, compiled_ops=compiled)
        self.forward = torch.compile(fn, fullgraph=True) if compiled else fn

    def step(self) -> None:
        self.out = self.forward(self.x)


class Piecewise(Runner):
    """The pieces between Engram layers compiled by Inductor and captured in CUDA graphs,
    ``runtime.run`` eager between them (vLLM's way), each piece reading the fixed buffer the
    Engram layer before it writes."""

    def __init__(self, runtime, x, backbone) -> None:
        super().__init__(runtime, x)
        T = x.shape[0]
        self.pieces: list[tuple[torch.cuda.CUDAGraph, int | None, torch.Tensor | None]] = []
        source, lo = x, 0
        for block, li in [*sorted(ro.ENGRAM_AT.items()), (backbone.n_blocks, None)]:
            piece = torch.compile(
                lambda h, lo=lo, hi=block: backbone.blocks(h, lo, hi), fullgraph=True
            )
            if li is None:  # the last piece: the step's output
                graph, self.out = ro.capture(lambda piece=piece, h=source: piece(h))
                self.pieces.append((graph, None, None))
            else:  # ends with the Engram layer's input
                graph, hidden = ro.capture(lambda piece=piece, h=source: engram_input(piece(h)))
                self.pieces.append((graph, li, hidden))
                source, lo = runtime.output_buffer(li)[:T][:, 0], block

    def step(self) -> None:
        for graph, li, hidden in self.pieces:
            graph.replay()
            if li is not None:
                self.runtime.run(li, hidden)


class WholeStep(Runner):
    """The whole step (plan included) in one CUDA graph per staging slot, the blocks
    compiled by Inductor and each Engram layer the ``engramrt::run_layer`` operator."""

    FIELDS = ("input_ids", "positions", "query_start_loc", "lookback_token_ids")

    def __init__(self, runtime, x, backbone, batch: HashBatch) -> None:
        super().__init__(runtime, x)
        self.inputs = HashBatch(**{f: getattr(batch, f).clone() for f in self.FIELDS})
        forward = torch.compile(forward_fn(backbone, runtime, compiled_ops=True), fullgraph=True)
        slots: list[int] = []

        def whole() -> torch.Tensor:
            slots.append(runtime.plan(self.inputs).slot)
            return forward(x)

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}
        for _ in range(runtime.num_slots):  # each capture runs whole() thrice: slots alternate
            graph, out = ro.capture(whole)
            self.graphs[slots[-1]], self.outs[slots[-1]] = graph, out
        if len(self.graphs) != runtime.num_slots:
            raise RuntimeError(f"captured slots {sorted(self.graphs)}; expected every slot")
        self._next = 0

    def plan(self, batch: HashBatch) -> Any:
        for name in self.FIELDS:
            getattr(self.inputs, name).copy_(getattr(batch, name), non_blocking=True)
        slot, self._next = self._next, (self._next + 1) % len(self.graphs)
        return _Slot(slot)

    def step(self) -> None:
        raise NotImplementedError  # replays need the slot: see run_steps

    def replay(self, plan: _Slot) -> None:
        self.graphs[plan.slot].replay()
        self.out = self.outs[plan.slot]


@dataclass
class _Slot:
    slot: int


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wait_for_step() -> None:
    """What a synchronous engine waits for between steps: the step's stream, where its
    sampled tokens are (lookups queued on side streams for the next step run on)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def run_steps(runner: Runner, batches: list[HashBatch], loop: str, prefetch: bool) -> float:
    """ms per step of ``runner`` over ``batches`` (``loop``: see the module doc)."""
    sync, early = loop in ("sync", "sync-prefetch"), loop == "sync-prefetch"
    synchronize()
    gc.collect()
    gc.disable()  # a collection inside a block is noise, not the placement's cost
    start = time.perf_counter()
    plan = runner.plan(batches[0])
    for i in range(len(batches)):
        nxt = runner.plan(batches[i + 1]) if prefetch and i + 1 < len(batches) else None
        if isinstance(runner, WholeStep):
            runner.replay(plan)
        else:
            runner.step()
        if i + 1 < len(batches):
            if early and nxt is None:  # queued behind this step's kernels, before the wait
                nxt = runner.plan(batches[i + 1])
            if sync:  # the host waits for the step's stream (its sampled tokens), not the device
                wait_for_step()
            plan = nxt if nxt is not None else runner.plan(batches[i + 1])
    synchronize()
    elapsed = time.perf_counter() - start
    gc.enable()
    return 1e3 * elapsed / len(batches)


@dataclass
class Case:
    placement: str
    mode: str
    workload: str
    loop: str
    ids: str
    runner: Runner | None = None
    skipped: str | None = None
    check: dict = field(default_factory=dict)
    ms: list[float | None] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.mode, self.workload, self.loop, self.ids

    def label(self) -> str:
        return f"{self.placement}/{self.mode}/{self.workload}/{self.loop}/{self.ids}"


def paired_case_stats(case_ms: list[float | None], ref_ms: list[float | None]) -> dict[str, Any]:
    """A case's cost against its reference, round by round (see the module doc)."""
    stats = ro.paired_stats("pct", case_ms, ref_ms)
    timed = [m for m in case_ms if m is not None]
    ref = [m for m in ref_ms if m is not None]
    return {
        "rounds": sum(v is not None for v in stats["pct_rounds"]),
        "median_pct": stats["pct"],
        "p25_pct": stats["pct_p25"],
        "p75_pct": stats["pct_p75"],
        "pct_rounds": stats["pct_rounds"],
        "ms": float(np.median(timed)) if timed else None,
        "ref_ms": float(np.median(ref)) if ref else None,
        "ms_rounds": case_ms,
    }


class WorkerRuntime(EngramRuntime):
    """The runtime with every lookup of a source that has a worker thread sent through it,
    GPU reads included (placements ``*-worker``: the control for starting GPU-read batches
    beside the worker, from the planning thread)."""

    def _beside(self, index, source, ids) -> bool:
        return False


class AlreadyMapped(SharedRows):
    """Rows another live store holds and has already mapped for the GPU."""

    def map_for_device(self, rows: torch.Tensor, holder: object, what: str) -> None:
        return None


def host_stores(layout, device, placement: Placement, base: list | None) -> list:
    """Each layer's host store as ``placement`` sets it (:meth:`Placement.host_options`, the
    queued gather's buffers sized for a prefill chunk), over ``base``'s rows when given."""
    queued_rows = PREFILL_TOKENS * layout.config.n_cols
    if base is None:
        options = placement.host_options(queued_rows)
        first = synthetic_stores(layout, TablePlacement(options, device), seed=1)
        if all(placement.host_options(queued_rows, li) == options for li in range(len(first))):
            return first
        base = first  # the rows made once, each layer's store over them as the placement sets
    return [
        HostGatherRowStore(
            store.num_rows,
            store.E,
            placement.host_options(queued_rows, li),
            device=device,
            host_rows=AlreadyMapped(store.source, owner=store),
        )
        for li, store in enumerate(base)
    ]


def frozen_profile(args, checker: EngramRuntime, vocab_size: int, device) -> list[torch.Tensor]:
    """The row ids ``[T, L, C]`` that fill the frozen caches: ``--frozen-profile-steps``
    decode steps of each ``--ids`` kind, other requests than the timed ones (the runtime
    bench's warm-up draws: other Zipf draws, the second half of each request's text)."""
    ns = argparse.Namespace(
        workloads=["decode"], ids=",".join(args.ids), cache_warm_steps=args.frozen_profile_steps
    )
    ids = []
    for batches in ro.build_workloads(ns, vocab_size, device, warm=True).values():
        for batch in batches:
            ids.append(checker.plan(batch).row_ids.clone())  # the slots are reused
    return ids


def frozen_caches(stores: list, placement: Placement, profile: list[torch.Tensor]) -> list:
    """``stores`` with each layer of ``placement.frozen_layers`` behind a frozen cache of
    ``placement.frozen_cache`` of its table, filled from ``profile``."""
    from engramrt.cache import CachedRowStore

    cached = list(stores)
    for li in placement.frozen_layers:
        store = stores[li]
        cache = CachedRowStore(
            store, int(store.num_rows * store.row_bytes * placement.frozen_cache), frozen=True
        )
        cache.warm_up(ids[:, li] for ids in profile)
        cached[li] = cache
    return cached


def frozen_cache_report(stores: dict[str, list], frozen: list[Placement]) -> dict:
    """Per frozen-cache placement and cached layer, what the cache holds and its hits over
    every eager lookup so far (its checks, warm-up and timed steps, all modes; not the
    replays of a CUDA graph)."""
    report: dict = {}
    for placement in frozen:
        layers = {}
        for li in placement.frozen_layers:
            cache = stores[placement.name][li]
            stats = cache.stats()
            layers[str(li)] = {
                "share": placement.frozen_cache,
                "slots": cache.num_slots,
                "rows_held": int((cache.policy.tags >= 0).sum()),
                "lookups": stats.lookups,
                "hit_rate": stats.hit_rate,
            }
        report[placement.name] = layers
    return report


def parse_read_kernels(text: str) -> dict[str, Placement]:
    """``--read-kernels``: placement name -> the placement, ``default`` with these settings
    for the GPU's reads."""
    placements = {}
    for spec in (v for v in text.split(",") if v):
        try:
            kernel = ro.read_kernel_config(spec)
        except ValueError as exc:
            raise SystemExit(f"--read-kernels={text!r}: {exc}") from None
        programs = "-" if kernel.max_programs is None else kernel.max_programs
        name = f"read-{kernel.rows_per_program}-{kernel.num_warps}-{programs}"
        placements[name] = replace(PLACEMENTS["default"], name=name, kernel=kernel)
    return placements


def parse_list(text: str, choices: tuple[str, ...], name: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    unknown = [v for v in values if v not in choices]
    if unknown or not values:
        raise SystemExit(f"--{name}={text!r}; expected a comma-separated list of {choices}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table-gib", type=float, default=8.0)
    p.add_argument(
        "--engram-blocks",
        default="1,14",
        help="the blocks that start with an Engram layer (V4.1-Flash: 1,14; 1 alone for one "
        "full-size layer on one GPU)",
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--workloads", default="decode")
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--ids", default="random")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per block")
    p.add_argument("--prefill-steps", type=int, default=4, help="timed prefill chunks per block")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=0.0, help="start no round after (0: none)")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="before the rounds, profile this many synchronous steps of every case "
        "(torch.profiler; the top operations by device and host time go in the report)",
    )
    p.add_argument("--trace-dir", default=None, help="keep each profiled case's Chrome trace here")
    p.add_argument("--smoke", action="store_true", help="a CPU-sized backbone (plumbing only)")
    p.add_argument(
        "--read-kernels",
        default="",
        help="more placements: the default with other settings for the GPU's reads of host "
        "memory, comma-separated ROWS:WARPS:PROGRAMS (rows per program, warps, max "
        "programs), each a placement named read-ROWS-WARPS-PROGRAMS",
    )
    p.add_argument(
        "--process-per-mode",
        action="store_true",
        help="run each mode in a process of its own (its cases still paired within it) and "
        "merge the reports: no mode's threads, compiled code or memory outlive it into "
        "another mode's timings",
    )
    p.add_argument(
        "--frozen-profile-steps",
        type=int,
        default=256,
        help="decode steps of other requests, per --ids kind, that fill the frozen-cache "
        "placements' caches before the rounds",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.modes = parse_list(args.modes, MODES, "modes")
    names = parse_list(args.placements, tuple(PLACEMENTS), "placements")
    args.read_kernels = parse_read_kernels(args.read_kernels)
    args.placements = [PLACEMENTS[name] for name in names] + list(args.read_kernels.values())
    args.workloads = parse_list(args.workloads, WORKLOADS, "workloads")
    args.loops = parse_list(args.loops, LOOPS, "loops")
    args.ids = parse_list(args.ids, IDS, "ids")
    for name in ("rounds", "steps", "prefill_steps", "frozen_profile_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}; expected >= 1")
    try:
        args.engram_blocks = sorted({int(b) for b in args.engram_blocks.split(",")})
    except ValueError:
        raise SystemExit(
            f"--engram-blocks={args.engram_blocks!r}; expected comma-separated block indices"
        ) from None
    if not args.engram_blocks or not all(0 < b < 30 for b in args.engram_blocks):
        raise SystemExit(f"--engram-blocks={args.engram_blocks}; expected blocks in 1..29")
    if args.warmup_steps < 0:
        raise SystemExit(f"--warmup-steps={args.warmup_steps}; expected >= 0")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("step_cost: needs a CUDA device (or --smoke for the plumbing on a CPU)")
    if args.out is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        args.out = os.path.join("bench", "results", f"step-cost-{stamp}.json")
    return args


def _without(argv: list[str], flags: tuple[str, ...], valued: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` (switches) and ``valued`` options (``--x V`` or ``--x=V``)."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in flags or (name in valued and "=" in word):
            continue
        if name in valued:
            skip = True
            continue
        kept.append(word)
    return kept


def run_modes_in_processes(args: argparse.Namespace, argv: list[str]) -> dict:
    """Each of ``args.modes`` by this script in a process of its own (``--modes M``), the
    reports merged into one: every mode's cases, profiles and process facts."""
    rest = _without(argv, ("--process-per-mode",), ("--modes", "--out"))
    merged: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes:
            out = os.path.join(scratch, f"{mode}.json")
            command = [sys.executable, os.path.abspath(__file__), *rest, "--modes", mode]
            print(f"step_cost: mode {mode} in its own process", flush=True)
            done = subprocess.run([*command, "--out", out], check=False)
            if done.returncode != 0:
                raise SystemExit(f"step_cost: mode {mode}'s process exited {done.returncode}")
            with open(out) as f:
                report = json.load(f)
            if not merged:
                merged = {**report, "cases": [], "rounds_completed": {}}
            merged["cases"] += report["cases"]
            merged["rounds_completed"][mode] = report["rounds_completed"]
            if report.get("profiles"):
                merged.setdefault("profiles", {}).update(report["profiles"])
    merged["process_per_mode"] = list(args.modes)
    ro.write_report(args.out, merged)
    return merged


def main(argv=None) -> dict:
    begun = time.perf_counter()
    args = parse_args(argv)
    if args.smoke:
        ro.use_smoke_backbone()
        args.modes = [m for m in args.modes if m == "eager"]  # no CUDA: eager only
    if args.process_per_mode:
        return run_modes_in_processes(args, list(sys.argv[1:] if argv is None else argv))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    if max(args.engram_blocks) >= ro.BLOCKS:
        raise SystemExit(f"--engram-blocks={args.engram_blocks}; the backbone has {ro.BLOCKS}")
    ro.ENGRAM_AT = {b: li for li, b in enumerate(args.engram_blocks)}
    cfg = ro.scaled_config(args.table_gib, layer_ids=tuple(args.engram_blocks))
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    blocks, _ = ro.make_backbone(cfg, device)
    backbone = Backbone(blocks).to(device)
    del blocks
    heads = []
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(cfg.n_layers):
        head = EngramHead(
            cfg,
            device=device,
            backend="auto" if device.type == "cuda" else "reference",
            validate=False,
        )
        head.load_weights(
            wkv=(
                torch.randn(
                    (ro.HC + 1) * ro.D, cfg.n_cols * cfg.head_dim, generator=g, device=device
                )
                * 0.02
            ).bfloat16(),
            q_weight=torch.ones(ro.HC, ro.D, dtype=torch.bfloat16, device=device),
            k_weight=torch.ones(ro.HC, ro.D, dtype=torch.bfloat16, device=device),
        )
        heads.append(head)

    device_stores = synthetic_stores(layout, TablePlacement("device", device), seed=1)
    placements = [DEVICE, *args.placements]
    stores: dict[str, list] = {p.name: device_stores for p in placements if not p.host}
    # The first host placement maps the shared rows for GPU reads; the CPU-only ones read none.
    base = None
    for placement in sorted((p for p in placements if p.host), key=lambda p: p.cpu_only):
        stores[placement.name] = host_stores(layout, device, placement, base)
        base = base or stores[placement.name]
    checker = EngramRuntime(
        NgramHasher(consts, token_map, device), device_stores,
        max_tokens=PREFILL_TOKENS, max_requests=512, validate=False,
    )  # fmt: skip

    frozen = [p for p in placements if p.frozen_cache]
    if frozen:
        profile = frozen_profile(args, checker, token_map.vocab_size, device)
        for placement in frozen:
            stores[placement.name] = frozen_caches(stores[placement.name], placement, profile)
    rng = np.random.default_rng(0)
    workloads: dict[tuple[str, str], list[HashBatch]] = {}
    decode_steps = args.rounds * args.steps + args.warmup_steps + 4
    for ids in args.ids if "decode" in args.workloads else []:
        ns = argparse.Namespace(workloads=["decode"], ids=ids, decode_steps=decode_steps)
        (batches,) = ro.build_workloads(ns, token_map.vocab_size, device).values()
        workloads[("decode", ids)] = batches
    if "prefill" in args.workloads:
        chunks = ro.prefill_batches(rng, token_map.vocab_size, device)
        workloads[("prefill", "random")] = [b for b in chunks if b.num_tokens == PREFILL_TOKENS]

    cases: list[Case] = []
    runtimes: list[EngramRuntime] = []
    for (workload, ids), batches in workloads.items():
        T = DECODE_TOKENS if workload == "decode" else PREFILL_TOKENS
        x = torch.randn(T, ro.D, device=device, dtype=torch.bfloat16)
        modes = (
            args.modes if workload == "decode" else [m for m in args.modes if m in PREFILL_MODES]
        )
        for placement in placements:
            for mode in modes:
                kind = WorkerRuntime if placement.worker else EngramRuntime
                runtime = kind(
                    NgramHasher(consts, token_map, device),
                    stores[placement.name],
                    heads=heads,
                    max_tokens=T,
                    max_requests=512,
                    validate=False,
                    **placement.runtime_options(),
                )
                runtimes.append(runtime)
                runner, skipped, check = None, None, {}
                if mode == "graph" and any(src.host_sync for src in runtime.sources):
                    skipped = "a source needs a host thread (host_sync): no whole-step capture"
                else:
                    try:
                        runner = make_runner(mode, runtime, x, backbone, batches[0])
                        check = check_case(runner, checker, batches[1])
                        skipped = None if check["passed"] else "check failed"
                    except Exception as error:  # a mode this placement cannot run: say why
                        skipped = f"{type(error).__name__}: {error}"[:400]
                        runtime.abandon()
                label = f"{placement.name}/{mode}/{workload}/{ids}"
                print(f"check {label}: {skipped} {check}", flush=True)
                for loop in args.loops:
                    cases.append(
                        Case(placement.name, mode, workload, loop, ids, runner, skipped, check)
                    )

    timed = [c for c in cases if c.skipped is None]
    profiles = profile_cases(args, timed, workloads) if args.profile_steps else {}
    order_rng = np.random.default_rng(1)
    started = time.perf_counter()
    print(f"step_cost: {len(timed)} cases ready in {started - begun:.0f} s", flush=True)
    report: dict = {}
    for round_index in range(args.rounds):
        if round_index and args.max_seconds and time.perf_counter() - started > args.max_seconds:
            break
        for ci in order_rng.permutation(len(timed)):
            case = timed[ci]
            batches = workloads[(case.workload, case.ids)]
            steps = args.steps if case.workload == "decode" else args.prefill_steps
            warm, window = ro.block_window(len(batches), round_index, steps, args.warmup_steps)
            prefetch = case.workload == "prefill"
            assert case.runner is not None
            with launching_cpus(PLACEMENTS.get(case.placement)):
                if warm:
                    run_steps(case.runner, [batches[i] for i in warm], case.loop, prefetch)
                ms = run_steps(case.runner, [batches[i] for i in window], case.loop, prefetch)
            case.ms.append(ms)
            print(f"round {round_index:2d} {case.label():45s} {ms:.3f} ms/step", flush=True)
        for case in cases:
            if case.skipped is not None or len(case.ms) <= round_index:
                case.ms.append(None)
        report = summarize(args, cfg, env, cases, round_index + 1)
        if profiles:
            report["profiles"] = profiles
        if frozen:
            report["frozen_caches"] = frozen_cache_report(stores, frozen)
        ro.write_report(args.out, report)
    for row in report.get("cases", []):
        if row.get("median_pct") is not None:
            print(
                f"{row['placement']:9s} {row['mode']:9s} {row['workload']:7s} {row['loop']:6s} "
                f"{row['ids']:6s} {row['median_pct']:+6.2f}% ({row['p25_pct']:+.2f}, "
                f"{row['p75_pct']:+.2f})  ref {row['ref_ms']:.3f} ms"
            )
    for runtime in runtimes:
        runtime.close()
    return report


@contextlib.contextmanager
def launching_cpus(placement: Placement | None) -> Iterator[None]:
    """The launching thread on its own CPU while a pinned placement's case runs."""
    if placement is None or not placement.pinned:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, LAUNCHER_CPUS[0])
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def profile_cases(args: argparse.Namespace, timed: list[Case], workloads: dict) -> dict:
    """``--profile-steps`` synchronous steps of every timed synchronous case, profiled
    (:func:`profile_case`); each Chrome trace kept under ``--trace-dir`` when given."""
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    profiles = {}
    for case in timed:
        if case.loop != "sync":
            continue
        batches = workloads[(case.workload, case.ids)][: args.profile_steps + 1]
        assert case.runner is not None
        trace = (
            os.path.join(args.trace_dir, case.label().replace("/", "-") + ".json")
            if args.trace_dir
            else None
        )
        with launching_cpus(PLACEMENTS.get(case.placement)):
            profiles[case.label()] = profile_case(case.runner, batches, trace_path=trace)
        print(f"profile {case.label()}: {profiles[case.label()]['timeline']}", flush=True)
    return profiles


def make_runner(mode: str, runtime, x, backbone, batch) -> Runner:
    if mode in ("eager", "compiled"):
        return Eager(runtime, x, backbone, compiled=mode == "compiled")
    if mode == "piecewise":
        return Piecewise(runtime, x, backbone)
    return WholeStep(runtime, x, backbone, batch)


def profile_case(
    runner: Runner, batches: list[HashBatch], top: int = 12, trace_path: str | None = None
) -> dict:
    """What a case's synchronous steps spend, by operation: the first batch as a warm-up,
    then the rest under ``torch.profiler``; per step, microseconds of device time and of
    host time (each operation's own, its children excluded), and on a GPU the steps'
    timeline (:func:`step_timeline`; the Chrome trace kept at ``trace_path`` if given)."""
    from torch.profiler import ProfilerActivity, profile

    run_steps(runner, batches[:1], "sync", prefetch=False)
    steps = batches[1:]
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        ms = run_steps(runner, steps, "sync", prefetch=False)
    events = prof.key_averages()
    timeline = None
    if torch.cuda.is_available():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        if trace_path is not None:
            ro.write_report(trace_path, trace)
        timeline = step_timeline(trace.get("traceEvents", []))

    def ranked(attr: str) -> list[dict]:
        rows = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:top]
        return [
            {
                "name": e.key[:120],
                "us_per_step": getattr(e, attr, 0.0) / len(steps),
                "calls_per_step": e.count / len(steps),
            }
            for e in rows
            if getattr(e, attr, 0.0) > 0
        ]

    return {
        "steps": len(steps),
        "ms_per_step_profiled": ms,
        "device": ranked("self_device_time_total"),
        "host": ranked("self_cpu_time_total"),
        "timeline": timeline,
    }


STEP_KERNEL = "_ngram_hash_kernel"  # one launch per step, its first device work
LOOKUP_KERNEL = "_lookup_rows_kernel"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def step_timeline(events: list[dict]) -> dict[str, Any] | None:
    """Where a profiled run's synchronous steps spend device time, from a Chrome trace's
    events: steps split at each hash kernel's start; per step (medians, microseconds)
    ``span`` (from one step's hash to the next's, or to the last kernel), ``busy`` (the
    union of every stream's device work in it), ``idle`` (the rest: the GPU waiting for
    the host), ``lookups`` (each lookup kernel's duration, in launch order), ``stall0``
    (how long the step's stream sat waiting for the first lookup: from its last kernel
    before that lookup ended to the lookup's end, when its next kernel starts within
    10 us of it) and ``host_gap`` (from the end of the host's previous synchronisation
    to the step's hash kernel). None when the trace holds no step."""
    kernels = sorted(
        (
            (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""),
             (e.get("args") or {}).get("stream"))
            for e in events
            if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS
        ),
        key=lambda k: k[0],
    )  # fmt: skip
    syncs = sorted(
        float(e["ts"]) + float(e.get("dur", 0.0))
        for e in events
        if e.get("ph") == "X"
        and e.get("name") in ("cudaDeviceSynchronize", "cudaStreamSynchronize")
    )
    starts = [k for k in kernels if k[2].startswith(STEP_KERNEL)]
    if not starts:
        return None
    main = starts[0][3]
    rows: list[dict[str, Any]] = []
    for i, first in enumerate(starts):
        t0 = first[0]
        t1 = starts[i + 1][0] if i + 1 < len(starts) else max(k[1] for k in kernels)
        inside = [k for k in kernels if t0 <= k[0] < t1]
        busy, edge = 0.0, t0
        for s, e, _, _ in inside:
            if e > edge:
                busy += e - max(s, edge)
                edge = e
        lookups = [k for k in inside if k[2].startswith(LOOKUP_KERNEL)]
        stall0 = 0.0
        if lookups:
            end0 = lookups[0][1]
            on_main = [k for k in inside if k[3] == main]
            before = [k[1] for k in on_main if k[1] <= end0]
            after = [k[0] for k in on_main if k[0] >= end0]
            if before and after and after[0] - end0 <= 10.0:
                stall0 = end0 - max(before)
        prior = [t for t in syncs if t <= t0]
        rows.append(
            {
                "span": t1 - t0,
                "busy": busy,
                "idle": t1 - t0 - busy,
                "lookups": [k[1] - k[0] for k in lookups],
                "stall0": stall0,
                "host_gap": t0 - prior[-1] if prior else None,
            }
        )

    def med(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    n_lookups = max(len(r["lookups"]) for r in rows)
    return {
        "steps": len(rows),
        **{k: med([r[k] for r in rows]) for k in ("span", "busy", "idle", "stall0")},
        "host_gap": med([r["host_gap"] for r in rows if r["host_gap"] is not None]),
        "lookups": [
            med([r["lookups"][j] for r in rows if len(r["lookups"]) > j]) for j in range(n_lookups)
        ],
    }


def check_case(runner: Runner, checker: EngramRuntime, batch: HashBatch) -> dict:
    """The runner's step of ``batch`` (twice: warm-up, then checked): its staged rows bit for
    bit the GPU-memory tables' rows, and a finite output."""
    T = batch.num_tokens
    for _ in range(2):
        plan = runner.plan(batch)
        if isinstance(runner, WholeStep):
            runner.replay(plan)
        else:
            runner.step()
    synchronize()
    expected = checker.plan(batch)
    rows_equal = all(
        torch.equal(
            runner.staged(plan, li, T).view(torch.int16), expected.rows(li).view(torch.int16)
        )
        for li in range(checker.n_layers)
    )
    finite = bool(torch.isfinite(runner.out.float()).all())
    return {"rows_equal": rows_equal, "finite": finite, "passed": rows_equal and finite}


def summarize(args, cfg, env: dict, cases: list[Case], rounds_done: int) -> dict:
    refs = {c.key: c for c in cases if c.placement == DEVICE.name}
    rows = []
    for case in cases:
        row: dict[str, Any] = {
            "mode": case.mode,
            "placement": case.placement,
            "table_gib": args.table_gib,
            "workload": case.workload,
            "loop": case.loop,
            "ids": case.ids,
            "tokens": DECODE_TOKENS if case.workload == "decode" else PREFILL_TOKENS,
            "check": case.check,
        }
        if case.skipped is not None:
            row["skipped"] = case.skipped
        ref = refs[case.key]
        if case.placement == DEVICE.name:
            timed = [m for m in case.ms if m is not None]
            row.update({"rounds": len(timed), "ms": float(np.median(timed)) if timed else None})
            row["ms_rounds"] = case.ms
        elif case.skipped is None and ref.skipped is None:
            row.update(paired_case_stats(case.ms, ref.ms))
        rows.append(row)
    return {
        "bench": "step_cost",
        "environment": env,
        "table_gib_per_layer": args.table_gib,
        "config": cfg.name,
        "engram_at_blocks": sorted(ro.ENGRAM_AT),
        "backbone": {"hidden": ro.D, "ffn": ro.FFN, "blocks": ro.BLOCKS},
        "steps_per_block": {"decode": args.steps, "prefill": args.prefill_steps},
        "warmup_steps": args.warmup_steps,
        "rounds_completed": rounds_done,
        "smoke": args.smoke,
        "cases": rows,
    }


if __name__ == "__main__":
    main()
