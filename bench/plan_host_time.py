"""How much host time one ``EngramRuntime.plan`` takes at decode, and where it goes.

    python bench/plan_host_time.py [--table-gib 0.5] [--calls 500] [--out report.json]

In a synchronous decode loop (the host waits for each step before planning the
next: ``bench/runtime_overhead.py --sync-steps``) the GPU idles while the host
plans, so ``plan``'s host time is part of every step. For each placement
(``--tiers``: GPU-memory tables, the host tier with the runtime's defaults)
over decode steps of 256 requests (``runtime_overhead.decode_batches``), it
times, on the host, with ``time.perf_counter``:

- ``plan_us``: ``runtime.plan(batch)`` alone (its launches, events and hand-offs
  to worker threads);
- ``step_us``: ``plan`` and then every layer's ``rows`` (the waits an Engram
  layer makes), the device drained after each step: what a synchronous loop
  pays between steps beyond the model's own launches;

the median and quartiles over ``--calls`` calls after ``--warmup`` untimed ones,
and a ``cProfile`` of ``--profile-calls`` plans: the functions with the most
own time (``profile``). Prints a line per placement; ``--out`` writes the JSON
report atomically. On a CPU (``--device cpu``, the reference backend) the
script runs end to end for its tests; the figures mean something on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engramrt._io import atomic_write_bytes
from engramrt.bench.runner import environment
from engramrt.hashing import HashConstants, NgramHasher
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement, tier_class
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap

TIERS = ("device", "host")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quartiles_us(seconds: list[float]) -> dict[str, float]:
    p25, p50, p75 = np.percentile(np.asarray(seconds) * 1e6, [25, 50, 75])
    return {"median": float(p50), "p25": float(p25), "p75": float(p75)}


def time_placement(runtime: EngramRuntime, batches, args, device: torch.device) -> dict:
    """``plan_us``, ``step_us`` and the profile of one placement (see the module doc)."""
    layers = range(runtime.n_layers)

    def step(batch) -> float:
        start = time.perf_counter()
        plan = runtime.plan(batch)
        planned = time.perf_counter() - start
        for li in layers:
            plan.rows(li)
        return planned

    for i in range(args.warmup):
        step(batches[i % len(batches)])
    synchronize(device)
    plan_s, step_s = [], []
    for i in range(args.calls):
        batch = batches[i % len(batches)]
        synchronize(device)
        start = time.perf_counter()
        plan_s.append(step(batch))
        synchronize(device)
        step_s.append(time.perf_counter() - start)
    top, text = profile_plans(runtime, batches, args, device)
    return {
        "plan_us": quartiles_us(plan_s),
        "step_us": quartiles_us(step_s),
        "profile": top,
        "profile_text": text,
    }


def profile_plans(runtime: EngramRuntime, batches, args, device) -> tuple[list[dict], str]:
    """The ``--profile-top`` functions with the most own time over ``--profile-calls``
    profiled plans, as records and as pstats' text (none and "" for no calls)."""
    if args.profile_calls == 0:
        return [], ""
    profile = cProfile.Profile()
    for i in range(args.profile_calls):
        batch = batches[i % len(batches)]
        profile.enable()
        plan = runtime.plan(batch)
        profile.disable()
        for li in range(runtime.n_layers):
            plan.rows(li)
        synchronize(device)
    stats = pstats.Stats(profile)
    calls = args.profile_calls
    top = [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "own_us_per_plan": 1e6 * own / calls,
            "calls_per_plan": count / calls,
        }
        for (file, line, name), (_, count, own, _, _) in sorted(
            stats.stats.items(),  # type: ignore[attr-defined]
            key=lambda item: -item[1][2],
        )[: args.profile_top]
    ]
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile_top)
    return top, text.getvalue()


def build_runtime(tier: str, layout, consts, token_map, device, backend: dict) -> EngramRuntime:
    options = tier_class(tier).options_type(**backend)
    stores = synthetic_stores(layout, TablePlacement(options, device), seed=1)
    hasher = NgramHasher(consts, token_map, device, validate=False, **backend)
    return EngramRuntime(hasher, stores, max_tokens=8192, max_requests=512, validate=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-gib", type=float, default=0.5, help="each layer's table")
    parser.add_argument("--tiers", default=",".join(TIERS), help=f"some of {', '.join(TIERS)}")
    parser.add_argument("--calls", type=int, default=500, help="timed steps per placement")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps first")
    parser.add_argument("--profile-calls", type=int, default=300, help="plans profiled")
    parser.add_argument("--profile-top", type=int, default=15, help="functions reported")
    parser.add_argument("--steps", type=int, default=64, help="distinct decode batches")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for option in ("calls", "steps", "profile_top"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)}; expected >= 1")
    for option in ("warmup", "profile_calls"):
        if getattr(args, option) < 0:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)}; expected >= 0")
    for tier in args.tiers.split(","):
        if tier not in TIERS:
            raise SystemExit(f"--tiers: {tier!r}; expected some of {', '.join(TIERS)}")
    return args


def main(argv=None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import runtime_overhead as ro

    args = parse_args(argv)
    device = torch.device(args.device)
    backend = {} if device.type == "cuda" else {"backend": "reference"}
    cfg = ro.scaled_config(args.table_gib)
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    batches = ro.decode_batches(np.random.default_rng(0), token_map.vocab_size, args.steps, device)
    results = []
    for tier in args.tiers.split(","):
        runtime = build_runtime(tier, layout, consts, token_map, device, backend)
        try:
            timed = time_placement(runtime, batches, args, device)
        finally:
            runtime.close()
        results.append({"tier": tier, "lookup_workers": runtime.lookup_workers, **timed})
        plan, step = timed["plan_us"], timed["step_us"]
        print(
            f"{tier:6s} plan {plan['median']:8.1f} us [{plan['p25']:.1f}, {plan['p75']:.1f}]  "
            f"plan + rows, drained {step['median']:8.1f} us [{step['p25']:.1f}, {step['p75']:.1f}]"
        )
        print(timed["profile_text"])
    report = {
        "environment": environment(device),
        "table_gib_per_layer": args.table_gib,
        "tokens_per_step": batches[0].num_tokens,
        "calls": args.calls,
        "method": "host perf_counter per call, device drained before each step; medians",
        "results": results,
    }
    if args.out:
        atomic_write_bytes(args.out, json.dumps(report, indent=1).encode())
    return report


if __name__ == "__main__":
    main()
