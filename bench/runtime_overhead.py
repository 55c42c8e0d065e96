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
the CPU gathering every row), in pinned host memory read by the kernel
(UVA), or on disk. Decode runs the backbone as engines do, from CUDA graphs replayed per
step (``--backbones graph``), and for comparison launched kernel by kernel
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

More placements and levers:

- ``engine-uva``: how serving engines read host-memory tables today, the
  baseline: hash, then read every layer's rows over UVA with a full-grid
  kernel on the main stream, before the decoder blocks (no side stream, no
  overlap; a prefetch is the same work, done earlier on the main stream);
- ``host-cache``: the host tier behind the runtime's hot-row cache
  (:class:`engramrt.cache.CachedRowStore`, ``--cache-fraction`` of each
  table's bytes in GPU memory); the cache keeps its rows from run to run,
  as a serving engine's would, and each result holds its hit rate over the
  timed steps (``cache_hit_rate``, per layer). The variants of a tier
  (priorities, worker modes) run over the tier's one set of stores, so the
  ``host-cache`` variants share one cache;
- ``--lookup-priority``: stream priorities of the runtime's lookups
  (``EngramRuntime(lookup_priority=)``; lower is higher in torch);
- ``--lookup-workers``: ``per-layer`` worker threads or one ``shared`` one
  for both layers' host lookups, in layer order
  (``EngramRuntime(lookup_workers=)``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engramrt.cache import CachedRowStore
from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap

D, FFN, BLOCKS, HC = 4096, 11008, 30, 4
ENGRAM_AT = {1: 0, 14: 1}  # block -> Engram layer index run at its start (V4.1-Flash: [1, 14])
READS = ("host", "uva")  # tiers whose kernel reads host memory (settings: --max-programs)
RUNTIME_TIERS = ("device", "host", "host-cpu", "uva", "disk", "host-cache")


def parse_engram_at(text: str) -> dict[int, int]:
    """``"1,14"`` -> ``{1: 0, 14: 1}``: Engram layer i runs at the start of block b_i."""
    blocks = [int(b) for b in text.split(",")]
    if len(blocks) != 2 or not 0 <= blocks[0] < blocks[1] < BLOCKS:
        raise SystemExit(
            f"--engram-at={text!r}; expected two increasing block indices in [0, {BLOCKS})"
        )
    return {b: li for li, b in enumerate(blocks)}


def scaled_config(table_gib: float):
    """The V4.1-Flash config with hidden size D and vocabularies scaled so each
    layer's table holds ``table_gib`` GiB (the primes still follow the layout rules)."""
    base = PRESETS["dsv41-flash"]
    rows = int(table_gib * 2**30) // base.row_bytes
    vocab = rows // base.n_cols
    cfg = base.replace(
        vocab_size=(vocab,) * 3, num_embeddings=(1, 1), hidden_size=D, name=f"v41-{table_gib}GiB"
    )
    needed = EngramLayout(cfg, check_num_embeddings=False).num_embeddings
    return cfg.replace(num_embeddings=needed)


def make_backbone(cfg, device):
    """The dense blocks' weights and the two Engram heads (random weights, no checks)."""
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).bfloat16()

    blocks = [(w(D, 3 * D), w(D, D), w(D, 2 * FFN), w(FFN, D)) for _ in range(BLOCKS)]
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


def text_streams(docs, requests, length):
    """``[requests, length]`` token ids: the documents concatenated, cut into equal slices."""
    tokens = np.concatenate(docs)
    per = tokens.shape[0] // requests
    if per < length:
        raise SystemExit(
            f"the corpus has {tokens.shape[0]} tokens; {requests} requests of {length} need more"
        )
    return tokens[: per * requests].reshape(requests, per)[:, :length]


def stdlib_docs():
    """The CPython standard library's top-level modules, tokenised (DeepSeek-V4, no special
    tokens), in name order."""
    import sysconfig
    from pathlib import Path

    from engramrt.tokenmap import load_tokenizer

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_text(encoding="utf-8") for f in files]
    encoded = load_tokenizer().encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encoded]


def zipf_streams(rng, vocab, requests, length, exponent=1.2):
    """``[requests, length]`` token ids drawn from a Zipf law over a random ranking of the
    vocabulary (rank k has weight ``k**-exponent``)."""
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

    def __init__(self, max_tokens: int, num_cols: int, E: int, device, layers: int = 2):
        self.staging = [
            [
                torch.zeros(max_tokens, num_cols, E, dtype=torch.bfloat16, device=device)
                for _ in range(layers)
            ]
            for _ in range(2)
        ]
        self._next = 0

    def step(self, batch):
        slot, self._next = self._next, 1 - self._next
        return _FixedRows(self.staging[slot], batch.num_tokens, slot)

    prefetch = step

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
        self._next = 0

    def step(self, batch):
        slot = self._next
        self._next = (slot + 1) % len(self.staging)
        t_len = batch.num_tokens
        row_ids = self.row_ids[slot][:t_len]
        self.hasher(batch, None, out=row_ids)
        for li, store in enumerate(self.stores):
            store.fetch(row_ids[:, li], self.staging[slot][li][:t_len])
        return _FixedRows(self.staging[slot], t_len, slot)

    prefetch = step

    def close(self) -> None:
        pass


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(runtime, batches, forward, prefetch):
    """Time ``forward(handle, batch)`` over ``batches``, the lookups started per step.

    With ``prefetch`` the next step's lookups start before this step's
    forward; without, when the next step starts.
    """
    tokens = sum(b.num_tokens for b in batches)
    synchronize(batches[0].input_ids.device)
    start = time.perf_counter()
    handle = runtime.step(batches[0])
    for i, batch in enumerate(batches):
        nxt = None
        if prefetch and i + 1 < len(batches):
            nxt = runtime.prefetch(batches[i + 1])
        forward(handle, batch)
        if i + 1 < len(batches):
            handle = nxt if nxt is not None else runtime.step(batches[i + 1])
    synchronize(batches[0].input_ids.device)
    return summary(batches, tokens, time.perf_counter() - start)


def eager_forward(backbone, device, engram_at=ENGRAM_AT):
    """The backbone launched kernel by kernel from Python, as ``forward(handle, batch)``."""
    blocks, engram = backbone

    def forward(handle, batch) -> None:
        x = torch.randn(batch.num_tokens, D, device=device, dtype=torch.bfloat16)
        for b, weights in enumerate(blocks):
            if b in engram_at:
                li = engram_at[b]
                x = engram_layer(x, handle.rows(li), engram[li])
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
        for slot in range(len(runtime.staging)):
            rows = [runtime.staging[slot][li][:num_tokens] for li in range(2)]
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

    def step(self, handle, batch=None) -> None:
        if self.head is not None:
            self.head.replay()
        handle.rows(0)  # the stream waits for layer 0's rows
        self.middle[handle.slot].replay()
        handle.rows(1)
        self.tail[handle.slot].replay()


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument("--decode-steps", type=int, default=100)
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
        "--rounds", type=int, default=3, help="interleaved rounds; medians reported"
    )
    parser.add_argument(
        "--tiers",
        default="none,device,host,uva",
        help="placements to compare ('none' runs the backbone without lookups; 'host-cpu' the "
        "host tier without GPU reads)",
    )
    parser.add_argument(
        "--backbones",
        default="graph,eager",
        help="decode backbone: CUDA graphs (as engines run decode) and/or eager",
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
        "--lookup-priority",
        default="0",
        help="comma-separated stream priorities of the runtime's lookups to compare",
    )
    parser.add_argument(
        "--lookup-workers",
        default="per-layer",
        help="comma-separated: per-layer and/or shared (one thread for both layers' host lookups)",
    )
    parser.add_argument("--device", default="cuda", help="where to run (cpu: --smoke only)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny backbone (hidden 64, 16 blocks) so the whole script runs on a CPU; "
        "use with a small --table-gib, --decode-steps and --tiers none,device,host,"
        "host-cache,engine-uva (engine-uva reads device-tier stores on a CPU)",
    )
    args = parser.parse_args(argv)
    backbones = args.backbones.split(",")
    if args.smoke:
        # A backbone small enough for a CPU: the plumbing, not the timings.
        global D, FFN, BLOCKS
        D, FFN, BLOCKS = 64, 128, 16
    engram_at = parse_engram_at(args.engram_at)
    device = torch.device(args.device)
    if device.type != "cuda":
        backbones = [b for b in backbones if b != "graph"]  # CUDA graphs need a GPU
    cfg = scaled_config(args.table_gib)
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    rng = np.random.default_rng(0)
    workloads = {}
    if "decode" in args.workloads:
        for ids in args.ids.split(","):
            if ids == "random":
                batches = decode_batches(rng, token_map.vocab_size, args.decode_steps, device)
            elif ids == "text":
                streams = text_streams(stdlib_docs(), 256, args.decode_steps + 3)
                batches = decode_batches_from(streams, device)
            elif ids == "zipf":
                streams = zipf_streams(
                    np.random.default_rng(1), token_map.vocab_size, 256, args.decode_steps + 3
                )
                batches = decode_batches_from(streams, device)
            else:
                raise SystemExit(f"--ids: {ids!r}; expected random, text or zipf")
            workloads["decode 256x1" + ("" if ids == "random" else f" {ids}")] = batches
    if "prefill" in args.workloads:
        workloads["prefill 512 seqs 100-1024"] = prefill_batches(rng, token_map.vocab_size, device)
    host_threads = [None if t == "default" else int(t) for t in args.host_threads.split(",")]
    max_programs = [parse_programs(m) for m in args.max_programs.split(",")]
    backbone = make_backbone(cfg, device)
    # Every placement is built first and the configurations are interleaved
    # over rounds, so drift of the machine (clocks, other tenants) spreads
    # over all of them; the median of the rounds is reported.
    # On a CPU (a smoke run) the plain torch paths: Triton's interpreter is far too slow.
    backend = {} if device.type == "cuda" else {"backend": "reference"}
    priorities = [int(p) for p in args.lookup_priority.split(",")]
    worker_modes = args.lookup_workers.split(",")

    def build_stores(tier):
        """Both layers' stores of a runtime tier, shared by the runtimes of its variants
        (one table in memory per tier; the runs are sequential)."""
        backing = "host" if tier in ("host-cpu", "host-cache") else tier
        stores = synthetic_stores(layout, backing, device=device, seed=1, **backend)
        for store in stores:
            if tier == "host-cpu":
                store.gpu_reads = False
        if tier == "host-cache":
            stores = [
                CachedRowStore(
                    store,
                    int(args.cache_fraction * store.nbytes),
                    n_heads=cfg.n_heads,
                    layer_id=cfg.layer_ids[li],
                    **backend,
                )
                for li, store in enumerate(stores)
            ]
        return stores

    built: dict[str, list] = {}
    setups = []
    for tier in args.tiers.split(","):
        variants = [(None, None)]
        if tier in RUNTIME_TIERS:  # only threaded lookups have workers to share
            threaded = tier in ("host", "host-cpu", "disk", "host-cache")
            modes = worker_modes if threaded else worker_modes[:1]
            variants = [(p, w) for p in priorities for w in modes]
        for priority, workers in variants:
            label = tier
            if priority not in (None, priorities[0]) or workers not in (None, worker_modes[0]):
                label = f"{tier} priority={priority} workers={workers}"
            if tier == "none":
                stores, runtime = [], NoLookups(8192, cfg.n_cols, cfg.head_dim, device)
            elif tier == "engine-uva":
                # No UVA without a GPU: a CPU smoke run reads device-tier stores instead.
                uva = "uva" if device.type == "cuda" else "device"
                stores = synthetic_stores(layout, uva, device=device, seed=1, **backend)
                for store in stores:  # a full grid: one program per tile
                    store.kernel = store.kernel.replace(max_programs=None)
                hasher = NgramHasher(consts, token_map, device, validate=False, **backend)
                runtime = EngineStyle(hasher, stores, max_tokens=8192)
            else:
                if tier not in built:
                    built[tier] = build_stores(tier)
                stores = built[tier]
                hasher = NgramHasher(consts, token_map, device, validate=False, **backend)
                runtime = EngramRuntime(
                    hasher,
                    stores,
                    max_tokens=8192,
                    max_requests=512,
                    validate=False,
                    lookup_priority=priority,
                    lookup_workers=workers,
                )
            graphed = {}
            for name, batches in workloads.items():
                if name.startswith("decode") and "graph" in backbones:
                    graphed[name] = GraphedBackbone(
                        runtime, backbone, batches[0].num_tokens, device, engram_at
                    )
            kernels = [s for s in stores if tier in READS]
            defaults = [(s.kernel.max_programs, s.kernel.rows_per_program) for s in kernels]
            setups.append((label, tier, priority, workers, stores, runtime, graphed, defaults))
    samples: dict[tuple, list[dict]] = {}
    meta: dict[str, tuple] = {}
    for round_index in range(args.rounds):
        for label, tier, priority, workers, stores, runtime, graphed, defaults in setups:
            gathers = tier in ("host", "host-cpu", "disk")
            reads = tier in READS
            settings = [(t, max_programs[0]) for t in (host_threads if gathers else [None])]
            if reads:
                settings += [(settings[0][0], m) for m in max_programs[1:]]
            for threads, programs in settings:
                for index, store in enumerate(stores):  # both read at every lookup
                    if gathers:
                        store.num_threads = threads
                    if reads:
                        grid = defaults[index] if programs is None else layer_grid(programs, index)
                        store.kernel = store.kernel.replace(
                            max_programs=grid[0], rows_per_program=grid[1]
                        )
                for name, batches in workloads.items():
                    if (threads, programs) != settings[0] and not name.startswith("decode"):
                        continue  # other settings are compared on decode only
                    for kind in backbones if name.startswith("decode") else ["eager"]:
                        for prefetch in (False, True):
                            forward = (
                                graphed[name].step
                                if kind == "graph"
                                else eager_forward(backbone, device, engram_at)
                            )
                            run(runtime, batches[:3], forward, prefetch)  # warm-up
                            caches = [
                                (li, s) for li, s in enumerate(stores) if hasattr(s, "reset_stats")
                            ]
                            for li, cache in caches:  # count the timed steps only
                                runtime.in_order(li, cache.reset_stats)
                            res = run(runtime, batches, forward, prefetch)
                            if caches:
                                res["cache_hit_rate"] = [
                                    stats.hit_rate for stats in runtime.cache_stats() if stats
                                ]
                            config = (label, threads, programs, name, kind, prefetch)
                            samples.setdefault(config, []).append(res)
                            meta[label] = (tier, priority, workers)
                            print(
                                f"round {round_index} {label:6s} threads={threads!s:5s} "
                                f"programs={programs} {name:26s} "
                                f"{kind:5s} prefetch={prefetch!s:5s} {res['ms_per_step']:8.2f} ms/step",
                                flush=True,
                            )
    for setup in setups:
        setup[5].close()
    results = []
    for (label, threads, programs, name, kind, prefetch), runs in samples.items():
        tier, priority, workers = meta[label]
        runs = sorted(runs, key=lambda r: r["ms_per_step"])
        res = dict(runs[len(runs) // 2])  # the median round
        res.update(
            placement=label,
            tier=tier,
            lookup_priority=priority,
            lookup_workers=workers,
            workload=name,
            backbone=kind,
            prefetch=prefetch,
            host_threads=threads,
            max_programs="default"
            if programs is None
            else "/".join(str(layer_grid(programs, li)[0]) for li in range(2)),
            rows_per_program="default"
            if programs is None
            else "/".join(str(layer_grid(programs, li)[1]) for li in range(2)),
            ms_per_step_rounds=[r["ms_per_step"] for r in runs],
        )
        results.append(res)

    def key(r):
        return r["workload"], r["backbone"], r["prefetch"]

    base = {key(r): r["tokens_per_s"] for r in results if r["placement"] == "device"}
    alone = {key(r): r["tokens_per_s"] for r in results if r["tier"] == "none"}
    engine = {key(r): r["tokens_per_s"] for r in results if r["tier"] == "engine-uva"}
    for r in results:
        if key(r) in base:
            r["loss_vs_gpu_pct"] = 100 * (1 - r["tokens_per_s"] / base[key(r)])
        if key(r) in alone:
            r["loss_vs_no_lookups_pct"] = 100 * (1 - r["tokens_per_s"] / alone[key(r)])
        if key(r) in engine:
            # Positive: faster than the engine-style baseline.
            r["gain_vs_engine_uva_pct"] = 100 * (r["tokens_per_s"] / engine[key(r)] - 1)
    for r in results:
        if r["tier"] == "device" and "loss_vs_no_lookups_pct" in r:
            print(
                f"device tables vs no lookups, {r['workload']}, {r['backbone']} backbone, "
                f"prefetch={r['prefetch']}: {r['loss_vs_no_lookups_pct']:.2f}% throughput loss"
            )
        if r["placement"] not in ("device", "none") and "loss_vs_gpu_pct" in r:
            against_engine = (
                f", {r['gain_vs_engine_uva_pct']:+.2f}% against engine-uva"
                if "gain_vs_engine_uva_pct" in r and r["tier"] != "engine-uva"
                else ""
            )
            print(
                f"{r['placement']} tables, {r['workload']}, {r['backbone']} backbone, "
                f"threads={r['host_threads']}, "
                f"programs={r['max_programs']}:{r['rows_per_program']}, "
                f"prefetch={r['prefetch']}: "
                f"{r['loss_vs_gpu_pct']:.2f}% throughput loss{against_engine}"
            )
    if args.out:
        import triton

        report = {
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none",
            "device": str(device),
            "smoke": args.smoke,
            "table_gib_per_layer": args.table_gib,
            "engram_at_blocks": sorted(engram_at),
            "ids": args.ids,
            "cache_fraction": args.cache_fraction,
            "rounds": args.rounds,
            "config": cfg.to_hf_dict(),
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
