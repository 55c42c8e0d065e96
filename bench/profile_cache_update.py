"""What one hot-row cache update costs the device at decode, kernel by kernel.

    python bench/profile_cache_update.py [--table-gib 1] [--steps 40] [--out report.json]

A decode lookup of 256 tokens x 24 columns of Zipf ids through a
:class:`~engramrt.cache.CachedRowStore` (5% of a host-tier table, GPU reads)
is profiled with ``torch.profiler`` over ``--steps`` lookups, each followed by
the cache's update (which works once ``--update-every`` lookups are pending),
on a side stream as the runtime runs it. Each lookup and each update is a
profiler range; per call it reports the device kernels the range launched and
their summed time (medians), the busiest kernels, and the time from a
lookup's start to its rows (CUDA events: that includes waiting for the last
update). The
update's kernels are what a lookup that follows it waits behind
(BENCHMARKS.md, "The hot-row cache at decode"); ``--policy torch`` runs the
update's counting and planning as the policy's torch definition instead of its
kernels, for the comparison. The probe is a Triton launch outside any torch
operator, which the profiler does not attribute to the lookup's range: the
lookup's own time is the CUDA events' figure, and ``device`` counts every kernel in
the trace per step (a lookup and its update), by name. On a CPU (``--device cpu``)
the script runs end to end with CPU activities only, for its tests.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engramrt._io import atomic_write_bytes
from engramrt.bench.cases_cache import ZipfRows
from engramrt.bench.runner import environment
from engramrt.cache import CachedRowStore
from engramrt.lookup.synthetic import random_packed_rows
from engramrt.lookup.tiers import HostOptions, TablePlacement, make_store

E, COLS, TOKENS, ROW_BYTES = 256, 24, 256, 264
LOOKUP, UPDATE = "engramrt.lookup", "engramrt.update"  # the profiler ranges


def build_cache(args: argparse.Namespace, device: torch.device) -> tuple[CachedRowStore, ZipfRows]:
    num_rows = int(args.table_gib * 2**30) // ROW_BYTES
    backend = "triton" if device.type == "cuda" else "reference"
    store = make_store(TablePlacement(HostOptions(backend=backend), device), num_rows=num_rows, E=E)
    generator = torch.Generator(device=device).manual_seed(11)
    for start in range(0, num_rows, 1 << 20):
        count = min(1 << 20, num_rows - start)
        store.write_rows(start, random_packed_rows(count, E, device, generator))
    cache = CachedRowStore(
        store,
        int(args.cache_fraction * num_rows) * ROW_BYTES,
        backend=backend,
        max_pending=max(4, args.update_every),
        policy_backend=None if args.policy == "kernels" else "reference",
    )
    cache.update_every = args.update_every
    return cache, ZipfRows(num_rows, 1.0, device, seed=99)


def steps(cache, batches, out, side, events) -> None:
    """Each batch's lookup, then the cache's update (on ``side`` when given, as the runtime
    runs it), each inside a profiler range of its own."""
    for i, row_ids in enumerate(batches):
        with record_function(LOOKUP):
            if events is not None:
                events[i][0].record()
            cache.fetch(row_ids, out)
            if events is not None:
                events[i][1].record()
        with record_function(UPDATE):
            if side is None:
                cache.update()
            else:
                with torch.cuda.stream(side):
                    cache.update(side)


def _kernels(event) -> list:
    """The device kernels ``event`` and every CPU op under it launched."""
    found = list(event.kernels)
    for child in event.cpu_children:
        found += _kernels(child)
    return found


def _ops(event) -> int:
    return sum(1 + _ops(child) for child in event.cpu_children)


def ranges(prof, name: str, device: torch.device) -> dict:
    """Per call of the range ``name``: its kernels (CPU ops on a CPU) and their time (µs),
    medians over the calls, and the busiest kernels over all of them."""
    calls = [e for e in prof.events() if e.name == name]
    counts, times, busiest = [], [], Counter()
    for event in calls:
        if device.type == "cuda":
            kernels = _kernels(event)
            counts.append(len(kernels))
            times.append(sum(k.duration for k in kernels))
            for kernel in kernels:
                busiest[kernel.name[:120]] += kernel.duration
        else:
            counts.append(_ops(event))
            times.append(event.cpu_time_total)
    return {
        "calls": len(calls),
        "kernels": _median(counts),
        "kernel_us": _median(times),
        "busiest": [
            {"kernel": k, "us_per_call": us / max(1, len(calls))}
            for k, us in busiest.most_common(8)
        ],
    }


def device_work(prof, steps: int) -> dict:
    """Every device kernel (and memset, memcpy) in the trace, by name, per step (a lookup
    and its update): Triton launches sit outside any torch operator, so the ranges above
    do not see them, but the trace does."""
    count, time_us = Counter(), Counter()
    for event in prof.events():
        # The ranges show up on the device's timeline too (as annotations): not kernels.
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name not in (
            LOOKUP,
            UPDATE,
        ):
            count[event.name[:120]] += 1
            time_us[event.name[:120]] += event.device_time_total
    per = max(1, steps)
    return {
        "kernels_per_step": sum(count.values()) / per,
        "kernel_us_per_step": sum(time_us.values()) / per,
        "busiest": [
            {"kernel": name, "per_step": count[name] / per, "us_per_step": us / per}
            for name, us in time_us.most_common(12)
        ],
    }


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def measure(cache, sampler, args, device: torch.device) -> dict:
    batches = [sampler.sample((TOKENS, COLS)) for _ in range(args.warmup + args.steps)]
    out = torch.empty((TOKENS, COLS, E), dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    steps(cache, batches[: args.warmup], out, side, None)  # compile, warm the cache
    timed = batches[args.warmup :]
    events = None
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in timed
        ]
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if side is not None else [])
    cache.reset_stats()
    with profile(activities=activities) as prof:
        steps(cache, timed, out, side, events)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    lookup_us = [1e3 * a.elapsed_time(b) for a, b in events] if events is not None else []
    return {
        "lookup": ranges(prof, LOOKUP, device),
        "update": ranges(prof, UPDATE, device),
        "device": device_work(prof, len(timed)),
        "lookup_to_rows_us": _median(lookup_us),
        "hit_rate": cache.stats().hit_rate,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-gib", type=float, default=1.0)
    parser.add_argument("--cache-fraction", type=float, default=0.05)
    parser.add_argument("--update-every", type=int, default=1)
    parser.add_argument(
        "--policy",
        choices=("kernels", "torch"),
        default="kernels",
        help="the update's counting and planning: the policy's Triton kernels (on a GPU) or "
        "its torch definition (CachedRowStore(policy_backend='reference'))",
    )
    parser.add_argument("--steps", type=int, default=40, help="profiled lookups")
    parser.add_argument("--warmup", type=int, default=10, help="lookups first, not profiled")
    parser.add_argument("--top", type=int, default=12, help="kernels listed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    for option in ("steps", "update_every", "top"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)}; expected >= 1")
    device = torch.device(args.device)
    cache, sampler = build_cache(args, device)
    res = measure(cache, sampler, args, device)
    unit = "kernels" if device.type == "cuda" else "CPU ops"
    for name in ("lookup", "update"):
        r = res[name]
        print(
            f"{name:7s} x{r['calls']}: median {r['kernels']} {unit}, {r['kernel_us']:.1f} us "
            f"of them per call"
        )
        for kernel in r["busiest"]:
            print(f"    {kernel['us_per_call']:8.1f} us  {kernel['kernel']}")
    work = res["device"]
    print(
        f"device work per step (lookup + update): {work['kernels_per_step']:.1f} kernels, "
        f"{work['kernel_us_per_step']:.1f} us"
    )
    for kernel in work["busiest"]:
        print(f"    {kernel['us_per_step']:8.1f} us  x{kernel['per_step']:.1f}  {kernel['kernel']}")
    print(f"lookup to rows {res['lookup_to_rows_us']} us (median), hit rate {res['hit_rate']:.2f}")
    report = {
        "environment": environment(device),
        "table_gib": args.table_gib,
        "cache_fraction": args.cache_fraction,
        "update_every": args.update_every,
        "policy": args.policy,
        "steps": args.steps,
        "method": "torch.profiler ranges per lookup and per update (the kernels each "
        "launched); lookup to rows: CUDA events; medians over the steps",
        **res,
    }
    if args.out:
        atomic_write_bytes(args.out, json.dumps(report, indent=1).encode())
    return report


if __name__ == "__main__":
    main()
