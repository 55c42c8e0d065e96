"""Does a compiled model keep what the runtime does? (run on a GPU machine)

    python bench/compiled_step.py [--table-gib 8] [--rounds 15] [--out report.json]

The synthetic 7B-sized backbone of ``bench/runtime_overhead.py`` (30 dense
bf16 blocks, Engram at the start of blocks 1 and 14, V4.1-Flash row shapes,
tables scaled to ``--table-gib`` GiB per layer) runs decode steps of 256
requests two ways over the same runtime:

- ``eager``: the blocks launched from Python, each Engram layer
  ``runtime.run(layer, hidden)``;
- ``compiled``: the whole forward under ``torch.compile(fullgraph=True)``
  (Inductor), each Engram layer the ``engramrt::run_layer`` operator
  (:mod:`engramrt.custom_ops`), so the compiled model reaches the runtime
  through its handle;
- ``graphs``: the same compiled model with Inductor's CUDA graphs
  (``mode="reduce-overhead"``, ``graph_partition``): the pieces between Engram
  layers replay from CUDA graphs and ``run_layer`` (tagged
  ``cudagraph_unsafe``) runs eagerly between them, as engines run decode.
  Dropped, with the error recorded, where this torch cannot build it.

The engine plans each step on the host (``runtime.plan``) and, with
``--prefetch``, plans the next one before running the current one. Placements
(``--tiers``): ``device`` (GPU memory), ``device-again`` (a second runtime
over the same tables: the A/A control), ``host`` (host memory, the runtime's
default GPU reads for the first Engram layer only). What the compiled path
must keep: the step cost of host tables against GPU memory, paired per round
(``100 * (1 - ms_device / ms_host)``, the same method as
``runtime_overhead.py``), within 0.3 points of the eager runtime's.

Before timing, every placement's compiled step is checked against its eager
step on the same batch: the rows in the runtime's staging bit for bit
(``StepPlan.rows``) and a finite output; the final hidden state's relative
error against eager is recorded (thirty bf16 blocks that Inductor fuses
differently from eager: no bound is derived for it here, while
tests/test_custom_ops.py holds each compiled Engram layer to the gate's
derived tolerance). A placement that fails is not timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engramrt import custom_ops
from engramrt.bench.runner import environment
from engramrt.hashing import HashConstants, NgramHasher
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap
from runtime_overhead import (
    ENGRAM_AT,
    HC,
    block_window,
    decode_batches,
    make_backbone,
    paired_stats,
    run_block,
    scaled_config,
    write_report,
)

MODES = ("eager", "compiled", "graphs")
TIERS = ("device", "device-again", "host")


def forward_fn(runtime: EngramRuntime, blocks, compiled_ops: bool):
    """The backbone's forward over ``runtime``'s Engram layers: ``x [T, D] -> [T, D]``.

    The backbone's one stream is copied to the ``hc`` hyper-connection streams
    for an Engram layer and the first stream is carried on (as in
    ``runtime_overhead.engram_layer``). Each block's output is RMS-normalised
    (as a transformer's next block does with its input), so thirty blocks of
    random weights stay finite and the compiled and eager outputs can be compared.
    """

    def forward(x: torch.Tensor) -> torch.Tensor:
        t_len, dim = x.shape
        for b, weights in enumerate(blocks):
            if b in ENGRAM_AT:
                li = ENGRAM_AT[b]
                hidden = x.unsqueeze(1).expand(t_len, HC, dim).contiguous()
                if compiled_ops:
                    x = custom_ops.run_layer(runtime, li, hidden)[:, 0]
                else:
                    x = runtime.run(li, hidden)[:, 0]
            x = run_block(x, weights)
            x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return x

    return forward


def run_block_of_steps(runtime, forward, batches, xs, prefetch: bool) -> float:
    """ms per step of ``forward`` over ``batches`` (each planned before it runs)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step = runtime.plan(batches[0])
    for i in range(len(batches)):
        nxt = runtime.prefetch(batches[i + 1]) if prefetch and i + 1 < len(batches) else None
        torch.compiler.cudagraph_mark_step_begin()  # a new step for Inductor's CUDA graphs
        forward(xs[i % len(xs)])
        if i + 1 < len(batches):
            step = nxt if nxt is not None else runtime.plan(batches[i + 1])
    del step
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / len(batches)


def check(runtime, forwards, mode, batch, x) -> dict:
    """``mode`` against eager on one batch: rows bit for bit, a finite output, and the
    output's relative error (recorded)."""
    plan = runtime.plan(batch)
    eager_out = forwards["eager"](x).float()
    eager_rows = [plan.rows(li).clone() for li in range(runtime.n_layers)]
    plan = runtime.plan(batch)
    torch.compiler.cudagraph_mark_step_begin()
    out = forwards[mode](x).float()
    rows_equal = all(
        torch.equal(plan.rows(li).view(torch.int16), eager_rows[li].view(torch.int16))
        for li in range(runtime.n_layers)
    )
    rel = float((out - eager_out).norm() / eager_out.norm())
    finite = bool(torch.isfinite(out).all() and torch.isfinite(eager_out).all())
    torch.cuda.synchronize()
    return {
        "rows_equal": rows_equal,
        "finite": finite,
        "relative_error": rel,
        "passed": rows_equal and finite,
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table-gib", type=float, default=8.0)
    p.add_argument("--tiers", default=",".join(TIERS))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per block")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=0.0, help="start no round after (0: none)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tiers = args.tiers.split(",")
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown or "device" not in tiers:
        p.error(f"--tiers {args.tiers!r}: expected names from {', '.join(TIERS)}, with device")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    args.tiers = tiers
    return args


def build(args, device):
    """Per placement: its runtime over shared heads, and its eager and compiled forwards."""
    cfg = scaled_config(args.table_gib)
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    blocks, heads = make_backbone(cfg, device)
    # Held as parameters, as an engine's model holds them: Inductor's CUDA graphs take
    # parameters as static inputs, but copy plain tensors a graph closes over into its
    # inputs at every replay (the thirty blocks' weights, about 12 GB a step).
    blocks = [tuple(nn.Parameter(w, requires_grad=False) for w in block) for block in blocks]
    stores = {
        tier: synthetic_stores(layout, TablePlacement(tier, device)) for tier in ("device", "host")
    }
    setups = {}
    for tier in args.tiers:
        runtime = EngramRuntime(
            NgramHasher(consts, token_map, device),
            stores["host" if tier == "host" else "device"],
            heads=heads,
            max_tokens=256,
            max_requests=256,
            validate=False,
        )
        fn = forward_fn(runtime, blocks, compiled_ops=True)
        forwards = {
            "eager": forward_fn(runtime, blocks, compiled_ops=False),
            "compiled": torch.compile(fn, fullgraph=True),
            "graphs": torch.compile(fn, fullgraph=True, mode="reduce-overhead"),
        }
        setups[tier] = {"runtime": runtime, "forwards": forwards}
    return cfg, token_map, setups


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "compiled_step: needs a CUDA device (the compiled path is Inductor's)", file=sys.stderr
        )
        raise SystemExit(2)
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    torch._inductor.config.graph_partition = True  # split Inductor's CUDA graphs at run_layer
    cfg, token_map, setups = build(args, device)
    rng = np.random.default_rng(args.seed)
    batches = decode_batches(rng, token_map.vocab_size, 4 * args.steps, device)
    xs = [torch.randn(256, cfg.hidden_size, device=device, dtype=torch.bfloat16) for _ in range(4)]
    checks: dict[str, dict] = {}
    modes = list(MODES)
    for tier, setup in list(setups.items()):
        checks[tier] = {}
        for mode in modes[1:]:
            try:
                for _ in range(3):  # compile, warm up (and record Inductor's graphs)
                    check(setup["runtime"], setup["forwards"], mode, batches[0], xs[0])
                result = check(setup["runtime"], setup["forwards"], mode, batches[1], xs[1])
            except Exception as error:  # a mode this torch cannot build: say so, time the rest
                result = {"passed": False, "error": f"{type(error).__name__}: {error}"[:500]}
                setup["runtime"].abandon()  # the steps the failed mode planned
            checks[tier][mode] = result
            print(f"check {tier} {mode}: {result}")
    for mode in modes[1:]:
        if not all(checks[tier][mode]["passed"] for tier in setups):
            modes.remove(mode)
    configs = [(tier, mode) for tier in setups for mode in modes]
    ms: dict[tuple[str, str], list[float | None]] = {c: [] for c in configs}
    order_rng = np.random.default_rng(args.seed + 1)
    started = time.perf_counter()
    report: dict = {}
    for round_index in range(args.rounds):
        if round_index and args.max_seconds and time.perf_counter() - started > args.max_seconds:
            break
        for ci in order_rng.permutation(len(configs)):
            tier, mode = configs[ci]
            setup = setups[tier]
            warm, timed = block_window(len(batches), round_index, args.steps, args.warmup_steps)
            forward = setup["forwards"][mode]
            if warm:
                run_block_of_steps(
                    setup["runtime"], forward, [batches[i] for i in warm], xs, args.prefetch
                )
            value = run_block_of_steps(
                setup["runtime"], forward, [batches[i] for i in timed], xs, args.prefetch
            )
            ms[(tier, mode)].append(value)
            print(f"round {round_index:2d} {tier:12s} {mode:8s} {value:.3f} ms/step")
        report = summarize(args, env, ms, checks, round_index + 1)
        if args.out:
            write_report(args.out, report)
    for row in report["results"]:
        cost = row.get("loss_vs_gpu_pct")
        text = "" if cost is None else f"  cost vs GPU memory {cost:+.2f}%"
        print(f"{row['tier']:12s} {row['mode']:8s} {row['ms_per_step']:.3f} ms/step{text}")
    for name, value in report["compiled_minus_eager_points"].items():
        print(f"compiled - eager, {name}: {value:+.2f} points")


def summarize(args, env, ms, checks, rounds_done: int) -> dict:
    results = []
    for (tier, mode), values in ms.items():
        row = {"tier": tier, "mode": mode, "ms_per_step": float(np.median(values))}
        row["ms_rounds"] = values
        if tier != "device":
            row.update(paired_stats("loss_vs_gpu_pct", values, ms[("device", mode)]))
        results.append(row)
    by = {(r["tier"], r["mode"]): r for r in results}
    diff = {
        tier: by[(tier, "compiled")]["loss_vs_gpu_pct"] - by[(tier, "eager")]["loss_vs_gpu_pct"]
        for tier in {t for t, _ in ms}
        if tier != "device"
    }
    return {
        "bench": "compiled_step",
        "environment": env,
        "table_gib_per_layer": args.table_gib,
        "decode_tokens": 256,
        "prefetch": args.prefetch,
        "steps_per_block": args.steps,
        "rounds_completed": rounds_done,
        "seed": args.seed,
        "checks": checks,
        "results": results,
        "compiled_minus_eager_points": diff,
    }


if __name__ == "__main__":
    main()
