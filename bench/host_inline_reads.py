"""Rows from host memory with no kernel beside the blocks: a decode step's cost, prototyped.

BENCHMARKS.md ("What slows the blocks beside a GPU read"): any kernel beside the blocks
slows them, whatever it reads, however few multiprocessors it holds and however long it
runs. A lookup that runs no kernel beside the blocks is the CPU's gather into pinned
memory and a copy by a copy engine (whether such a copy slows them is what this measures). This study times that design in a synchronous decode loop before
it goes into the runtime. The step bench's 30 decode blocks (256 tokens, hidden 4096) are
three CUDA graphs around two Engram layers at blocks 1 and 14, as in V4.1-Flash, each
layer's rows (6,144 random rows of 264 B from a ``--table-gib`` table, dequantised by
the lookup kernel) folded into the hidden state at its block. The rows arrive by

- ``device``: the lookup kernel over a table in GPU memory, on the step's stream
  after the blocks before the layer (the reference);
- ``uva``: the ``uva`` tier's lookup kernel reading the pinned host table, both layers
  started on a side stream when the step starts, beside the blocks (the runtime's GPU
  reads);
- ``hostN``: the row ids copied to the host when the step starts (the ids are on the
  device, as after the runtime's hash), then, by the thread that launches the step, after
  it has launched the blocks before the layer: a wait for those ids, ``torch.index_select``
  of the packed rows from the same pinned table into pinned staging with ``N`` intra-op
  threads, a copy of the staging to the GPU on a side stream (a copy engine), and on the
  step's stream a wait for that copy and the lookup kernel's dequantisation of the staged
  rows (a few microseconds, in stream order, beside nothing).

Every variant's rows are checked bit for bit against ``device`` before timing. Then
``--rounds`` rounds time every variant (order shuffled per round) over ``--steps`` steps,
the host waiting for the step's stream after each (a synchronous engine); each variant's
cost in a round is ``100 * (1 - ms_device / ms_variant)``, reported as the median and
quartiles over rounds, with the host's median time in ``hostN``'s wait, gather and copy
launch per layer.

    python bench/host_inline_reads.py --out bench/results/host-inline-reads-DATE.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_overhead as ro
from read_interference import ROW_BYTES, E, filled_store, study_device, table_rows
from step_cost import Backbone

TOKENS, COLS = 256, 24
ROWS = TOKENS * COLS  # a decode-256 step's rows per layer
SPLITS = (1, 14)  # the Engram layers' blocks


def parse_variants(text: str) -> list[str]:
    """``device,uva,host16,...`` -> the variants (``device`` first, added if missing)."""
    names = [v for v in text.split(",") if v]
    for name in names:
        if name not in ("device", "uva") and not (name.startswith("host") and name[4:].isdigit()):
            raise ValueError(f"--variants: {name!r}; expected device, uva or hostN (N threads)")
        if name.startswith("host") and int(name[4:]) < 1:
            raise ValueError(f"--variants: {name!r}; expected at least one thread")
    return ["device", *[n for n in dict.fromkeys(names) if n != "device"]]


def quartiles(values: list[float]) -> dict[str, float]:
    q = np.percentile(values, [25, 50, 75])
    return {"p25_pct": round(q[0], 2), "median_pct": round(q[1], 2), "p75_pct": round(q[2], 2)}


def capture_pieces(
    device: torch.device, n_blocks: int, rows: torch.Tensor
) -> list[torch.cuda.CUDAGraph]:
    """The decode blocks as CUDA graphs split at :data:`SPLITS`, each piece after the first
    starting with its Engram layer's rows (``rows[layer]``) folded into the hidden state."""
    backbone = Backbone(ro.block_weights(n_blocks, device))
    bounds = [0, *SPLITS, n_blocks]
    graphs: list[torch.cuda.CUDAGraph] = []
    h_in = torch.randn(TOKENS, ro.D, device=device, dtype=torch.bfloat16)
    for piece in range(len(bounds) - 1):
        lo, hi = bounds[piece], bounds[piece + 1]

        def run(h_in=h_in, lo=lo, hi=hi, piece=piece) -> torch.Tensor:
            h = h_in
            if piece > 0:  # the Engram layer at block lo: its rows folded in
                h = h + rows[piece - 1].view(TOKENS, -1)[:, : ro.D]
            return backbone.blocks(h, lo, hi)

        graph, h_in = ro.capture(run)
        graphs.append(graph)
    return graphs


def summary(
    variants: list[str], ms: dict[str, list[float]], host_us: dict[str, list[float]]
) -> dict[str, dict[str, Any]]:
    """Per variant: its median ms per step, its cost against ``device`` (median and
    quartiles of the per-round costs) and the host's median µs per layer (``hostN``)."""
    out: dict[str, dict[str, Any]] = {}
    for variant in variants:
        entry: dict[str, Any] = {"ms": round(statistics.median(ms[variant]), 4)}
        if variant != "device":
            pct = [100 * (1 - d / v) for v, d in zip(ms[variant], ms["device"], strict=True)]
            entry.update(quartiles(pct))
        for key, values in host_us.items():
            if key.startswith(variant + "/"):
                entry[f"host_us_{key.split('/')[1]}"] = round(statistics.median(values), 1)
        out[variant] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table-gib", type=float, default=8.0)
    parser.add_argument("--variants", default="device,uva,host16,host4,host1")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
    except ValueError as exc:
        parser.error(str(exc))
    if args.blocks <= max(SPLITS) or args.rounds < 1 or args.steps < 1:
        parser.error(f"expected --blocks > {max(SPLITS)}, --rounds >= 1 and --steps >= 1")
    device = study_device("host_inline_reads")
    if device is None:
        return 2
    from engramrt.bench.runner import environment
    from engramrt.lookup.tiers import TablePlacement, make_store

    num_rows = table_rows(args.table_gib)
    rng = np.random.default_rng(0)
    tables = {tier: filled_store(tier, device, num_rows) for tier in ("device", "uva")}
    host_table = tables["uva"].source  # the pinned rows the GPU reads and the CPU gathers
    staged = [
        make_store(TablePlacement("device", device=device), num_rows=ROWS, E=E) for _ in SPLITS
    ]
    local = torch.arange(ROWS, device=device).view(-1, 1)

    pool_steps = args.steps + 2
    pool = torch.from_numpy(rng.integers(0, num_rows, (pool_steps, len(SPLITS), ROWS))).to(device)
    ids = torch.empty((len(SPLITS), ROWS), dtype=torch.int64, device=device)
    ids_host = torch.empty((len(SPLITS), ROWS), dtype=torch.int64).pin_memory()
    stage = torch.empty((len(SPLITS), ROWS, ROW_BYTES), dtype=torch.uint8).pin_memory()
    rows = torch.empty((len(SPLITS), ROWS, 1, E), dtype=torch.bfloat16, device=device)

    graphs = capture_pieces(device, args.blocks, rows)

    main_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream(device)
    host_us: dict[str, list[float]] = {}

    def step(variant: str, i: int) -> None:
        ids.copy_(pool[i % pool_steps])
        read_done = []
        if variant == "uva":
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                for layer in range(len(SPLITS)):
                    tables["uva"].lookup(ids[layer].view(-1, 1), rows[layer])
                    read_done.append(torch.cuda.Event())
                    read_done[-1].record(side)
        ids_ready = None
        if variant.startswith("host"):
            ids_host.copy_(ids, non_blocking=True)
            ids_ready = torch.cuda.Event()
            ids_ready.record(main_stream)
        for piece, graph in enumerate(graphs):
            graph.replay()
            if piece == len(SPLITS):
                break
            layer = piece
            if variant == "device":
                tables["device"].lookup(ids[layer].view(-1, 1), rows[layer])
            elif variant == "uva":
                main_stream.wait_event(read_done[layer])
            else:
                start = time.perf_counter()
                assert ids_ready is not None
                ids_ready.synchronize()
                torch.index_select(host_table, 0, ids_host[layer], out=stage[layer])
                # No wait for the main stream: the copy runs beside the blocks. The staged
                # rows' last reader was the step before, which the host waited for.
                with torch.cuda.stream(side):
                    staged[layer].device_rows().copy_(stage[layer], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
                main_stream.wait_event(copied)
                staged[layer].lookup(local, rows[layer])
                host_us.setdefault(f"{variant}/layer{layer}", []).append(
                    1e6 * (time.perf_counter() - start)
                )

    def timed(variant: str) -> float:
        if variant.startswith("host"):
            torch.set_num_threads(int(variant[4:]))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(args.steps):
            step(variant, i)
            main_stream.synchronize()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / args.steps

    checks: dict[str, bool] = {}
    reference = None
    for variant in variants:
        timed(variant)  # warm-up: kernels compiled, threads started
        step(variant, 0)
        torch.cuda.synchronize()
        got = rows.clone()
        reference = got if reference is None else reference
        checks[variant] = bool(torch.equal(got, reference))
    host_us.clear()
    ms: dict[str, list[float]] = {v: [] for v in variants}
    order = np.random.default_rng(1)
    for _ in range(args.rounds):
        for vi in order.permutation(len(variants)):
            ms[variants[vi]].append(timed(variants[vi]))
    result: dict[str, Any] = {
        "environment": environment(device),
        "table_gib": args.table_gib,
        "rows_per_layer": ROWS,
        "engram_blocks": list(SPLITS),
        "blocks": args.blocks,
        "rounds": args.rounds,
        "steps": args.steps,
        "method": "synchronous loop (the host waits for the step's stream after each step), "
        "wall ms per step; cost per round against device, median and quartiles over rounds",
        "rows_equal": checks,
        "variants": summary(variants, ms, host_us),
    }
    for variant, entry in result["variants"].items():
        print(variant, entry, flush=True)
    print({"rows_equal": checks})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ro.write_report(str(args.out), result)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
