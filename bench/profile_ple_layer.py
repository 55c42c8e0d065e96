"""Where the PLE layer's time goes on a GPU, and what its launch settings change.

    python bench/profile_ple_layer.py --out bench/results/ple-layer-profile-DATE.json

On the inputs of the bench cases ``ple/layer decode 256`` and ``ple/layer prefill 8192``
(:mod:`engramrt.bench.cases_ple`: the released sizes, a bf16 table of 2^24 rows on the
device tier; made once per case), for ``PleLayer`` eager and inside ``torch.compile``:

- ``kernels``: each GPU kernel's time per layer call (``torch.profiler``, 20 calls), the
  largest first; ``median_us``: the whole call (``triton.testing.do_bench``, L2 flushed);
- ``gemm_kv_us``: the key/value GEMM alone (``F.linear`` of the gathered rows), the
  floor the layer's own kernels add to;
- ``sweep``: the call's median with each :class:`PleKernelConfig` field moved alone from
  the default, then with the best value of each together (and the default again, as the
  run's noise).

Only timings: the bench cases check every implementation against the reference first.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

KNOBS = {
    "gather_pairs": (8, 16, 32, 64),
    "gather_warps": (2, 4, 8),
    "gate_warps": (2, 4, 8, 16),
    "conv_tokens": (4, 8, 16, 32, 64),
    "conv_width": (64, 128, 256, 512),
    "conv_warps": (2, 4, 8),
    "state_width": (256, 512, 1024),
    "state_warps": (2, 4, 8),
}
CALLS = 20


def _median_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median")) * 1e3


def kernel_times(
    fn: Callable[[], Any],
    calls: int = CALLS,
    *,
    device: torch.device | None = None,
    warmup: int = 5,
) -> list[dict[str, Any]]:
    """Each GPU kernel's time per call of ``fn`` (``count``: its launches over the
    ``calls`` profiled calls), the largest first; on a CPU ``device``, each operator's
    own time."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device is None or device.type == "cuda"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        sync()
    rows = []
    for event in prof.key_averages():
        if on_gpu:
            total = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        else:
            total = event.self_cpu_time_total
        if total and event.count:
            rows.append({"kernel": event.key[:120], "count": event.count, "us": total / calls})
    return sorted(rows, key=lambda row: -row["us"])


def profile_case(case: Any, s: dict[str, Any]) -> dict[str, Any]:
    """The kernel breakdown and medians of ``case``'s engramrt implementations on its
    inputs ``s``, and the key/value GEMM alone."""
    import torch.nn.functional as F

    record: dict[str, Any] = {}
    for name in ("engramrt", "engramrt-inductor"):
        call = case.impls[name]
        record[name] = {
            "kernels": kernel_times(lambda call=call: call(s)),
            "median_us": _median_us(lambda call=call: call(s)),
        }
    layer = s["layer"]
    rows = torch.empty(
        s["hidden"].shape[0], layer.embed_dim, dtype=layer.dtype, device=layer.device
    )
    record["gemm_kv_us"] = _median_us(lambda: F.linear(rows, layer.kv_proj))
    record["gemm_shape"] = [list(rows.shape), list(layer.kv_proj.shape)]
    return record


def sweep_case(case: Any, s: dict[str, Any]) -> dict[str, Any]:
    """The engramrt call's median with each launch setting moved alone, then together."""
    from engramrt.families.qwen4_ple.module import DEFAULT_KERNEL_CONFIG

    layer, call = s["layer"], case.impls["engramrt"]

    def median(config: Any) -> float:
        layer.kernel_config = config
        call(s)
        return _median_us(lambda: call(s))

    record: dict[str, Any] = {"default": median(DEFAULT_KERNEL_CONFIG), "knobs": {}}
    best = {}
    for knob, values in KNOBS.items():
        times = {value: median(replace(DEFAULT_KERNEL_CONFIG, **{knob: value})) for value in values}
        record["knobs"][knob] = times
        best[knob] = min(times, key=times.__getitem__)
    record["best_each"] = best
    record["combined"] = median(replace(DEFAULT_KERNEL_CONFIG, **best))
    record["default_again"] = median(DEFAULT_KERNEL_CONFIG)
    layer.kernel_config = DEFAULT_KERNEL_CONFIG
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    parser.add_argument("--no-sweep", action="store_true", help="the kernel breakdown only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_ple_layer: needs a CUDA device (none here)", file=sys.stderr)
        return 2
    from engramrt.bench.cases_ple import ple_layer_cases
    from engramrt.bench.runner import environment

    device = torch.device("cuda")
    report: dict[str, Any] = {"environment": environment(device), "shapes": {}}

    failed = False
    for case in ple_layer_cases(quick=False):
        kind, shape = case.name.split()[1], case.params
        label = f"{kind} {shape['requests']}x{shape['tokens_per_request']}"
        try:
            s = case.make(device)  # one set of inputs for both parts
            record = profile_case(case, s)
            if not args.no_sweep:
                record["sweep"] = sweep_case(case, s)
        except Exception:  # one shape's failure is reported; the other still runs
            traceback.print_exc()
            failed = True
            continue
        report["shapes"][label] = record
        print(label, f"gemm {record['gemm_kv_us']:.1f} us")
        for name in ("engramrt", "engramrt-inductor"):
            print(f"  {name}: {record[name]['median_us']:.1f} us a call")
            for row in record[name]["kernels"][:6]:
                print(f"    {row['us']:9.1f} us  {row['kernel']}")
    if args.out is not None:
        from engramrt._io import atomic_write_bytes

        atomic_write_bytes(args.out, (json.dumps(report, indent=1) + "\n").encode())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
