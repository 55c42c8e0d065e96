"""Run registered benchmark cases: check first, then time, beside the baseline.

For every case the runner builds inputs, runs each implementation once and
calls the case's check (a failing check marks the case failed and it is not
timed), then times each implementation:

- ``median_us``: device time per call, median of ``triton.testing.do_bench``
  (CUDA events, L2 flushed between calls; on a CPU device, the median host
  wall time of five calls, only so that the runner itself can be tested);
- ``eager_wall_us``: host wall time per call over back-to-back calls,
  launch overhead included (synchronised once at the end);
- ``graph_us``: device time per call inside a CUDA graph holding 20 calls,
  replays timed by ``do_bench`` (L2 flushed before each replay, so calls
  2..20 find what call 1 loaded: a warm-L2 number);
- ``graph_cold_us``: device time per replay of a CUDA graph holding ONE
  call, median of ``triton.testing.do_bench`` (L2 flushed before each
  replay). This is what an engine's decode step pays when the call follows
  a backbone step that evicted everything: launch-node latency plus every
  dependent load from DRAM. Both graph times only for capturable
  implementations on CUDA.

Copy ceilings are measured in the same run: device-to-device (bytes read
plus written) and pinned host-to-device.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import json
import os
import platform
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from engramrt.bench.registry import Case, Tuning, all_cases
from engramrt.errors import ValidationError

__all__ = ["measure_ceilings", "median_seconds", "run_cases"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ceilings(device: torch.device, nbytes: int = 2 << 30) -> dict[str, float]:
    """Copy bandwidths in bytes/s: ``d2d`` (read + write) and ``h2d`` (pinned)."""
    if device.type != "cuda":
        return {}
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    d2d_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    host = torch.empty(nbytes // 2, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    dst_h = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    h2d_ms = do_bench(
        lambda: dst_h.copy_(host, non_blocking=True), warmup=50, rep=300, return_mode="median"
    )
    return {"d2d": 2 * nbytes / (d2d_ms * 1e-3), "h2d": (nbytes // 2) / (h2d_ms * 1e-3)}


def _graph_time_us(fn, inputs: dict[str, Any], device: torch.device, calls: int = 20) -> float:
    """Device time per call of a CUDA graph holding ``calls`` calls.

    Replays are timed by ``triton.testing.do_bench``, which clears L2 before
    each replay: with one call per graph every replay starts cold, with 20
    calls only the first of them does.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(inputs)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(inputs)
    from triton.testing import do_bench

    ms = do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return ms * 1e3 / calls


def _graph_times(fn, inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``graph_us`` (20 calls, warm) and ``graph_cold_us`` (one call, L2 flushed)."""
    res: dict[str, Any] = {}
    if device.type != "cuda":
        return res
    for key, calls in (("graph_us", 20), ("graph_cold_us", 1)):
        try:
            res[key] = _graph_time_us(fn, inputs, device, calls=calls)
        except Exception as exc:
            res["graph_error"] = f"{key}: {type(exc).__name__}: {exc}"[:500]
            break
    return res


def median_seconds(
    fn: Callable[[], object],
    calls: int,
    *,
    warmup: int = 0,
    sync: Callable[[], object] | None = None,
) -> float:
    """Median host wall time in seconds of ``calls`` calls of ``fn`` after ``warmup``
    untimed ones; ``sync`` (e.g. a device synchronize) is called before the first and
    after each timed call, inside its timing. The one host timer of the bench scripts."""
    if calls < 1:
        raise ValueError(f"calls={calls}; expected >= 1")
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _median_us(fn, inputs: dict[str, Any], device: torch.device) -> float:
    """Median device time per call: ``do_bench`` on CUDA, host wall time elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(lambda: fn(inputs), warmup=25, rep=200, return_mode="median") * 1e3
    return median_seconds(lambda: fn(inputs), 5) * 1e6


def _eager_wall_us(fn, inputs: dict[str, Any], device: torch.device, calls: int = 200) -> float:
    for _ in range(10):
        fn(inputs)
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn(inputs)
    _sync(device)
    return (time.perf_counter() - start) * 1e6 / calls


def run_case(case: Case, device: torch.device, ceilings: dict[str, float]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": case.name,
        "group": case.group,
        "params": case.params,
        "baseline": case.baseline,
        "bytes_moved": case.bytes_moved,
        "items": case.items,
        "item_name": case.item_name,
        "ceiling": case.ceiling,
    }
    try:
        inputs = case.make(device)
        outputs = {name: fn(inputs) for name, fn in case.impls.items()}
        _sync(device)
        case.check(inputs, outputs)
    except Exception as exc:  # the case is reported as failed, not timed
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        record["traceback"] = traceback.format_exc()[-4000:]
        return record
    del outputs
    record["status"] = "ok"
    results = {}
    ceiling = ceilings.get(case.ceiling)
    for name, fn in case.impls.items():
        res: dict[str, Any] = {"median_us": _median_us(fn, inputs, device)}
        res["eager_wall_us"] = _eager_wall_us(fn, inputs, device)
        if case.timed_in_graph(name):
            res.update(_graph_times(fn, inputs, device))
        best_us = min(v for k, v in res.items() if k in ("median_us", "graph_us"))
        res["items_per_s"] = case.items / (best_us * 1e-6)
        res["gb_per_s"] = case.bytes_moved / (best_us * 1e-6) / 1e9
        if ceiling:
            res["pct_of_ceiling"] = 100.0 * case.bytes_moved / (best_us * 1e-6) / ceiling
        results[name] = res
    base = results[case.baseline]["median_us"]
    for res in results.values():
        res["speedup_vs_baseline"] = base / res["median_us"]
    record["results"] = results
    if case.tuning is not None:
        record["tuning"] = tuning_record(case.tuning)
    return record


def tuning_record(tuning: Tuning) -> dict[str, Any]:
    """A case's :class:`Tuning` as JSON: the configs by their fields."""
    import dataclasses

    return {
        "kernel": tuning.kernel,
        "key": list(tuning.key_fields),
        "match": tuning.match,
        "metric": tuning.metric,
        "measured": tuning.measured,
        "configs": {name: dataclasses.asdict(c) for name, c in tuning.configs.items()},
    }


THREAD_SETTINGS = (
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME", "MKL_NUM_THREADS",
)  # fmt: skip
"""Environment variables that change how the host's threads run (the intra-op pool's
size and how its idle threads wait): a record names those that were set."""


def environment(device: torch.device) -> dict[str, Any]:
    """Where a benchmark ran: date, versions, device, and the host's threads (torch's
    intra-op count, the CPUs the process may use, the :data:`THREAD_SETTINGS` set)."""
    import triton

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "intra_op_threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "thread_settings": {k: os.environ[k] for k in THREAD_SETTINGS if k in os.environ},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["sms"] = props.multi_processor_count
        env["cuda"] = torch.version.cuda
    return env


def select_cases(
    groups: Iterable[str] | None = None,
    *,
    quick: bool = False,
    names: Iterable[str] | None = None,
) -> list[Case]:
    """The registered cases of ``groups`` whose name matches one of the shell-style
    patterns ``names`` (every case when None).

    Raises:
        ValidationError: a pattern that matches no case (a typo would otherwise drop
            that part of the run without a word), naming every such pattern.
    """
    groups = list(groups) if groups is not None else None
    cases = all_cases(quick, groups)
    if names is None:
        return cases
    patterns = list(names)
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(c.name, p) for c in cases)]
    if unmatched:
        where = f" of group(s) {', '.join(groups)}" if groups else ""
        raise ValidationError(
            f"case patterns {unmatched} match no benchmark case{where}; expected names like "
            "'lookup/host/T=8192' (see the markdown table)"
        )
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def run_cases(
    groups: Iterable[str] | None = None,
    *,
    quick: bool = False,
    device: str | torch.device = "cuda",
    out: str | Path | None = None,
    names: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Check and time every registered case (of ``groups``); write JSON to ``out``.

    ``names``: only cases whose name matches one of these shell-style
    patterns (``lookup/host/*``).
    """
    device = torch.device(device)
    cases = select_cases(groups, quick=quick, names=names)
    ceilings = measure_ceilings(device)
    report: dict[str, Any] = {
        "environment": environment(device),
        "quick": quick,
        "ceilings_bytes_per_s": ceilings,
    }
    records = []
    for case in cases:
        if case.requires_cuda and device.type != "cuda":
            records.append({"name": case.name, "group": case.group, "status": "skipped (no GPU)"})
            continue
        record = run_case(case, device, ceilings)
        records.append(record)
        print(format_record(record), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["cases"] = records
    if out is not None:
        from engramrt._io import atomic_write_bytes

        atomic_write_bytes(out, json.dumps(report, indent=1).encode())
    return report


def format_record(record: dict[str, Any]) -> str:
    if record.get("status") != "ok":
        return f"{record['name']}: {record.get('status')} {record.get('error', '')}"
    parts = [record["name"]]
    for name, res in record["results"].items():
        extra = f" graph {res['graph_us']:.1f}us" if "graph_us" in res else ""
        if "graph_cold_us" in res:
            extra += f" graph-cold {res['graph_cold_us']:.1f}us"
        pct = f" {res['pct_of_ceiling']:.0f}%" if "pct_of_ceiling" in res else ""
        parts.append(
            f"  {name}: {res['median_us']:.1f}us eager-wall {res['eager_wall_us']:.1f}us{extra}"
            f" {res['items_per_s'] / 1e6:.1f}M {record['item_name']}/s {res['gb_per_s']:.1f}GB/s{pct}"
        )
    return "\n".join(parts)


def markdown_table(report: dict[str, Any]) -> str:
    """A markdown table of a report: one row per (case, implementation)."""
    env = report["environment"]
    ceil = report.get("ceilings_bytes_per_s", {})
    lines = [
        f"{env['date'][:10]} · {env.get('gpu', env['device'])} · torch {env['torch']} · "
        f"triton {env['triton']} · copy ceilings: d2d {ceil.get('d2d', 0) / 1e12:.2f} TB/s, "
        f"h2d {ceil.get('h2d', 0) / 1e9:.1f} GB/s",
        "",
        "| case | impl | median µs | graph µs | graph cold µs | eager wall µs | rate | GB/s "
        "| % ceiling | vs baseline |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rec in report["cases"]:
        if rec.get("status") != "ok":
            lines.append(f"| {rec['name']} | — | {rec.get('status')} | | | | | | | |")
            continue
        for name, res in rec["results"].items():
            tag = f"{name} (baseline)" if name == rec["baseline"] else name
            graph = f"{res['graph_us']:.1f}" if "graph_us" in res else "—"
            cold = f"{res['graph_cold_us']:.1f}" if "graph_cold_us" in res else "—"
            pct = (
                f"{res['pct_of_ceiling']:.0f}% {rec['ceiling']}" if "pct_of_ceiling" in res else "—"
            )
            lines.append(
                f"| {rec['name']} | {tag} | {res['median_us']:.1f} | {graph} | {cold} | "
                f"{res['eager_wall_us']:.1f} | "
                f"{res['items_per_s'] / 1e6:,.1f} M {rec['item_name']}/s | {res['gb_per_s']:.1f} | {pct} | "
                f"{res['speedup_vs_baseline']:.2f}× |"
            )
    return "\n".join(lines)
