"""Where a synchronous step's time goes, from a torch.profiler Chrome trace.

    python bench/trace_timeline.py TRACE.json[.gz] [--gap-us 5] [--ops NAME,...] [--json OUT]

Reads a trace written by ``bench/step_cost.py --profile-steps N --trace-dir DIR`` (any
torch.profiler Chrome trace of a loop whose host waits for the step's stream after each
step). The steps are the intervals between the ends of consecutive
``cudaStreamSynchronize`` calls (the loop's waits); the first and last interval, which
hold the profiler's own start and stop, are dropped. For each step it lists

- the GPU's idle gaps longer than ``--gap-us`` (when, relative to the step's start, and
  the first GPU operation after each: what the GPU was waiting for);
- the host operations named in ``--ops`` (CUDA runtime and driver calls, aten
  operators), with their start relative to the step's and their duration;
- the copies between host and device;

and over the steps, the median of each: the step's span, the GPU's busy and idle time,
each gap (by its place in the step: the k-th gap of every step) and each named host
operation (by its k-th call in the step). Times are the profiler's: host operations
run slower under it than without (each is recorded), so read host times as an upper
bound and the order of events as exact.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DEFAULT_OPS = (
    "cudaGraphLaunch",
    "cudaEventSynchronize",
    "cudaStreamWaitEvent",
    "cudaMemcpyAsync",
    "cuLaunchKernelEx",
    "cudaLaunchKernel",
    "aten::index_select",
    "aten::reshape",
    "aten::item",
    "aten::mm",
)
BOUNDARY = "cudaStreamSynchronize"
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver", "cpu_op")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict[str, Any]]:
    """The complete events (``ph == "X"``) of a Chrome trace, plain or gzipped, in the
    order they start."""
    if not path.is_file():
        raise SystemExit(
            f"trace={str(path)!r}: no such file; expected a Chrome trace (.json or .json.gz)"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    return sorted(complete, key=lambda e: e["ts"])


def steps_of(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(start, end)`` of each whole step: between the ends of consecutive waits, the
    first and last interval dropped."""
    ends = sorted(e["ts"] + e["dur"] for e in events if e["name"] == BOUNDARY)
    bounds = list(zip(ends, ends[1:]))
    return bounds[1:-1]


def step_timeline(
    events: list[dict[str, Any]], start: float, end: float, ops: tuple[str, ...], gap_us: float
) -> dict[str, Any]:
    """One step's GPU gaps, named host operations and copies, times relative to ``start``
    (``events`` in the order they start, as :func:`load_events` gives them)."""
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and start <= e["ts"] < end]
    busy_until = None
    busy = 0.0
    gaps = []
    for e in gpu:
        e_end = e["ts"] + e["dur"]
        if busy_until is None:
            busy += e["dur"]
        elif e["ts"] > busy_until:
            if e["ts"] - busy_until > gap_us:
                gaps.append(
                    {"at": busy_until - start, "us": e["ts"] - busy_until, "next": e["name"]}
                )
            busy += e["dur"]
        elif e_end > busy_until:
            busy += e_end - busy_until
        busy_until = e_end if busy_until is None else max(busy_until, e_end)
    host = [
        {"name": e["name"], "at": e["ts"] - start, "us": e["dur"]}
        for e in events
        if e.get("cat") in HOST_CATEGORIES and e["name"] in ops and start <= e["ts"] < end
    ]
    copies = [
        {"name": e["name"], "at": e["ts"] - start, "us": e["dur"]}
        for e in gpu
        if e.get("cat") == "gpu_memcpy"
    ]
    first = gpu[0]["ts"] - start if gpu else None
    return {
        "span_us": end - start,
        "gpu_first_us": first,
        "gpu_busy_us": busy,
        "gpu_idle_us": (end - start) - busy,
        "gaps": gaps,
        "host": host,
        "copies": copies,
    }


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over ``steps``: span, busy, idle, the k-th gap of each step (where every
    step has one), the k-th call of each named host operation."""

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    gap_count = min((len(s["gaps"]) for s in steps), default=0)
    calls: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for s in steps:
        seen: dict[str, int] = defaultdict(int)
        for op in s["host"]:
            calls[(op["name"], seen[op["name"]])].append(op)
            seen[op["name"]] += 1
    return {
        "steps": len(steps),
        "span_us": median([s["span_us"] for s in steps]),
        "gpu_busy_us": median([s["gpu_busy_us"] for s in steps]),
        "gpu_idle_us": median([s["gpu_idle_us"] for s in steps]),
        "gaps": [
            {
                "k": k,
                "at": median([s["gaps"][k]["at"] for s in steps]),
                "us": median([s["gaps"][k]["us"] for s in steps]),
                "next": steps[0]["gaps"][k]["next"],
            }
            for k in range(gap_count)
        ],
        "host": [
            {
                "name": name,
                "call": k,
                "steps": len(ops),
                "at": median([op["at"] for op in ops]),
                "us": median([op["us"] for op in ops]),
            }
            for (name, k), ops in sorted(
                calls.items(), key=lambda kv: median([o["at"] for o in kv[1]])
            )
            if len(ops) == len(steps)
        ],
    }


def timeline(path: Path, ops: tuple[str, ...] = DEFAULT_OPS, gap_us: float = 5.0) -> dict:
    """Every whole step of the trace at ``path`` (:func:`step_timeline`) and their
    medians (:func:`summarize`)."""
    events = load_events(path)
    bounds = steps_of(events)
    if not bounds:
        raise SystemExit(
            f"{path}: fewer than three {BOUNDARY} calls; expected a trace of a loop that "
            "waits for its stream after each step"
        )
    steps = [step_timeline(events, a, b, ops, gap_us) for a, b in bounds]
    return {"trace": path.name, "gap_us": gap_us, "summary": summarize(steps), "steps": steps}


def print_summary(result: dict) -> None:
    s = result["summary"]
    print(
        f"{result['trace']}: {s['steps']} steps, median span {s['span_us']:.1f} us, "
        f"GPU busy {s['gpu_busy_us']:.1f}, idle {s['gpu_idle_us']:.1f}"
    )
    print(f"GPU gaps over {result['gap_us']:g} us (median over steps; the k-th of each step):")
    for gap in s["gaps"]:
        print(f"  at {gap['at']:8.1f} us: {gap['us']:7.1f} us idle, then {gap['next'][:60]}")
    print("host operations (median start and duration over steps):")
    for op in s["host"]:
        print(f"  at {op['at']:8.1f} us: {op['us']:7.1f} us {op['name']} (call {op['call']})")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument(
        "--gap-us", type=float, default=5.0, help="GPU gaps shorter than this: not listed"
    )
    p.add_argument("--ops", default=",".join(DEFAULT_OPS), help="host operations to list")
    p.add_argument("--json", type=Path, default=None, help="write every step and the medians here")
    args = p.parse_args(argv)
    if args.gap_us < 0:
        raise SystemExit(f"--gap-us={args.gap_us}; expected >= 0")
    ops = tuple(name for name in args.ops.split(",") if name)
    result = timeline(args.trace, ops, args.gap_us)
    print_summary(result)
    if args.json is not None:
        from engramrt._io import atomic_write_bytes

        atomic_write_bytes(args.json, (json.dumps(result, indent=1) + "\n").encode())
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
