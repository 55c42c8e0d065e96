"""What does keeping the Engram tables off the GPU cost? (run on a GPU machine)

    python bench/runtime_overhead.py [--table-gib 16] [--out report.json]

A synthetic backbone of 30 dense bf16 blocks sized like a 7B model (hidden
4096, MLP 11008, no attention kernel: the projections only), Engram layers
after blocks 1 and 14 with V4.1-Flash row shapes (C = 24 columns of E = 256)
and a V4.1 layout scaled so each layer's table is ``--table-gib`` GiB (default
16: 32 GiB for the two). Each step: hash ids for both layers (one launch),
start both lookups, run the blocks; at block 1 and 14 wait for that layer's
rows and run the library's Engram head on them (wkv, bf16, and the fused
gate over 4 streams).

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
against GPU memory in the same configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap

D, FFN, BLOCKS, HC = 4096, 11008, 30, 4
ENGRAM_AT = {1: 0, 14: 1}  # block -> Engram layer index
READS = ("host", "uva")  # tiers whose kernel reads host memory (settings: --max-programs)


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
        head = EngramHead(cfg, device=device, validate=False)
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


def run(runtime, batches, forward, prefetch):
    """Time ``forward(handle, batch)`` over ``batches``, the lookups started per step.

    With ``prefetch`` the next step's lookups start before this step's
    forward; without, when the next step starts.
    """
    tokens = sum(b.num_tokens for b in batches)
    torch.cuda.synchronize()
    start = time.perf_counter()
    handle = runtime.step(batches[0])
    for i, batch in enumerate(batches):
        nxt = None
        if prefetch and i + 1 < len(batches):
            nxt = runtime.prefetch(batches[i + 1])
        forward(handle, batch)
        if i + 1 < len(batches):
            handle = nxt if nxt is not None else runtime.step(batches[i + 1])
    torch.cuda.synchronize()
    return summary(batches, tokens, time.perf_counter() - start)


def eager_forward(backbone, device):
    """The backbone launched kernel by kernel from Python, as ``forward(handle, batch)``."""
    blocks, engram = backbone

    def forward(handle, batch) -> None:
        x = torch.randn(batch.num_tokens, D, device=device, dtype=torch.bfloat16)
        for b, weights in enumerate(blocks):
            x = run_block(x, weights)
            if b in ENGRAM_AT:
                li = ENGRAM_AT[b]
                x = engram_layer(x, handle.rows(li), engram[li])

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

    Three pieces split at the Engram layers (blocks 0-1; Engram layer 0 and
    blocks 2-14; Engram layer 1 and blocks 15-29), the last two captured once
    per staging slot of the runtime, since each slot's rows live at their own
    fixed address. Between pieces the step waits for that layer's rows.
    """

    def __init__(self, runtime, backbone, num_tokens, device):
        blocks, engram = backbone
        first, second = sorted(ENGRAM_AT)
        self.x = torch.randn(num_tokens, D, device=device, dtype=torch.bfloat16)

        def piece(x, lo, hi):
            for weights in blocks[lo:hi]:
                x = run_block(x, weights)
            return x

        self.head, head_out = capture(lambda: piece(self.x, 0, first + 1))
        self.middle, self.tail = [], []
        for slot in range(len(runtime.staging)):
            rows = [runtime.staging[slot][li][:num_tokens] for li in range(2)]
            graph, mid_out = capture(
                lambda rows=rows: piece(
                    engram_layer(head_out, rows[0], engram[0]), first + 1, second + 1
                )
            )
            self.middle.append(graph)
            graph, _ = capture(
                lambda rows=rows, mid_out=mid_out: piece(
                    engram_layer(mid_out, rows[1], engram[1]), second + 1, len(blocks)
                )
            )
            self.tail.append(graph)

    def step(self, handle, batch=None) -> None:
        self.head.replay()
        handle.rows(0)  # the stream waits for layer 0's rows
        self.middle[handle.slot].replay()
        handle.rows(1)
        self.tail[handle.slot].replay()


def parse_programs(text: str) -> tuple[int | None, int | None] | None:
    """``"default"`` -> None (the store's own settings); ``"16"`` or ``"16:64"`` ->
    (max_programs, rows_per_program), ``"0"`` for an unbounded grid."""
    if text == "default":
        return None
    programs, _, rows = text.partition(":")
    return int(programs) or None, int(rows) if rows else None


def main() -> None:
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
        "'0': one program per tile), to compare; all but the first on decode only",
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
    args = parser.parse_args()
    device = torch.device("cuda")
    cfg = scaled_config(args.table_gib)
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    rng = np.random.default_rng(0)
    workloads = {}
    if "decode" in args.workloads:
        workloads["decode 256x1"] = decode_batches(
            rng, token_map.vocab_size, args.decode_steps, device
        )
    if "prefill" in args.workloads:
        workloads["prefill 512 seqs 100-1024"] = prefill_batches(rng, token_map.vocab_size, device)
    host_threads = [None if t == "default" else int(t) for t in args.host_threads.split(",")]
    max_programs = [parse_programs(m) for m in args.max_programs.split(",")]
    backbones = args.backbones.split(",")
    backbone = make_backbone(cfg, device)
    # Every placement is built first and the configurations are interleaved
    # over rounds, so drift of the machine (clocks, other tenants) spreads
    # over all of them; the median of the rounds is reported.
    setups = []
    for tier in args.tiers.split(","):
        if tier == "none":
            stores, runtime = [], NoLookups(8192, cfg.n_cols, cfg.head_dim, device)
        else:
            stores = synthetic_stores(
                layout, "host" if tier == "host-cpu" else tier, device=device, seed=1
            )
            for store in stores:
                if tier == "host-cpu":
                    store.gpu_reads = False
            hasher = NgramHasher(consts, token_map, device, validate=False)
            runtime = EngramRuntime(
                hasher, stores, max_tokens=8192, max_requests=512, validate=False
            )
        graphed = {}
        for name, batches in workloads.items():
            if name.startswith("decode") and "graph" in backbones:
                graphed[name] = GraphedBackbone(runtime, backbone, batches[0].num_tokens, device)
        defaults = [
            (s.kernel.max_programs, s.kernel.rows_per_program) for s in stores if tier in READS
        ]
        setups.append((tier, stores, runtime, graphed, defaults))
    samples: dict[tuple, list[dict]] = {}
    for round_index in range(args.rounds):
        for tier, stores, runtime, graphed, defaults in setups:
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
                        grid = defaults[index] if programs is None else programs
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
                                else eager_forward(backbone, device)
                            )
                            run(runtime, batches[:3], forward, prefetch)  # warm-up
                            res = run(runtime, batches, forward, prefetch)
                            config = (tier, threads, programs, name, kind, prefetch)
                            samples.setdefault(config, []).append(res)
                            print(
                                f"round {round_index} {tier:6s} threads={threads!s:5s} "
                                f"programs={programs} {name:26s} "
                                f"{kind:5s} prefetch={prefetch!s:5s} {res['ms_per_step']:8.2f} ms/step",
                                flush=True,
                            )
    for _, _, runtime, _, _ in setups:
        runtime.close()
    results = []
    for (tier, threads, programs, name, kind, prefetch), runs in samples.items():
        runs = sorted(runs, key=lambda r: r["ms_per_step"])
        res = dict(runs[len(runs) // 2])  # the median round
        res.update(
            tier=tier,
            workload=name,
            backbone=kind,
            prefetch=prefetch,
            host_threads=threads,
            max_programs="default" if programs is None else programs[0],
            rows_per_program="default" if programs is None else programs[1],
            ms_per_step_rounds=[r["ms_per_step"] for r in runs],
        )
        results.append(res)

    def key(r):
        return r["workload"], r["backbone"], r["prefetch"]

    base = {key(r): r["tokens_per_s"] for r in results if r["tier"] == "device"}
    alone = {key(r): r["tokens_per_s"] for r in results if r["tier"] == "none"}
    for r in results:
        if key(r) in base:
            r["loss_vs_gpu_pct"] = 100 * (1 - r["tokens_per_s"] / base[key(r)])
        if key(r) in alone:
            r["loss_vs_no_lookups_pct"] = 100 * (1 - r["tokens_per_s"] / alone[key(r)])
    for r in results:
        if r["tier"] == "device" and "loss_vs_no_lookups_pct" in r:
            print(
                f"device tables vs no lookups, {r['workload']}, {r['backbone']} backbone, "
                f"prefetch={r['prefetch']}: {r['loss_vs_no_lookups_pct']:.2f}% throughput loss"
            )
        if r["tier"] not in ("device", "none") and "loss_vs_gpu_pct" in r:
            print(
                f"{r['tier']} tables, {r['workload']}, {r['backbone']} backbone, "
                f"threads={r['host_threads']}, "
                f"programs={r['max_programs']}:{r['rows_per_program']}, "
                f"prefetch={r['prefetch']}: "
                f"{r['loss_vs_gpu_pct']:.2f}% throughput loss"
            )
    if args.out:
        import triton

        report = {
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name(),
            "table_gib_per_layer": args.table_gib,
            "rounds": args.rounds,
            "config": cfg.to_hf_dict(),
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
