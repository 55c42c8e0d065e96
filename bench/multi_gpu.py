"""Tensor-parallel lookups on several GPUs against the single-GPU result, timed.

    torchrun --nproc-per-node 2 bench/multi_gpu.py [--table-gib 2] [--out report.json]
    torchrun --nproc-per-node 2 bench/multi_gpu.py --cpu --tokens 5,17   # gloo smoke run

Every rank builds its column shard of one layer (SPEC §7) of a V4.1 layout
scaled to ``--table-gib`` GiB per layer (``runtime_overhead.scaled_config``: C = 24,
E = 256, hidden size 4096, 64 with ``--cpu``; random rows that depend only on the global row id) and, as the reference, the whole table on its own GPU.
For each T it checks, bit for bit against that single-GPU lookup, and then
times (the report also holds a SHA-256 of the all-gather's rows on rank 0,
for a check outside this script) (median wall time of synchronised calls; every rank calls together):

- ``AllGatherExchange`` with ``all_gather`` and ``all_reduce`` (full rows on
  every rank);
- ``SequenceParallelExchange`` with ``reduce_scatter`` and ``all_to_all`` (each
  rank keeps its token share of the full rows, as the layer uses it);
- ``AllToAllExchange`` (each rank its own batch, T - 3 * rank tokens);
- the shard's local lookup alone, the floor under all of them;
- one host copy of the table shared by every rank (data-parallel replicas
  on one node: the first rank loads it into ``--shared-dir``, the others
  map it), served by the host-gather and UVA tiers on each rank's GPU at
  once, each rank its own batch: exactly one loader ran, and the rows;
- a whole ``EngramLayer`` step under sequence parallelism (a
  ``SequenceParallelExchange`` as the layer's row source; each rank its
  token share: lookup, collective, wkv, gate) for both collectives, rows bit
  for bit and kv and output within the layer's derived tolerances, beside
  the single-GPU layer on all T tokens.

Rank 0 prints one line per measurement and writes the JSON report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import runtime_overhead as ro  # bench/ is on the path when run as a script
from engramrt.bench.runner import environment, median_seconds
from engramrt.distributed import SharedHostTable, shared_store
from engramrt.exchange import (
    AllGatherExchange,
    AllToAllExchange,
    SequenceParallelExchange,
    token_range,
    tokens_per_rank,
)
from engramrt.layer import EngramLayer, assert_layer_within_tolerance
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement
from engramrt.packed import row_bytes_for
from engramrt.runtime import synthetic_rows, synthetic_stores


def random_ids(layout: EngramLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """``[T, C]`` int64, column c's id in its own prime-sized range (layer 0)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.from_numpy(layout.offsets[0].copy())
    primes = torch.from_numpy(layout.col_primes[0].copy())
    fraction = torch.rand(num_tokens, layout.n_cols, generator=g, dtype=torch.float64)
    return offsets + (fraction * primes).long().clamp_max(primes - 1)


def rows_digest(rows: torch.Tensor) -> str:
    """SHA-256 of bf16 rows' bit patterns (C order)."""
    return hashlib.sha256(rows.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    dist.barrier()
    return 1e3 * median_seconds(fn, reps, sync=sync)


def random_layer_weights(config, seed: int) -> dict[str, torch.Tensor]:
    """bf16 checkpoint-style weights, the same on every rank."""
    hc, dim, width = config.hc_mult, config.hidden_size, config.n_cols * config.head_dim
    g = torch.Generator().manual_seed(seed)
    return {
        "wkv": (torch.randn((hc + 1) * dim, width, generator=g) / width**0.5).bfloat16(),
        "q_weight": (1.0 + 0.2 * torch.randn(hc, dim, generator=g)).bfloat16(),
        "k_weight": (1.0 + 0.2 * torch.randn(hc, dim, generator=g)).bfloat16(),
    }


def layer_steps(layout, shard_store, full_store, args, device, record) -> None:
    """A layer step under sequence parallelism against the single-GPU layer."""
    config = layout.config
    world, rank = dist.get_world_size(), dist.get_rank()
    weights = random_layer_weights(config, seed=7)
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        ids = random_ids(layout, num_tokens, seed=num_tokens).to(device)
        expected_rows = full_store.lookup(ids)
        g = torch.Generator().manual_seed(num_tokens)
        hidden_all = torch.randn(num_tokens, config.hc_mult, config.hidden_size, generator=g) * 2
        hidden_all = hidden_all.bfloat16().to(device)
        single = EngramLayer(config, full_store, max_tokens=num_tokens, validate=False)
        single.load_weights(**weights)
        ms = median_ms(lambda ids=ids, h=hidden_all: single(h, ids), device, args.reps)
        record("EngramLayer single GPU, all T", num_tokens, True, ms)
        part = tokens_per_rank(num_tokens, world)
        begin, end = token_range(num_tokens, world, rank)
        hidden = torch.zeros(
            (part, config.hc_mult, config.hidden_size), dtype=torch.bfloat16, device=device
        )
        hidden[: end - begin] = hidden_all[begin:end]
        for collective in ("reduce_scatter", "all_to_all"):
            exchange = SequenceParallelExchange(
                shard_store,
                num_cols=config.n_cols,
                max_tokens=num_tokens,
                group=dist.group.WORLD,
                collective=collective,
            )
            layer = EngramLayer(config, exchange, max_tokens=num_tokens, validate=False)
            layer.load_weights(**weights)
            out, kv = layer(hidden, ids, return_kv=True)
            rows = layer.staged_rows[:part]
            ok = same_bits(rows[: end - begin], expected_rows[begin:end])
            try:
                assert_layer_within_tolerance(
                    hidden=hidden.cpu(),
                    rows=rows.cpu(),
                    kv=kv.cpu(),
                    out=out.cpu(),
                    wkv_exact=weights["wkv"].double(),
                    q_weight=weights["q_weight"],
                    k_weight=weights["k_weight"],
                    eps=config.rms_norm_eps,
                    label=f"tp={world} rank {rank} {collective}",
                )
            except AssertionError as exc:
                print(f"rank {rank}: {exc}", flush=True)
                ok = False
            ms = median_ms(lambda ids=ids, layer=layer: layer(hidden, ids), device, args.reps)
            record(f"EngramLayer SP {collective}", num_tokens, ok, ms)


def shared_table_steps(layout, full_store, args, device, record) -> None:
    """Every rank serves layer 0's whole table from one shared host copy."""
    rank = dist.get_rank()
    shard = layout.column_shard(0, 1, 0)
    named = [f"engramrt-multi-gpu-{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(named, src=0)

    def load(target: torch.Tensor) -> None:
        for local_row, rows in synthetic_rows(
            layout, 0, shard.row_begin, shard.row_end, seed=1, device=device
        ):
            target[local_row : local_row + rows.shape[0]].copy_(rows)

    start = time.perf_counter()
    table = SharedHostTable.create_or_attach(
        named[0],
        shard.num_rows,
        row_bytes_for(layout.config.head_dim),
        load,
        directory=args.shared_dir,
        group=dist.group.WORLD,
    )
    load_ms = 1e3 * (time.perf_counter() - start)
    counts = torch.tensor([int(table.created), int(table.shared)], device=device)
    dist.all_reduce(counts)
    loaders, sharing = (int(c) for c in counts)
    if rank == 0:
        print(
            f"shared table {table}: {loaders} loader(s), {sharing} rank(s) mapping it", flush=True
        )
    record(
        "SharedHostTable load once, map",
        0,
        loaders == 1 and sharing == dist.get_world_size(),
        load_ms,
    )
    tiers = ["host"] + (["uva"] if device.type == "cuda" else [])
    for tier in tiers:
        store = shared_store(table, TablePlacement(tier, device))
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            ids = random_ids(layout, num_tokens, seed=2000 * rank + num_tokens).to(device)
            ok = same_bits(store.lookup(ids), full_store.lookup(ids))
            ms = median_ms(lambda ids=ids, store=store: store.lookup(ids), device, args.reps)
            record(f"shared host table, {tier} tier", num_tokens, ok, ms)
        del store
    dist.barrier()
    if rank == 0:
        SharedHostTable.remove(named[0], args.shared_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-gib", type=float, default=2.0)
    parser.add_argument("--tokens", default="256,8192")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke run)")
    parser.add_argument("--skip-layer", action="store_true", help="lookups only")
    parser.add_argument(
        "--shared-dir", default=None, help="directory of the shared host table (default /dev/shm)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        ro.use_smoke_backbone()  # a hidden size a CPU runs the layer at quickly
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    layout = EngramLayout(ro.scaled_config(args.table_gib))
    on_rank = TablePlacement("device", device, tp=world, rank=rank)
    (shard_store,) = synthetic_stores(layout, on_rank, seed=1)[:1]
    (full_store,) = synthetic_stores(layout, TablePlacement("device", device), seed=1)[:1]
    C, E = layout.n_cols, layout.config.head_dim
    results: list[dict] = []
    failures: list[str] = []

    def record(
        what: str, num_tokens: int, ok: bool, ms: float, rows: torch.Tensor | None = None
    ) -> None:
        flags = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flags)  # a check fails if it fails on any rank
        ok_everywhere = int(flags) == 0
        if not ok_everywhere:
            failures.append(f"{what} T={num_tokens}")
        result = {"what": what, "T": num_tokens, "exact": ok_everywhere, "ms": ms}
        if rows is not None:  # rank 0's rows, for a check outside this script
            result["rows_sha256"] = rows_digest(rows)
        results.append(result)
        if rank == 0:
            print(
                f"tp={world} {what:36s} T={num_tokens:6d} "
                f"{'exact' if ok_everywhere else 'MISMATCH':8s} {ms:8.3f} ms",
                flush=True,
            )

    for num_tokens in (int(t) for t in args.tokens.split(",")):
        ids = random_ids(layout, num_tokens, seed=num_tokens).to(device)
        expected = full_store.lookup(ids)
        record(
            "local shard lookup",
            num_tokens,
            True,
            median_ms(lambda ids=ids: shard_store.lookup(ids), device, args.reps),
        )
        for collective in ("all_gather", "all_reduce"):
            tp_lookup = AllGatherExchange(shard_store, num_cols=C, collective=collective)
            rows = tp_lookup.fetch(ids)
            ok = same_bits(rows, expected)
            ms = median_ms(lambda ids=ids, f=tp_lookup: f.fetch(ids), device, args.reps)
            record(f"AllGatherExchange {collective}", num_tokens, ok, ms, rows)
        part = tokens_per_rank(num_tokens, world)
        begin, end = token_range(num_tokens, world, rank)
        for collective in ("reduce_scatter", "all_to_all"):
            sp = SequenceParallelExchange(
                shard_store, num_cols=C, max_tokens=num_tokens, collective=collective
            )
            out = torch.empty((part, C, E), dtype=torch.bfloat16, device=device)
            sp.fetch(ids, out)
            ok = same_bits(out[: end - begin], expected[begin:end])
            ms = median_ms(lambda ids=ids, sp=sp, out=out: sp.fetch(ids, out), device, args.reps)
            record(f"SequenceParallelExchange {collective}", num_tokens, ok, ms)
        own_tokens = max(0, num_tokens - 3 * rank)
        own_ids = random_ids(layout, own_tokens, seed=1000 * rank + num_tokens).to(device)
        a2a = AllToAllExchange(shard_store, num_cols=C)
        ok = same_bits(a2a.fetch(own_ids), full_store.lookup(own_ids))
        ms = median_ms(lambda own_ids=own_ids: a2a.fetch(own_ids), device, args.reps)
        record("AllToAllExchange", num_tokens, ok, ms)

    shared_table_steps(layout, full_store, args, device, record)
    if not args.skip_layer:
        layer_steps(layout, shard_store, full_store, args, device, record)

    if rank == 0 and args.out:
        devices = (
            [torch.cuda.get_device_name(i) for i in range(world)]
            if device.type == "cuda"
            else ["cpu"] * world
        )
        report = {
            "environment": {**environment(device), "devices": devices},
            "backend": dist.get_backend(),
            "tp": world,
            "table_gib": args.table_gib,
            "C": C,
            "E": E,
            "results": results,
            "failures": failures,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()
    if failures:
        raise SystemExit(f"rank {rank}: results differ from the single-GPU lookup: {failures}")


if __name__ == "__main__":
    main()
