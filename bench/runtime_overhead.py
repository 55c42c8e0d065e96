"""What does keeping the Engram tables off the GPU cost? (run on a GPU machine)

    python bench/runtime_overhead.py [--table-gib 16] [--out report.json]

A synthetic backbone of 30 dense bf16 blocks sized like a 7B model (hidden
4096, MLP 11008, no attention kernel: the projections only), Engram layers
at the start of blocks 1 and 14 as in DeepSeek-V4.1-Flash (``engram_layer_ids``
[1, 14]: one block precedes the first; ``--engram-at`` moves them; before
this option the bench ran them after blocks 1 and 14, ``--engram-at 2,15``),
with V4.1-Flash row shapes (C = 24 columns of E = 256)
and a V4.1 layout scaled so each layer's table is ``--table-gib`` GiB (default
16: 32 GiB for the two). Each step: hash ids for both layers (one launch),
start both lookups, run the blocks; at block 1 and 14 wait for that layer's
rows and run the library's Engram head on them (wkv, bf16, and the fused
gate over 4 streams).

Decode ids (``--ids``): ``random`` (uniform token ids), ``text`` (real text:
the CPython standard library's top-level modules tokenised with the
DeepSeek-V4 tokenizer, concatenated in name order and cut into one slice
per request; each request decodes its slice, hashed by the runtime's own
hasher with lookback ids), ``zipf`` (token ids drawn from a Zipf law over a
random ranking of the vocabulary). Real text and Zipf ids are what a
hot-row cache is for (``host-cache``).

Workloads (the paper's): decode steps of 256 requests x 1 token; prefill of
512 sequences with lengths uniform in 100..1024, packed into 8,192-token
chunks. Placements (``--tiers``): no lookups at all (``none``: the
Engram layers read fixed rows, so the device placement's cost to the
backbone shows: hashing, side-stream lookup kernels), tables in GPU memory, in host memory
(host-gather tier: ``host`` with its default GPU reads, ``host-cpu`` with
the CPU gathering every row, ``host-mixed`` with the GPU reading the first
Engram layer's rows, which have one block to hide behind, and the CPU
gathering the later layer's, whose bulk copy does not occupy the GPU's
memory system while the blocks run; ``host-inline``: host-mixed's tables with
the GPU's reads on the step's stream before the blocks, ``lookup_overlap="none"``,
so no read runs beside a block; ``host-ids``: host-mixed's tables with every
layer's ids hashed on the host from the step's host mirror, ``plan(batch.with_host(host))``, so the CPU gathers both layers' rows without waiting for the
device and nothing reads host memory beside the blocks), in pinned host
memory read by the kernel (UVA), or on disk. ``--sync-steps`` makes the host
wait for each step before planning the next (a synchronous engine, whose next
tokens come from this step's sampling): without it the host queues steps
ahead of the GPU, which would let ``host-ids`` gather a step's rows while the
GPU still runs the step before, a prefetch the other placements do not get.
Decode runs the backbone as engines do, from CUDA graphs replayed per step
(``--backbones graph``), and for comparison launched kernel by kernel
(``eager``); prefill runs eager.

Without prefetch, a step's lookups start when the step does (its tokens
exist only then: decode's come from the previous step's sampling), so they
hide behind the blocks before each Engram layer. With prefetch, the next
step's lookups start at the beginning of the current one: what an engine
can do when the next step's tokens are known a step early (the next chunk
of a prompt in chunked prefill; drafted tokens). Reports step time and
tokens/s per configuration and the throughput loss of each placement
against GPU memory and against the engine-style baseline in the same
configuration.

Method. The GPU's clock drifts by several percent within seconds under this
load, more than the costs measured here, so no configuration is timed in one
long run. A configuration is a placement x settings (threads, grid) x
workload x backbone x prefetch. Each of ``--rounds`` rounds runs every
configuration once as a short block (``--warmup-steps`` untimed steps, then
``--block-steps`` timed decode steps or ``--prefill-chunks`` timed prefill
chunks; prefill only in the first ``--prefill-rounds`` rounds), in an order
shuffled per round by a numpy generator seeded with ``--seed`` (recorded in
the report). Round r's block takes the window of the workload's batches
starting at ``r * steps`` (wrapping; :func:`block_window`), so a hot-row
cache sees fresh steps each round. Every comparison is paired: in each round
the configuration's ms/step against the reference's in the same round (same
workload, backbone and prefetch), ``100 * (1 - ms_device / ms_config)``
(``loss_vs_gpu_pct``; likewise ``loss_vs_no_lookups_pct`` against ``none``
and ``gain_vs_engine_uva_pct``, ``100 * (ms_engine / ms_config - 1)``), so
drift between rounds cancels; each is reported as the median and quartiles
over rounds (``_p25``, ``_p75``) with the per-round list (``_rounds``;
:func:`paired_stats`), beside the median ms/step over rounds.

A/A control: ``device-again``, a second runtime over the same device tables
(no second table), is timed like any placement; its paired loss against
``device`` is the method's resolution, printed at the end as such.

Stalls: on CUDA, timing-enabled events recorded on the main stream right
before and right after each ``handle.rows(li)`` (:class:`StallEvents`,
preallocated per block, read after its final synchronize) give how long the
stream waited for layer li's rows: ``stall_us`` per layer, the median over
every timed step of every round (None on a CPU). For sources that join a
host thread in ``rows`` (host, host-cache, disk) the join is host time: the
stream only idles once the work queued before the join has drained, and the
events then hold that idle time. ``stall_pct_of_step`` is the stalls' sum
as a share of the step; ``interference_pct``, the loss against ``device``
less the stalls beyond the device placement's (``100 * (sum(stall_us) -
sum(device stall_us)) / 1e3 / ms_per_step``), is what the lookups cost the
backbone beyond waiting (contention for memory bandwidth, SMs, copy engines,
the CPU).

A line per block (round, configuration, ms/step, median stalls); the JSON
report (``--out``) is rewritten atomically after every round with
``rounds_completed``; ``--max-seconds`` starts no new round after that many
seconds of timing (the first always runs), and the report holds the rounds
done.

More placements and levers:

- ``engine-uva``: how serving engines read host-memory tables today, the
  baseline: hash, then read every layer's rows over UVA with a full-grid
  kernel on the main stream, before the decoder blocks (no side stream, no
  overlap; a prefetch is the same work, done earlier on the main stream);
- ``host-cache``: the host tier behind the runtime's hot-row cache
  (:class:`engramrt.cache.CachedRowStore`, ``--cache-fraction`` of each
  table's bytes in GPU memory, updated every ``--cache-update-every``
  lookups); the cache keeps its rows from run to run,
  as a serving engine's would, and each result holds its hit rate over the
  timed steps (``cache_hit_rate``, per layer: the median over rounds, each
  round's in ``cache_hit_rate_rounds``). With ``--cache-scope config`` (the
  default) each (workload, backbone, prefetch) has caches of its own over the
  tier's one set of host tables, so a cache sees one kind of traffic and each
  timed step once, as a serving engine's does (the configurations of a round
  time the same window of steps: a cache shared by two of them would time the
  second on steps it has just seen); ``placement`` shares one cache between
  them all. ``--cache-warm-steps`` first runs that many untimed decode steps
  of the same kind of ids, from other requests, through each cache, so that
  the rounds time a cache that has seen traffic before rather than one
  filling up. The variants of a tier (priorities, worker modes, grids) share
  its caches; ``host-cache-torch`` is the same cache with its policy run as
  the torch reference (many small launches per update) instead of the
  policy's Triton kernels; ``host-mixed-cache`` puts the
  cache in front of the default placement's tables (layer 0's misses read by the
  GPU in the probe, layer 1's gathered by the CPU on the cache's miss path);
  ``engine-uva`` reads the ``uva``
  placement's stores when that runs too (each block sets its own grid);
- ``--lookup-priority``: stream priorities of the runtime's lookups
  (``EngramRuntime(lookup_priority=)``; lower is higher in torch);
- ``--lookup-workers``: one ``shared`` worker thread for both layers' host
  lookups, in layer order (the default, as the runtime's), and/or ``per-layer``
  worker threads (``EngramRuntime(lookup_workers=)``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from functools import cache, partial
from typing import Any, NamedTuple

import numpy as np
import torch

from engramrt.bench.runner import environment
from engramrt.cache import CachedRowStore
from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement, tier_class
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap

D, FFN, BLOCKS, HC = 4096, 11008, 30, 4
PREFILL_CHUNK = 8192  # tokens per prefill chunk (--smoke: fewer)
ENGRAM_AT = {1: 0, 14: 1}  # block -> Engram layer index run at its start (V4.1-Flash: [1, 14])
READS = (
    "host",
    "host-mixed",
    "host-inline",
    "uva",
)  # tiers whose kernel reads host memory (settings: --max-programs)
RUNTIME_TIERS = (
    "device",
    "host",
    "host-cpu",
    "host-mixed",
    "host-inline",
    "host-ids",
    "uva",
    "disk",
    "host-cache",
    "host-cache-torch",
    "host-mixed-cache",
)
CACHE_TIERS = ("host-cache", "host-cache-torch", "host-mixed-cache")
"""Placements with the hot-row cache in front of each layer's host table."""


def parse_engram_at(text: str) -> dict[int, int]:
    """``"1,14"`` -> ``{1: 0, 14: 1}``: Engram layer i runs at the start of block b_i."""
    blocks = [int(b) for b in text.split(",")]
    if len(blocks) != 2 or not 0 <= blocks[0] < blocks[1] < BLOCKS:
        raise SystemExit(
            f"--engram-at={text!r}; expected two increasing block indices in [0, {BLOCKS})"
        )
    return {b: li for li, b in enumerate(blocks)}


def scaled_config(table_gib: float, layer_ids: tuple[int, ...] | None = None):
    """The V4.1-Flash config with hidden size D and vocabularies scaled so each
    layer's table holds ``table_gib`` GiB (the primes still follow the layout rules);
    ``layer_ids`` replaces its Engram blocks."""
    base = PRESETS["dsv41-flash"]
    if layer_ids is not None:
        base = base.replace(layer_ids=layer_ids, num_embeddings=(1,) * len(layer_ids))
    rows = int(table_gib * 2**30) // base.row_bytes
    vocab = rows // base.n_cols
    cfg = base.replace(
        vocab_size=(vocab,) * 3,
        num_embeddings=(1,) * base.n_layers,
        hidden_size=D,
        name=f"v41-{table_gib}GiB",
    )
    needed = EngramLayout(cfg, check_num_embeddings=False).num_embeddings
    return cfg.replace(num_embeddings=needed)


HIGHEST_PRIORITY = -100
"""A CUDA stream priority beyond any device's range: torch maps it to the highest."""


def read_kernel_config(spec: str):
    """``R:W:P`` (``P`` a count of programs, or ``-`` for no bound) -> the lookup kernel's
    settings (a ``LookupKernelConfig``); ValueError naming ``spec`` otherwise."""
    from engramrt.errors import ValidationError
    from engramrt.lookup.settings import LookupKernelConfig

    try:
        rows, warps, programs = spec.split(":")
        return LookupKernelConfig(
            rows_per_program=int(rows),
            num_warps=int(warps),
            max_programs=None if programs == "-" else int(programs),
        )
    except (TypeError, ValueError, ValidationError) as exc:
        raise ValueError(f"{spec!r} ({exc}); expected R:W:P, P a count or -") from exc


def block_weights(count, device, generator=None):
    """``count`` dense blocks' weights (QKV, output, gated FFN in and out): normal * 0.02,
    bf16, drawn from ``generator`` (None: torch's default)."""

    def w(*shape):
        return (torch.randn(*shape, device=device, generator=generator) * 0.02).bfloat16()

    return [(w(D, 3 * D), w(D, D), w(D, 2 * FFN), w(FFN, D)) for _ in range(count)]


def make_backbone(cfg, device):
    """The dense blocks' weights and the two Engram heads (random weights, no checks)."""
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).bfloat16()

    blocks = block_weights(BLOCKS, device, g)
    heads = []
    for _ in range(2):
        # On a CPU (a smoke run) the plain torch gate: Triton's interpreter is far too slow.
        backend = "auto" if torch.device(device).type == "cuda" else "reference"
        head = EngramHead(cfg, device=device, backend=backend, validate=False)
        head.load_weights(
            wkv=w((HC + 1) * D, cfg.n_cols * cfg.head_dim),
            q_weight=(1 + w(HC, D)).bfloat16(),
            k_weight=(1 + w(HC, D)).bfloat16(),
        )
        heads.append(head)
    return blocks, heads


def run_block(x, weights):
    wqkv, wo, w13, w2 = weights
    h = (x @ wqkv)[:, :D]
    x = x + h @ wo
    m = x @ w13
    return x + (torch.nn.functional.silu(m[:, :FFN]) * m[:, FFN:]) @ w2


def engram_layer(x, rows, head):
    """The Engram head on the runtime's rows; the backbone's one stream is copied to
    the ``hc`` hyper-connection streams and the first is carried on."""
    t_len = x.shape[0]
    hidden = x.unsqueeze(1).expand(t_len, HC, D).contiguous()
    return head(hidden, rows)[:, 0]


def decode_batches(rng, vocab, steps, device):
    out = []
    pos = rng.integers(100, 1000, 256)
    for _ in range(steps):
        out.append(
            HashBatch(
                input_ids=torch.tensor(rng.integers(0, vocab, 256), device=device),
                positions=torch.tensor(pos, device=device),
                query_start_loc=torch.arange(257, dtype=torch.int32, device=device),
                lookback_token_ids=torch.tensor(rng.integers(0, vocab, (256, 3)), device=device),
            )
        )
        pos = pos + 1
    return out


def decode_batches_from(streams, device, start=3):
    """Decode steps of requests that each read one row of ``streams [R, start + steps]``.

    Step t holds token ``start + t`` of every request at that position, with
    the N-1 = 3 tokens before it as lookback ids (column j: position
    ``start + t - 1 - j``), so each step hashes exactly like one-shot
    hashing of the streams.
    """
    streams = np.asarray(streams, dtype=np.int64)
    n_req, length = streams.shape
    out = []
    for pos in range(start, length):
        out.append(
            HashBatch(
                input_ids=torch.tensor(streams[:, pos], device=device),
                positions=torch.full((n_req,), pos, dtype=torch.int64, device=device),
                query_start_loc=torch.arange(n_req + 1, dtype=torch.int32, device=device),
                lookback_token_ids=torch.tensor(
                    streams[:, pos - 3 : pos][:, ::-1].copy(), device=device
                ),
            )
        )
    return out


def text_streams(docs, requests, length, offset=0):
    """``[requests, length]`` token ids: the documents concatenated, cut into equal slices,
    each request reading its slice from token ``offset`` on."""
    tokens = np.concatenate(docs)
    per = tokens.shape[0] // requests
    if per < offset + length:
        raise SystemExit(
            f"the corpus has {tokens.shape[0]} tokens; {requests} requests of {length} "
            f"from token {offset} of their slices need more"
        )
    return tokens[: per * requests].reshape(requests, per)[:, offset : offset + length]


@cache
def stdlib_docs():
    """The CPython standard library's top-level modules, tokenised (DeepSeek-V4, no special
    tokens), in name order; tokenised once per process (the timed steps and a cache's
    warm-up both read it)."""
    import sysconfig
    from pathlib import Path

    from engramrt.tokenmap import load_tokenizer

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_text(encoding="utf-8") for f in files]
    encoded = load_tokenizer().encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encoded]


def zipf_streams(rng, vocab, requests, length, exponent=1.2, ranking=None):
    """``[requests, length]`` token ids drawn from a Zipf law over a random ranking of the
    vocabulary (rank k has weight ``k**-exponent``): ``ranking`` (a permutation of the
    vocabulary: other draws of the same law), else one drawn from ``rng`` first."""
    if ranking is None:
        ranking = rng.permutation(vocab)
    ranks = np.minimum(rng.zipf(exponent, (requests, length)), vocab) - 1
    return ranking[ranks]


def prefill_batches(rng, vocab, device, chunk=8192):
    lengths = rng.integers(100, 1025, 512)
    seqs = [rng.integers(0, vocab, n) for n in lengths]
    batches, cur = [], []
    for s in seqs:
        start = 0
        while start < len(s):
            room = chunk - sum(len(c[1]) for c in cur)
            take = min(room, len(s) - start)
            cur.append((start, s[start : start + take], s[max(0, start - 3) : start][::-1]))
            start += take
            if sum(len(c[1]) for c in cur) == chunk:
                batches.append(cur)
                cur = []
    if cur:
        batches.append(cur)
    out = []
    for parts in batches:
        ids = np.concatenate([p[1] for p in parts])
        pos = np.concatenate([np.arange(p[0], p[0] + len(p[1])) for p in parts])
        qsl = np.concatenate([[0], np.cumsum([len(p[1]) for p in parts])])
        lb = np.full((len(parts), 3), -1)
        for r, p in enumerate(parts):
            lb[r, : len(p[2])] = p[2]
        out.append(
            HashBatch(
                input_ids=torch.tensor(ids, device=device),
                positions=torch.tensor(pos, device=device),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                lookback_token_ids=torch.tensor(lb, device=device),
            )
        )
    return out


class NoLookups:
    """The backbone alone: Engram layers read fixed rows; nothing is hashed or looked up.

    The baseline that shows what the lookups themselves (hashing, the
    side-stream kernels, copies, gather threads) cost the backbone.
    """

    num_slots = 2

    def __init__(self, max_tokens: int, num_cols: int, E: int, device, layers: int = 2):
        self.staging = [
            [
                torch.zeros(max_tokens, num_cols, E, dtype=torch.bfloat16, device=device)
                for _ in range(layers)
            ]
            for _ in range(self.num_slots)
        ]
        self._next = 0

    def plan(self, batch):
        slot, self._next = self._next, 1 - self._next
        return _FixedRows(self.staging[slot], batch.num_tokens, slot)

    prefetch = plan

    def staged_rows(self, slot: int, layer_index: int):
        return self.staging[slot][layer_index]

    def close(self) -> None:
        pass


class _FixedRows:
    def __init__(self, rows, num_tokens: int, slot: int):
        self._rows, self.num_tokens, self.slot = rows, num_tokens, slot

    def rows(self, layer_index: int):
        return self._rows[layer_index][: self.num_tokens]


class EngineStyle:
    """The engine-style baseline: hash, then read every layer's rows with the stores'
    kernels on the current (main) stream, before the decoder blocks.

    What serving engines do with host-memory tables today (``engine-uva``: UVA
    stores with a full grid, one program per tile). A prefetch is the same
    work on the main stream, done earlier.
    """

    def __init__(self, hasher, stores, max_tokens: int, num_slots: int = 2):
        self.hasher, self.stores = hasher, list(stores)
        n_layers, n_cols = hasher.consts.n_layers, hasher.consts.n_cols
        device = hasher.device
        self.row_ids = [
            torch.empty(max_tokens, n_layers, n_cols, dtype=hasher.out_dtype, device=device)
            for _ in range(num_slots)
        ]
        self.staging = [
            [
                torch.empty(max_tokens, n_cols, s.E, dtype=torch.bfloat16, device=device)
                for s in self.stores
            ]
            for _ in range(num_slots)
        ]
        self.num_slots = num_slots
        self._next = 0

    def plan(self, batch):
        slot = self._next
        self._next = (slot + 1) % self.num_slots
        t_len = batch.num_tokens
        row_ids = self.row_ids[slot][:t_len]
        self.hasher(batch, None, out=row_ids)
        for li, store in enumerate(self.stores):
            store.fetch(row_ids[:, li], self.staging[slot][li][:t_len])
        return _FixedRows(self.staging[slot], t_len, slot)

    prefetch = plan

    def staged_rows(self, slot: int, layer_index: int):
        return self.staging[slot][layer_index]

    def close(self) -> None:
        pass


class HostIdsRuntime:
    """An :class:`EngramRuntime` planned with each step's host copy as well
    (``plan(batch.with_host(host))``): the ``host-ids`` placement, an engine that keeps its
    requests' token ids on the host. The host copies are made once per batch, outside
    the timing, as an engine's own arrays would be."""

    def __init__(self, runtime: EngramRuntime):
        self.runtime = runtime
        self._host: dict[int, tuple[HashBatch, HashBatch]] = {}

    def host_batch(self, batch: HashBatch) -> HashBatch:
        kept = self._host.get(id(batch))
        if kept is None or kept[0] is not batch:
            kept = (batch, batch.to("cpu"))
            self._host[id(batch)] = kept
        return kept[1]

    def plan(self, batch):
        return self.runtime.plan(batch.with_host(self.host_batch(batch)))

    prefetch = plan

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(runtime, batches, forward, prefetch, stalls=None, sync_steps=False):
    """Time ``forward(handle, batch)`` over ``batches``, the lookups started per step.

    With ``prefetch`` the next step's lookups start before this step's
    forward; without, when the next step starts. With ``stalls`` (a
    :class:`StallEvents` of at least ``len(batches)`` steps) the forward is
    called as ``forward(handle, batch, stalls)`` and marks its waits for rows.
    With ``sync_steps`` the host waits for each step to finish before it plans
    the next, as a synchronous engine's decode loop does (the next step's tokens
    come from this one's sampling); without, it queues steps ahead of the GPU.
    """
    tokens = sum(b.num_tokens for b in batches)
    device = batches[0].input_ids.device
    synchronize(device)
    start = time.perf_counter()
    handle = runtime.plan(batches[0])
    for i, batch in enumerate(batches):
        nxt = None
        if prefetch and i + 1 < len(batches):
            nxt = runtime.prefetch(batches[i + 1])
        if stalls is None:
            forward(handle, batch)
        else:
            stalls.step_index = i
            forward(handle, batch, stalls)
        if i + 1 < len(batches):
            if sync_steps:
                synchronize(device)
            handle = nxt if nxt is not None else runtime.plan(batches[i + 1])
    synchronize(device)
    return summary(batches, tokens, time.perf_counter() - start)


class StallEvents:
    """Timing-enabled CUDA events around each ``handle.rows(li)`` of a block's steps.

    Preallocated per block (``[steps][layers]`` pairs) and recorded on the
    current stream right before and right after the call, so the elapsed time
    between a pair is how long the main stream stalled on that layer's rows.
    For sources whose ``rows`` joins a host thread the join is host time: the
    stream stalls only once the work queued before it has drained, and the
    pair then holds that idle time. Read (:meth:`stall_us`) only after the
    block's final synchronize: nothing here syncs the host.
    """

    def __init__(self, steps: int, layers: int = 2):
        self.events = [
            [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(layers)
            ]
            for _ in range(steps)
        ]
        # torch creates an event's CUDA handle at its first record: record each once
        # here, before the block's timing starts, so the timed steps only re-record.
        for step in self.events:
            for pair in step:
                for event in pair:
                    event.record()
        self.step_index = 0

    def rows(self, handle, layer_index: int):
        before, after = self.events[self.step_index][layer_index]
        before.record()
        rows = handle.rows(layer_index)
        after.record()
        return rows

    def stall_us(self, steps: int) -> list[list[float]]:
        """``[layers][steps]`` microseconds of the first ``steps`` steps (after a synchronize)."""
        layers = len(self.events[0])
        return [
            [1e3 * self.events[i][li][0].elapsed_time(self.events[i][li][1]) for i in range(steps)]
            for li in range(layers)
        ]


def _rows(handle, layer_index: int, stalls):
    return handle.rows(layer_index) if stalls is None else stalls.rows(handle, layer_index)


def eager_forward(backbone, device, engram_at=ENGRAM_AT):
    """The backbone launched kernel by kernel from Python, as ``forward(handle, batch)``."""
    blocks, engram = backbone

    def forward(handle, batch, stalls=None) -> None:
        x = torch.randn(batch.num_tokens, D, device=device, dtype=torch.bfloat16)
        for b, weights in enumerate(blocks):
            if b in engram_at:
                li = engram_at[b]
                x = engram_layer(x, _rows(handle, li, stalls), engram[li])
            x = run_block(x, weights)

    return forward


def summary(batches, tokens, seconds):
    return {
        "steps": len(batches),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ms_per_step": 1e3 * seconds / len(batches),
    }


def capture(fn):
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream), and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class GraphedBackbone:
    """The backbone as engines run decode: CUDA graphs, replayed per step.

    Three pieces split at the Engram layers (for Engram at blocks 1 and 14:
    block 0; Engram layer 0 and blocks 1-13; Engram layer 1 and blocks
    14-29), the last two captured once per staging slot of the runtime, since
    each slot's rows live at their own fixed address. Between pieces the step
    waits for that layer's rows.
    """

    def __init__(self, runtime, backbone, num_tokens, device, engram_at=ENGRAM_AT):
        blocks, engram = backbone
        first, second = sorted(engram_at)
        self.x = torch.randn(num_tokens, D, device=device, dtype=torch.bfloat16)

        def piece(x, lo, hi):
            for weights in blocks[lo:hi]:
                x = run_block(x, weights)
            return x

        # No block before the first Engram layer: nothing to replay before its wait.
        self.head, head_out = capture(lambda: piece(self.x, 0, first)) if first else (None, self.x)
        self.middle, self.tail = [], []
        for slot in range(runtime.num_slots):
            rows = [runtime.staged_rows(slot, li)[:num_tokens] for li in range(2)]
            graph, mid_out = capture(
                lambda rows=rows: piece(engram_layer(head_out, rows[0], engram[0]), first, second)
            )
            self.middle.append(graph)
            graph, _ = capture(
                lambda rows=rows, mid_out=mid_out: piece(
                    engram_layer(mid_out, rows[1], engram[1]), second, len(blocks)
                )
            )
            self.tail.append(graph)

    def step(self, handle, batch=None, stalls=None) -> None:
        if self.head is not None:
            self.head.replay()
        _rows(handle, 0, stalls)  # the stream waits for layer 0's rows
        self.middle[handle.slot].replay()
        _rows(handle, 1, stalls)
        self.tail[handle.slot].replay()


WHOLE_TIERS = ("none", "device", "device-again", "uva", "engine-uva")
"""Placements a whole step can be captured with (no source needs the host)."""


class WholeStepGraph:
    """A decode step as engines that capture the whole model run it (``--backbones
    whole``): hashing, the lookups (on the runtime's side stream, or on the main
    stream for ``engine-uva``) and every block in one CUDA graph per staging slot,
    replayed per step after the step's ids are copied into fixed input buffers.

    It stands in for both the runtime (:meth:`step` copies a batch in and picks
    its slot's graph) and the forward (:meth:`forward` replays it). No host work
    remains between a step's kernels, so what a placement costs here is the
    device's alone. Only placements whose sources need no host synchronisation
    can be captured (:data:`WHOLE_TIERS`); a prefetch cannot be expressed (the
    next step's ids would overwrite this step's inputs before its replay), and
    stalls cannot be timed inside a graph.
    """

    FIELDS = ("input_ids", "positions", "query_start_loc", "lookback_token_ids")

    def __init__(self, runtime, backbone, batch, device, engram_at=ENGRAM_AT, check=None):
        blocks, engram = backbone
        self.inputs = HashBatch(**{f: getattr(batch, f).clone() for f in self.FIELDS})
        self.x = torch.randn(batch.num_tokens, D, device=device, dtype=torch.bfloat16)
        slots: list[int] = []

        def whole():
            handle = runtime.plan(self.inputs)
            slots.append(handle.slot)
            x = self.x
            for b, weights in enumerate(blocks):
                if b in engram_at:
                    li = engram_at[b]
                    x = engram_layer(x, handle.rows(li), engram[li])
                x = run_block(x, weights)
            return x

        # Each capture runs ``whole`` three times (two warm-ups, then the capture), so
        # the runtime's slots alternate from one capture to the next.
        self.graphs: dict[int, Any] = {}
        for _ in range(runtime.num_slots):
            graph, _ = capture(whole)
            self.graphs[slots[-1]] = graph
        if len(self.graphs) != runtime.num_slots:
            raise RuntimeError(f"captured slots {sorted(self.graphs)}; expected every slot")
        self._next = 0
        if check is not None and not isinstance(runtime, NoLookups):
            self._check(runtime, check)

    def _check(self, runtime, batch) -> None:
        """Every slot's replay of ``batch`` (not the batch it was captured with: the
        graph must read its inputs) writes the rows an eager step of it writes."""
        for slot, graph in self.graphs.items():
            self.plan(batch)
            self._next = 0
            graph.replay()
            torch.cuda.synchronize()
            replayed = [
                runtime.staged_rows(slot, li)[: batch.num_tokens].clone() for li in range(2)
            ]
            eager = runtime.plan(batch)
            for li in range(2):
                if not torch.equal(
                    replayed[li].view(torch.int16), eager.rows(li).view(torch.int16)
                ):
                    raise RuntimeError(f"the whole-step graph of slot {slot} wrote other rows")
        torch.cuda.synchronize()

    def plan(self, batch):
        for name in self.FIELDS:
            getattr(self.inputs, name).copy_(getattr(batch, name), non_blocking=True)
        slot, self._next = self._next, (self._next + 1) % len(self.graphs)
        return _FixedRows([], batch.num_tokens, slot)

    def forward(self, handle, batch=None) -> None:
        self.graphs[handle.slot].replay()


def parse_programs(text: str):
    """``"default"`` -> None (the store's own settings); ``"16"`` or ``"16:64"`` ->
    (max_programs, rows_per_program), ``"0"`` for an unbounded grid; ``"0/16"``:
    one setting per Engram layer (here: a full grid for the first layer, whose
    rows have one block to hide behind, 16 programs for the second) -> a tuple
    of such pairs."""
    if text == "default":
        return None
    if "/" in text:
        return tuple(parse_programs(part) for part in text.split("/"))
    programs, _, rows = text.partition(":")
    return int(programs) or None, int(rows) if rows else None


def layer_grid(programs, layer_index: int):
    """The (max_programs, rows_per_program) of one layer from a :func:`parse_programs`
    value that is not None."""
    return programs[layer_index] if isinstance(programs[0], tuple) else programs


def block_window(num_batches: int, round_index: int, steps: int, warmup: int = 0):
    """The batch indices of round ``round_index``'s block: ``(warm-up, timed)``.

    The timed window starts at ``round_index * steps`` and wraps around the
    workload's ``num_batches`` batches, so successive rounds time fresh steps
    (a hot-row cache sees tokens it has not seen in the previous round); the
    ``warmup`` untimed steps are the ones just before it.
    """
    if num_batches < 1 or steps < 1 or warmup < 0:
        raise ValueError(
            f"num_batches={num_batches}, steps={steps}, warmup={warmup}; expected "
            "num_batches >= 1, steps >= 1, warmup >= 0"
        )
    start = round_index * steps
    warm = [(start - warmup + i) % num_batches for i in range(warmup)]
    return warm, [(start + i) % num_batches for i in range(steps)]


def quartiles(values) -> tuple[float, float, float] | tuple[None, None, None]:
    """(p25, median, p75) of ``values`` (linear interpolation); Nones when empty."""
    if len(values) == 0:
        return None, None, None
    p25, p50, p75 = np.percentile(np.asarray(values, dtype=np.float64), [25, 50, 75])
    return float(p25), float(p50), float(p75)


def paired_stats(name: str, config_ms, reference_ms, gain: bool = False) -> dict:
    """Per-round paired comparison of a configuration with a reference of the same rounds.

    ``config_ms`` and ``reference_ms`` are ms/step per round (None where a
    round did not run it). Round r's loss is ``100 * (1 - ref_r / config_r)``
    (the throughput lost against the reference), or with ``gain`` the gain
    ``100 * (ref_r / config_r - 1)``. Both numbers of a round were timed
    moments apart, so drift of the machine between rounds (clocks, other
    tenants) cancels. Returns ``{name: median, name_p25, name_p75,
    name_rounds: [per round, None where unpaired]}``.
    """
    if len(config_ms) != len(reference_ms):
        raise ValueError(
            f"config_ms has {len(config_ms)} rounds, reference_ms {len(reference_ms)}; "
            "expected the same rounds"
        )
    per_round = []
    for ms, ref in zip(config_ms, reference_ms, strict=True):
        if ms is None or ref is None:
            per_round.append(None)
        else:
            per_round.append(100 * (ref / ms - 1) if gain else 100 * (1 - ref / ms))
    p25, p50, p75 = quartiles([v for v in per_round if v is not None])
    return {name: p50, f"{name}_p25": p25, f"{name}_p75": p75, f"{name}_rounds": per_round}


def write_report(path: str, report: dict) -> None:
    """Write ``report`` as JSON atomically: a complete file or the previous one, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=300,
        help="decode batches per workload; blocks take rotating windows of them",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--host-threads",
        default="default",
        help="comma-separated gather thread counts to compare ('default': the store's rule); "
        "all but the first on decode only",
    )
    parser.add_argument(
        "--max-programs",
        default="default",
        help="comma-separated grid limits of the kernel reading host memory (tiers host and "
        "uva), each optionally ':ROWS' rows per program ('default': the store's own settings; "
        "'0': one program per tile; 'A/B': A for the first Engram layer, B for the second), "
        "to compare; all but the first on decode only",
    )
    parser.add_argument("--workloads", default="decode,prefill", help="decode, prefill or both")
    parser.add_argument(
        "--rounds",
        type=int,
        default=15,
        help="rounds; each runs every configuration once as a block, in a shuffled order",
    )
    parser.add_argument("--block-steps", type=int, default=20, help="decode steps timed per block")
    parser.add_argument(
        "--prefill-rounds", type=int, default=5, help="the first rounds that also run prefill"
    )
    parser.add_argument(
        "--prefill-chunks", type=int, default=6, help="8,192-token prefill chunks timed per block"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="untimed steps before each block"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no new round after this many seconds of timing (the first always runs; "
        "the report holds the rounds done)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round block order")
    parser.add_argument(
        "--tiers",
        default="none,device,device-again,host,uva",
        help="placements to compare ('none' runs the backbone without lookups; 'device-again' "
        "a second runtime over the device tables, the A/A control; 'host-cpu' the host tier "
        "without GPU reads; 'host-mixed' GPU reads for the first Engram layer only)",
    )
    parser.add_argument(
        "--backbones",
        default="graph,eager",
        help="decode backbone: CUDA graphs of the blocks between Engram layers (graph), one "
        "graph of the whole step with hashing and lookups (whole: placements in WHOLE_TIERS, "
        "no prefetch), and/or eager",
    )
    parser.add_argument(
        "--engram-at",
        default="1,14",
        help="the blocks whose start runs Engram layers 0 and 1 (V4.1-Flash: 1,14; the "
        "bench's earlier placement, after blocks 1 and 14: 2,15)",
    )
    parser.add_argument(
        "--ids", default="random", help="decode token ids: comma-separated random, text, zipf"
    )
    parser.add_argument(
        "--cache-fraction",
        type=float,
        default=0.05,
        help="host-cache: the hot-row cache's share of each table's bytes",
    )
    parser.add_argument(
        "--cache-scope",
        choices=("config", "placement"),
        default="config",
        help="cache tiers: caches of their own per (workload, backbone, prefetch), over the "
        "tier's one set of host tables, each timed step new to its cache; or one cache "
        "shared by every configuration's blocks",
    )
    parser.add_argument(
        "--cache-warm-steps",
        type=int,
        default=0,
        help="cache tiers: untimed decode steps of the same kind of ids (other requests) "
        "through each cache before the rounds",
    )
    parser.add_argument(
        "--cache-update-every",
        type=int,
        default=1,
        help="host-cache: lookups the cache gathers before it updates (CachedRowStore.update_every)",
    )
    parser.add_argument(
        "--lookup-priority",
        default="0",
        help="comma-separated stream priorities of the runtime's lookups to compare",
    )
    parser.add_argument(
        "--lookup-workers",
        default="shared",
        help="comma-separated: per-layer and/or shared (one thread for both layers' host lookups)",
    )
    parser.add_argument(
        "--model-priority",
        default="0",
        help="comma-separated CUDA stream priorities the steps run at, to compare (lower "
        "is higher in torch; 0: the default stream), each paired with the references at "
        "the same priority; the runtime's lookups stay at --lookup-priority",
    )
    parser.add_argument(
        "--sync-steps",
        action="store_true",
        help="the host waits for each step to finish before planning the next, as a "
        "synchronous engine's decode loop does (every placement of the run)",
    )
    parser.add_argument("--device", default="cuda", help="where to run (cpu: --smoke only)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny backbone (hidden 64, 16 blocks) so the whole script runs on a CPU; "
        "use with a small --table-gib, --decode-steps and --tiers none,device,host,"
        "host-cache,engine-uva (engine-uva reads device-tier stores on a CPU)",
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, its counts checked (an error names the option and its value)."""
    args = build_parser().parse_args(argv)
    for option in ("rounds", "block_steps", "prefill_chunks", "decode_steps"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)}; expected >= 1")
    for option in ("prefill_rounds", "warmup_steps", "cache_warm_steps"):
        if getattr(args, option) < 0:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)}; expected >= 0")
    return args


def use_smoke_backbone() -> None:
    """A backbone and prefill chunks small enough for a CPU (``--smoke``): the
    plumbing, not the timings."""
    global D, FFN, BLOCKS, PREFILL_CHUNK
    D, FFN, BLOCKS = 64, 128, 16
    PREFILL_CHUNK = 1024


def build_workloads(
    args, vocab_size: int, device, warm: bool = False
) -> dict[str, list[HashBatch]]:
    """The workloads by name: a decode workload per ``--ids`` kind, then prefill.

    ``warm``: instead, ``--cache-warm-steps`` decode steps per kind from the same
    distribution but other requests (other draws of the same Zipf law; the second half
    of each request's slice of the text), to fill the caches before the rounds."""
    rng = np.random.default_rng(2 if warm else 0)
    steps = args.cache_warm_steps if warm else args.decode_steps
    workloads = {}
    if "decode" in args.workloads:
        for ids in args.ids.split(","):
            if ids == "random":
                batches = decode_batches(rng, vocab_size, steps, device)
            elif ids == "text":
                docs = stdlib_docs()
                offset = sum(len(d) for d in docs) // 256 // 2 if warm else 0
                batches = decode_batches_from(text_streams(docs, 256, steps + 3, offset), device)
            elif ids == "zipf":
                timed = np.random.default_rng(1)  # its ranking first, then the draws
                ranking = timed.permutation(vocab_size)
                draws = np.random.default_rng(3) if warm else timed
                streams = zipf_streams(draws, vocab_size, 256, steps + 3, ranking=ranking)
                batches = decode_batches_from(streams, device)
            else:
                raise SystemExit(f"--ids: {ids!r}; expected random, text or zipf")
            workloads["decode 256x1" + ("" if ids == "random" else f" {ids}")] = batches
    if "prefill" in args.workloads and not warm:
        workloads["prefill 512 seqs 100-1024"] = prefill_batches(
            rng, vocab_size, device, chunk=PREFILL_CHUNK
        )
    return workloads


def warm_caches(bench) -> None:
    """``--cache-warm-steps`` untimed decode steps through every cache placement, per
    decode workload it runs (a serving engine's cache has seen the traffic before)."""
    args = bench.args
    if args.cache_warm_steps == 0:
        return
    warm = build_workloads(args, bench.vocab_size, bench.device, warm=True)
    for index, setup in enumerate(bench.setups):
        if setup.tier not in CACHE_TIERS:
            continue
        runs = {(c.workload, c.backbone) for c in bench.configs if c.setup == index}
        for name, kind in sorted(runs):
            if name not in warm:
                continue
            forward = setup.graphed[name].step if kind == "graph" else bench.eager
            start = time.perf_counter()
            run(setup.runtime, warm[name], forward, prefetch=False)
            rates = [stats.hit_rate for stats in setup.runtime.cache_stats() if stats]
            print(
                f"warmed {setup.label} for {name} ({kind}): {len(warm[name])} steps in "
                f"{time.perf_counter() - start:.1f} s, hit rate "
                + "/".join(f"{rate:.2f}" for rate in rates),
                flush=True,
            )


GATHER_TIERS = ("host", "host-cpu", "host-mixed", "host-inline", "host-ids", "disk")
"""Tiers whose stores gather rows on host threads (settings: --host-threads)."""


class CacheSettings(NamedTuple):
    """The ``host-cache`` placement's cache: its share of each table's bytes, and how many
    lookups it gathers before an update (``CachedRowStore.update_every``)."""

    fraction: float = 0.05
    update_every: int = 1


def build_stores(tier: str, cfg, layout, device, cache: CacheSettings, backend: dict) -> list:
    """Both layers' stores of a runtime tier."""
    cached = tier in CACHE_TIERS
    backing = "host" if tier in ("host-cpu", "host-mixed") or cached else tier
    options = tier_class(backing).options_type(**backend)
    stores = synthetic_stores(layout, TablePlacement(options, device), seed=1)
    for li, store in enumerate(stores):
        if tier == "host-cpu" or (tier in ("host-mixed", "host-mixed-cache") and li > 0):
            store.gpu_reads = False  # before a cache is built over it: its misses follow
    return caches_over(tier, stores, cfg, cache, backend) if cached else stores


def caches_over(tier: str, backings: list, cfg, cache: CacheSettings, backend: dict) -> list:
    """A cache tier's hot-row caches in front of each layer's ``backings`` store."""
    policy = {"policy_backend": "reference"} if tier == "host-cache-torch" else {}
    stores = [
        CachedRowStore(
            store,
            int(cache.fraction * store.nbytes),
            n_heads=cfg.n_heads,
            layer_id=cfg.layer_ids[li],
            max_pending=max(4, cache.update_every),
            **backend,
            **policy,
        )
        for li, store in enumerate(backings)
    ]
    for store in stores:
        store.update_every = cache.update_every
    return stores


class StorePool:
    """Each tier's stores, built on first use and shared by the runtimes of its variants
    (one table in memory per tier; the blocks run one at a time), and the grid each
    store's kernel was built with."""

    def __init__(self, cfg, layout, device, cache: CacheSettings, backend: dict):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.cache, self.backend = cache, backend
        self.built: dict[str, list] = {}
        self.grids: dict[int, tuple] = {}  # id(store) -> (max_programs, rows_per_program) as built

    def stores_of(self, tier: str, scope: tuple | None = None) -> list:
        """The tier's stores; with a ``scope`` (a cache tier's (workload, backbone,
        prefetch)), caches of their own over the tier's host tables."""
        if scope is not None:
            key = f"{tier}@{scope}"
            if key not in self.built:
                backings = [store.backing for store in self.stores_of(tier)]
                self.built[key] = caches_over(tier, backings, self.cfg, self.cache, self.backend)
            return self.built[key]
        if tier not in self.built:
            self.built[tier] = build_stores(
                tier, self.cfg, self.layout, self.device, self.cache, self.backend
            )
            for store in self.built[tier]:
                if hasattr(store, "kernel"):
                    grids = (store.kernel.max_programs, store.kernel.rows_per_program)
                    self.grids[id(store)] = grids
        return self.built[tier]


def new_runtime(hasher, stores, priority, workers, overlap: str = "side") -> EngramRuntime:
    return EngramRuntime(
        hasher,
        stores,
        max_tokens=8192,
        max_requests=512,
        validate=False,
        lookup_priority=priority,
        lookup_workers=workers,
        # Each tier's stores as built: ``host`` reads with the GPU in both layers,
        # ``host-mixed`` in the first only (gpu_reads="first", the runtime's default until
        # 2026-12-04; the default now reads every layer: gpu_reads="all").
        gpu_reads="sources",
        lookup_overlap=overlap,
    )


def tier_variants(tier: str, priorities: list[int], worker_modes: list[str]) -> list[tuple]:
    """The (lookup priority, lookup workers) variants of a ``--tiers`` entry."""
    if tier in RUNTIME_TIERS:  # only threaded lookups have workers to share
        threaded = tier in GATHER_TIERS or tier in CACHE_TIERS
        modes = worker_modes if threaded else worker_modes[:1]
        return [(p, w) for p in priorities for w in modes]
    if tier == "device-again":  # as the device placement's first variant
        return [(priorities[0], worker_modes[0])]
    if tier not in ("none", "engine-uva", "device-again"):
        raise SystemExit(
            f"--tiers: {tier!r}; expected none, device-again, engine-uva or one of "
            f"{', '.join(RUNTIME_TIERS)}"
        )
    return [(None, None)]


class Setup:
    """One placement: a tier's variant, its stores and the runtime (or baseline) over them,
    with its graphed backbones by decode workload (``graphed``; ``whole``, filled by
    :func:`build_whole_graphs`, for ``--backbones whole``)."""

    def __init__(
        self,
        label: str,
        tier: str,
        priority,
        workers,
        stores: list,
        runtime,
        graphed,
        only: set[tuple[str, str, bool]] | None = None,
    ):
        self.label, self.tier, self.priority, self.workers = label, tier, priority, workers
        self.stores, self.runtime = stores, runtime
        self.graphed: dict[str, GraphedBackbone] = graphed
        self.whole: dict[str, WholeStepGraph] = {}
        self.only = only  # the only (workload, backbone, prefetch) it runs (None: all)


def build_placement(
    tier: str, priority, workers, pool: StorePool, make_hasher, scope: tuple | None = None
) -> tuple:
    """(stores, runtime) of one placement: a baseline or an :class:`EngramRuntime`
    (``scope``: a cache tier's (workload, backbone, prefetch), for caches of its own)."""
    stores: list = []
    runtime: Any
    if tier == "none":
        runtime = NoLookups(8192, pool.cfg.n_cols, pool.cfg.head_dim, pool.device)
    elif tier == "engine-uva":
        # The uva placement's stores when it runs too (one table; each block sets
        # its grid). No UVA without a GPU: a CPU smoke run reads device-tier stores.
        stores = pool.stores_of("uva" if pool.device.type == "cuda" else "device")
        runtime = EngineStyle(make_hasher(), stores, max_tokens=8192)
    elif tier == "device-again":
        # The A/A control: a second runtime over the same device tables.
        stores = pool.stores_of("device")
        runtime = new_runtime(make_hasher(), stores, priority, workers)
    elif tier == "host-inline":  # host-mixed's tables, the GPU's reads before the blocks
        stores = pool.stores_of("host-mixed")
        runtime = new_runtime(make_hasher(), stores, priority, workers, overlap="none")
    elif tier == "host-ids":  # host-mixed's tables, every layer's ids hashed on the host
        stores = pool.stores_of("host-mixed")
        runtime = HostIdsRuntime(new_runtime(make_hasher(), stores, priority, workers))
    else:
        stores = pool.stores_of(tier, scope)
        runtime = new_runtime(make_hasher(), stores, priority, workers)
    return stores, runtime


def build_setups(
    tiers: list[str],
    priorities: list[int],
    worker_modes: list[str],
    pool: StorePool,
    make_hasher,
    backbone,
    workloads: dict[str, list[HashBatch]],
    backbones: list[str],
    engram_at: dict[int, int],
    cache_scope: str = "config",
) -> list[Setup]:
    """Every placement of ``--tiers`` in order, each variant with its graphed backbones;
    a cache tier's once per (workload, backbone, prefetch) with ``cache_scope="config"``."""
    setups = []
    for tier in tiers:
        variants = tier_variants(tier, priorities, worker_modes)
        scopes: list[tuple[str, str, bool] | None] = [None]
        if tier in CACHE_TIERS and cache_scope == "config":
            scopes = [
                (name, kind, prefetch)
                for name in workloads
                for kind in (backbones if name.startswith("decode") else ["eager"])
                if kind != "whole"  # no cache tier is captured whole (WHOLE_TIERS)
                for prefetch in (False, True)
            ]
        for priority, workers in variants:
            label = tier
            if priority not in (None, priorities[0]) or workers not in (None, worker_modes[0]):
                label = f"{tier} priority={priority} workers={workers}"
            for scope in scopes:
                stores, runtime = build_placement(tier, priority, workers, pool, make_hasher, scope)
                graphed = {}
                for name, batches in workloads.items():
                    if scope is not None and scope[:2] != (name, "graph"):
                        continue
                    if name.startswith("decode") and "graph" in backbones:
                        graphed[name] = GraphedBackbone(
                            runtime, backbone, batches[0].num_tokens, pool.device, engram_at
                        )
                only = None if scope is None else {scope}
                setups.append(Setup(label, tier, priority, workers, stores, runtime, graphed, only))
    return setups


class Config(NamedTuple):
    """One timed configuration: a placement x settings x workload x backbone x prefetch."""

    setup: int  # index into the setups
    threads: int | None
    programs: Any  # a parse_programs value
    workload: str
    backbone: str
    prefetch: bool
    model_priority: int = 0


def enumerate_configs(
    setups: list[Setup],
    workloads: dict[str, list[HashBatch]],
    backbones: list[str],
    host_threads: list,
    max_programs: list,
    model_priorities: tuple[int, ...] = (0,),
) -> list[Config]:
    """Every configuration, in a fixed order (the rounds shuffle it)."""
    configs = []
    for index, setup in enumerate(setups):
        gathers = setup.tier in GATHER_TIERS
        settings = [(t, max_programs[0]) for t in (host_threads if gathers else [None])]
        if setup.tier in READS:
            settings += [(settings[0][0], m) for m in max_programs[1:]]
        for threads, programs in settings:
            for name in workloads:
                if (threads, programs) != settings[0] and not name.startswith("decode"):
                    continue  # other settings are compared on decode only
                for kind in backbones if name.startswith("decode") else ["eager"]:
                    if kind == "whole" and setup.tier not in WHOLE_TIERS:
                        continue
                    for prefetch in (False,) if kind == "whole" else (False, True):
                        if setup.only is not None and (name, kind, prefetch) not in setup.only:
                            continue  # caches of its own for another configuration
                        for priority in model_priorities:
                            configs.append(
                                Config(index, threads, programs, name, kind, prefetch, priority)
                            )
    return configs


def apply_settings(setup: Setup, threads, programs, grids: dict[int, tuple]) -> None:
    """Set a configuration's kernel and thread settings on its stores (shared stores
    carry the settings of whichever block ran last)."""
    for li, store in enumerate(setup.stores):
        if setup.tier in GATHER_TIERS:
            store.num_threads = threads
        if id(store) not in grids:
            continue
        grid = grids[id(store)]
        if setup.tier == "engine-uva":  # a full grid: one program per tile
            grid = (None, grid[1])
        elif setup.tier in READS and programs is not None:
            grid = layer_grid(programs, li)
        store.kernel = store.kernel.replace(max_programs=grid[0], rows_per_program=grid[1])


def build_whole_graphs(
    setups: list[Setup],
    backbone,
    workloads: dict[str, list[HashBatch]],
    device,
    engram_at: dict[int, int],
    max_programs: list,
    grids: dict[int, tuple],
) -> None:
    """Capture each whole-step placement's decode graphs into its ``whole``."""
    for setup in setups:
        if setup.tier not in WHOLE_TIERS:
            continue
        # The graph keeps the kernel settings it was captured with: the placement's own.
        apply_settings(setup, None, max_programs[0], grids)
        setup.whole = {
            name: WholeStepGraph(
                setup.runtime, backbone, batches[0], device, engram_at, check=batches[1]
            )
            for name, batches in workloads.items()
            if name.startswith("decode")
        }


class Bench(NamedTuple):
    """Everything the rounds time, built once before the first (:func:`build`)."""

    args: argparse.Namespace
    device: torch.device
    cfg: Any
    engram_at: dict[int, int]
    workloads: dict[str, list[HashBatch]]
    setups: list[Setup]
    configs: list[Config]
    grids: dict[int, tuple]
    eager: Any  # the eager backbone, as forward(handle, batch[, stalls])
    vocab_size: int = 0


def build(args: argparse.Namespace) -> Bench:
    """The workloads, the backbone and every placement (see the module docstring)."""
    backbones = args.backbones.split(",")
    if args.smoke:
        use_smoke_backbone()
    engram_at = parse_engram_at(args.engram_at)
    device = torch.device(args.device)
    if device.type != "cuda":
        backbones = [b for b in backbones if b not in ("graph", "whole")]  # CUDA graphs need a GPU
    cfg = scaled_config(args.table_gib)
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    workloads = build_workloads(args, token_map.vocab_size, device)
    host_threads = [None if t == "default" else int(t) for t in args.host_threads.split(",")]
    max_programs = [parse_programs(m) for m in args.max_programs.split(",")]
    backbone = make_backbone(cfg, device)
    # On a CPU (a smoke run) the plain torch paths: Triton's interpreter is far too slow.
    backend = {} if device.type == "cuda" else {"backend": "reference"}
    priorities = [int(p) for p in args.lookup_priority.split(",")]
    worker_modes = args.lookup_workers.split(",")
    cache = CacheSettings(args.cache_fraction, args.cache_update_every)
    pool = StorePool(cfg, layout, device, cache, backend)
    make_hasher = partial(NgramHasher, consts, token_map, device, validate=False, **backend)
    setups = build_setups(
        args.tiers.split(","),
        priorities,
        worker_modes,
        pool,
        make_hasher,
        backbone,
        workloads,
        backbones,
        engram_at,
        args.cache_scope,
    )
    eager = eager_forward(backbone, device, engram_at)
    configs = enumerate_configs(
        setups,
        workloads,
        backbones,
        host_threads,
        max_programs,
        tuple(parse_priorities(args.model_priority)),
    )
    if "whole" in backbones:
        build_whole_graphs(setups, backbone, workloads, device, engram_at, max_programs, pool.grids)
    return Bench(
        args,
        device,
        cfg,
        engram_at,
        workloads,
        setups,
        configs,
        pool.grids,
        eager,
        token_map.vocab_size,
    )


def describe(config: Config, setups: list[Setup]) -> str:
    return (
        f"{setups[config.setup].label:6s} threads={config.threads!s:5s} "
        f"programs={config.programs} {config.workload:26s} {config.backbone:5s} "
        f"prefetch={config.prefetch!s:5s}"
        + (f" model priority {config.model_priority}" if config.model_priority else "")
    )


def parse_priorities(text: str) -> list[int]:
    """``"0,-1"`` -> [0, -1] (``--model-priority``); an error names the option."""
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise SystemExit(f"--model-priority: {text!r}; expected comma-separated ints") from None


_MODEL_STREAMS: dict[int, Any] = {}


def model_stream(device, priority: int):
    """A context that runs the step on a stream of CUDA priority ``priority``
    (``--model-priority``; one stream per priority, made once), or changes nothing for 0
    or a CPU: the model's kernels, graph replays included, then take precedence over
    the lookups' side streams (priority 0) when both wait for multiprocessors."""
    if priority == 0 or device.type != "cuda":
        return contextlib.nullcontext()
    if priority not in _MODEL_STREAMS:
        _MODEL_STREAMS[priority] = torch.cuda.Stream(device, priority=priority)
    return torch.cuda.stream(_MODEL_STREAMS[priority])


def time_block(bench: Bench, config: Config, round_index: int) -> dict:
    """Round ``round_index``'s block of one configuration: warm-up steps, then the timed
    ones (:func:`run`), with their stalls and cache hit rates."""
    args = bench.args
    setup = bench.setups[config.setup]
    runtime, stores = setup.runtime, setup.stores
    apply_settings(setup, config.threads, config.programs, bench.grids)
    name, kind = config.workload, config.backbone
    batches = bench.workloads[name]
    steps = args.block_steps if name.startswith("decode") else args.prefill_chunks
    warm, timed = block_window(len(batches), round_index, steps, args.warmup_steps)
    forward = setup.graphed[name].step if kind == "graph" else bench.eager
    if kind == "whole":
        runtime = setup.whole[name]
        forward = runtime.forward
    with model_stream(bench.device, config.model_priority):
        if warm:
            run(
                runtime, [batches[i] for i in warm], forward, config.prefetch, None, args.sync_steps
            )
        caches = [(li, s) for li, s in enumerate(stores) if hasattr(s, "reset_stats")]
        for li, cache in caches:  # count the timed steps only
            runtime.in_order(li, cache.reset_stats)
        stalls = StallEvents(steps) if bench.device.type == "cuda" and kind != "whole" else None
        res = run(
            runtime, [batches[i] for i in timed], forward, config.prefetch, stalls, args.sync_steps
        )
    res["stall_us"] = None if stalls is None else stalls.stall_us(steps)
    if caches:
        res["cache_hit_rate"] = [stats.hit_rate for stats in runtime.cache_stats() if stats]
    return res


def median_stalls(res_list) -> list[float] | None:
    per_layer: list[list[float]] = [[], []]
    for res in res_list:
        if res["stall_us"] is None:
            return None
        for li, values in enumerate(res["stall_us"]):
            per_layer[li].extend(values)
    return [float(np.median(values)) for values in per_layer]


def config_result(config: Config, setup: Setup, by_round: dict[int, dict], rounds: int) -> dict:
    """One configuration's result: medians over its rounds, each round's ms/step
    (``ms_per_step_rounds``, None where a round did not run it)."""
    threads, programs = config.threads, config.programs
    runs = list(by_round.values())
    ms = [by_round[r]["ms_per_step"] if r in by_round else None for r in range(rounds)]
    p25, p50, p75 = quartiles([m for m in ms if m is not None])
    tokens = sum(r["tokens"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    assert p50 is not None  # every sampled configuration has a round
    stall = median_stalls(runs)
    res = dict(
        placement=setup.label,
        tier=setup.tier,
        lookup_priority=setup.priority,
        lookup_workers=setup.workers,
        lookup_overlap=getattr(setup.runtime, "lookup_overlap", None),
        workload=config.workload,
        backbone=config.backbone,
        prefetch=config.prefetch,
        model_priority=config.model_priority,
        host_threads=threads,
        max_programs="default"
        if programs is None
        else "/".join(str(layer_grid(programs, li)[0]) for li in range(2)),
        rows_per_program="default"
        if programs is None
        else "/".join(str(layer_grid(programs, li)[1]) for li in range(2)),
        rounds=len(runs),
        steps_per_block=runs[0]["steps"],
        tokens_per_step=tokens / steps,
        ms_per_step=p50,
        ms_per_step_p25=p25,
        ms_per_step_p75=p75,
        ms_per_step_rounds=ms,
        tokens_per_s=tokens / steps / (p50 / 1e3),
        stall_us=stall,
        stall_pct_of_step=None if stall is None else 100 * sum(stall) / 1e3 / p50,
    )
    if "cache_hit_rate" in runs[0]:
        rates = [r["cache_hit_rate"] for r in runs]
        res["cache_hit_rate"] = [float(np.median(layer)) for layer in zip(*rates)]
        res["cache_hit_rate_rounds"] = [
            by_round[r]["cache_hit_rate"] if r in by_round else None for r in range(rounds)
        ]
    return res


def add_comparisons(results: list[dict]) -> None:
    """Each result's paired comparisons with the references of its workload, backbone and
    prefetch: the ``device`` placement, ``none`` and ``engine-uva`` (:func:`paired_stats`)."""

    def key(res):
        return res["workload"], res["backbone"], res["prefetch"], res.get("model_priority", 0)

    def references(match) -> dict:
        return {key(res): res["ms_per_step_rounds"] for res in results if match(res)}

    base = references(lambda res: res["placement"] == "device")
    base_stall = {key(res): res["stall_us"] for res in results if res["placement"] == "device"}
    alone = references(lambda res: res["tier"] == "none")
    engine = references(lambda res: res["tier"] == "engine-uva")
    for res in results:
        k, ms = key(res), res["ms_per_step_rounds"]
        if k in base:
            res.update(paired_stats("loss_vs_gpu_pct", ms, base[k]))
            ref_stall = base_stall[k]
            if res["stall_us"] and ref_stall and res["loss_vs_gpu_pct"] is not None:
                # What the lookups cost the backbone beyond the main stream's extra waits.
                extra = 100 * (sum(res["stall_us"]) - sum(ref_stall)) / 1e3 / res["ms_per_step"]
                res["interference_pct"] = res["loss_vs_gpu_pct"] - extra
        if k in alone:
            res.update(paired_stats("loss_vs_no_lookups_pct", ms, alone[k]))
        if k in engine:
            # Positive: faster than the engine-style baseline.
            res.update(paired_stats("gain_vs_engine_uva_pct", ms, engine[k], gain=True))


def summarize(
    configs: list[Config], setups: list[Setup], samples: dict[int, dict[int, dict]], rounds: int
) -> list[dict]:
    """One result per sampled configuration, in configuration order: medians over rounds
    and the paired comparisons."""
    results = [
        config_result(configs[ci], setups[configs[ci].setup], by_round, rounds)
        for ci, by_round in sorted(samples.items())
    ]
    add_comparisons(results)
    return results


def report(args, cfg, device, engram_at, results: list[dict], rounds_completed: int) -> dict:
    return {
        "environment": environment(device),
        "smoke": args.smoke,
        "table_gib_per_layer": args.table_gib,
        "engram_at_blocks": sorted(engram_at),
        "ids": args.ids,
        "cache_fraction": args.cache_fraction,
        "cache_update_every": args.cache_update_every,
        "cache_scope": args.cache_scope,
        "cache_warm_steps": args.cache_warm_steps,
        "sync_steps": args.sync_steps,
        "model_priority": parse_priorities(args.model_priority),
        "method": "interleaved blocks, shuffled per round; losses paired within rounds",
        "rounds": args.rounds,
        "rounds_completed": rounds_completed,
        "block_steps": args.block_steps,
        "prefill_rounds": args.prefill_rounds,
        "prefill_chunks": args.prefill_chunks,
        "warmup_steps": args.warmup_steps,
        "order_seed": args.seed,
        "max_seconds": args.max_seconds,
        "config": cfg.to_hf_dict(),
        "results": results,
    }


def run_rounds(bench: Bench) -> tuple[list[dict], int]:
    """Every round: each active configuration once as a block, in an order shuffled by a
    generator seeded with ``--seed``; a line per block, the report rewritten per round.
    Returns the results and the rounds completed."""
    args, configs = bench.args, bench.configs
    order_rng = np.random.default_rng(args.seed)
    samples: dict[int, dict[int, dict]] = {}
    results: list[dict] = []
    rounds_completed = 0
    timing_start = time.perf_counter()
    for round_index in range(args.rounds):
        elapsed = time.perf_counter() - timing_start
        if round_index and args.max_seconds is not None and elapsed >= args.max_seconds:
            print(f"--max-seconds={args.max_seconds}: stopping after {round_index} rounds")
            break
        active = [
            ci
            for ci, config in enumerate(configs)
            if config.workload.startswith("decode") or round_index < args.prefill_rounds
        ]
        for position in order_rng.permutation(len(active)):
            ci = active[position]
            res = time_block(bench, configs[ci], round_index)
            samples.setdefault(ci, {})[round_index] = res
            stall = (
                ""
                if res["stall_us"] is None
                else " stall us " + "/".join(f"{np.median(v):.0f}" for v in res["stall_us"])
            )
            print(
                f"round {round_index} {describe(configs[ci], bench.setups)} "
                f"{res['ms_per_step']:8.3f} ms/step{stall}",
                flush=True,
            )
        rounds_completed = round_index + 1
        results = summarize(configs, bench.setups, samples, rounds_completed)
        if args.out:
            write_report(
                args.out,
                report(args, bench.cfg, bench.device, bench.engram_at, results, rounds_completed),
            )
    return results, rounds_completed


def quart(r: dict, name: str) -> str:
    if r.get(name) is None:
        return "n/a"
    return f"{r[name]:.2f}% (p25 {r[name + '_p25']:.2f}, p75 {r[name + '_p75']:.2f})"


def print_losses(results: list[dict], rounds_completed: int) -> None:
    """The paired losses and gains of each placement, then the A/A control's resolution."""
    for r in results:
        where = (
            f"{r['workload']}, {r['backbone']} backbone, threads={r['host_threads']}, "
            f"programs={r['max_programs']}:{r['rows_per_program']}, prefetch={r['prefetch']}"
            + (f", model priority {r['model_priority']}" if r.get("model_priority") else "")
        )
        if r["tier"] == "device" and "loss_vs_no_lookups_pct" in r:
            print(
                f"device tables vs no lookups, {where}: "
                f"{quart(r, 'loss_vs_no_lookups_pct')} throughput loss"
            )
        if r["placement"] not in ("device", "none") and "loss_vs_gpu_pct" in r:
            against_engine = (
                f", {quart(r, 'gain_vs_engine_uva_pct')} gain against engine-uva"
                if "gain_vs_engine_uva_pct" in r and r["tier"] != "engine-uva"
                else ""
            )
            stall = ""
            if r["stall_us"] is not None:
                stall = (
                    f"; stall us/step {'/'.join(f'{v:.0f}' for v in r['stall_us'])} "
                    f"= {r['stall_pct_of_step']:.2f}% of the step"
                )
                if "interference_pct" in r:
                    stall += f", interference {r['interference_pct']:.2f}%"
            print(
                f"{r['placement']} tables, {where}: {r['ms_per_step']:.3f} ms/step, "
                f"{quart(r, 'loss_vs_gpu_pct')} throughput loss{against_engine}{stall}"
            )
    for r in results:
        if r["tier"] == "device-again" and "loss_vs_gpu_pct" in r:
            print(
                f"method resolution (A/A: device-again vs device), {r['workload']}, "
                f"{r['backbone']} backbone, prefetch={r['prefetch']}"
                + (f", model priority {r['model_priority']}" if r.get("model_priority") else "")
                + f": {quart(r, 'loss_vs_gpu_pct')} over {rounds_completed} rounds"
            )


def main(argv=None) -> None:
    # Every placement is built first; then each round runs every configuration
    # once as a short block, in a freshly shuffled order, and each is compared
    # with the reference of the same round (see the module docstring).
    bench = build(parse_args(argv))
    warm_caches(bench)
    results, rounds_completed = run_rounds(bench)
    for setup in bench.setups:
        setup.runtime.close()
    print_losses(results, rounds_completed)


if __name__ == "__main__":
    main()
