"""Sweep launch configurations of the fused gate at V4.1-Flash shapes (GPU).

    python bench/tune_gate.py [--write-config src/engramrt/tuned]

Each configuration is checked against the reference (derived tolerance)
before it is timed; prints median µs and percent of the measured copy ceiling.
The configurations are those below and the bench's
:data:`engramrt.bench.cases_gate.GATE_SWEEP` (streams per program, unrolled D
loops: the levers for decode-sized batches). With ``--write-config DIR`` the
fastest at T=8192 becomes the shape's entry in ``DIR/engram_gate.<gpu>.json``
(:func:`engramrt.tuning.write_tuned_config`; the results belong in
BENCHMARKS.md#gate-launch-configurations).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from triton.testing import do_bench

from engramrt.bench.cases_gate import GATE_SWEEP
from engramrt.bench.runner import measure_ceilings
from engramrt.gate import GateInputs, engram_gate_reference
from engramrt.gate.config import GateKernelConfig, default_gate_config
from engramrt.gate.kernel import engram_gate_triton
from engramrt.gate.reference import assert_within_tolerance, gate_tolerance

CONFIGS = [
    GateKernelConfig(2048, 8, 2, 1),
    GateKernelConfig(1024, 4, 4, 1),
    GateKernelConfig(1024, 8, 2, 1),
    GateKernelConfig(2048, 8, 2, 2),
    GateKernelConfig(1024, 4, 4, 2),
    GateKernelConfig(512, 4, 8, 1),
    GateKernelConfig(2048, 16, 1, 1),
    GateKernelConfig(1024, 4, None, 1),
    GateKernelConfig(2048, 8, None, 1),
]
CONFIGS += [config for config in GATE_SWEEP if config not in CONFIGS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write-config",
        type=Path,
        metavar="DIR",
        help="write the fastest configuration at T=8192 to DIR/engram_gate.<gpu>.json",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    prefill_us: dict[GateKernelConfig, float] = {}
    d2d = measure_ceilings(device)["d2d"]
    hc, dim = 4, 5120
    print("default", default_gate_config(hc, dim, device=device))
    print("default at T=256", default_gate_config(hc, dim, num_tokens=256, device=device))
    for t_len in (256, 8192):
        g = torch.Generator(device=device).manual_seed(t_len)
        hidden = torch.randn(t_len, hc, dim, device=device, generator=g).bfloat16()
        kv = torch.randn(t_len, (hc + 1) * dim, device=device, generator=g).bfloat16()
        q_w = (1 + 0.1 * torch.randn(hc, dim, device=device, generator=g)).bfloat16()
        k_w = (1 + 0.1 * torch.randn(hc, dim, device=device, generator=g)).bfloat16()
        operands = GateInputs(hidden, kv, q_w, k_w, 1e-6)
        ref = engram_gate_reference(*operands)
        tol = gate_tolerance(hidden, kv, q_w, k_w, 1e-6, ref)
        nbytes = 2 * (hc * dim + (hc + 1) * dim + hc * dim) * t_len
        out = torch.empty_like(hidden)
        for cfg in CONFIGS:
            try:
                got = engram_gate_triton(operands, out=out, config=cfg)
                assert_within_tolerance(got, ref, tol)
                ms = do_bench(
                    lambda cfg=cfg: engram_gate_triton(operands, out=out, config=cfg),
                    warmup=25,
                    rep=200,
                    return_mode="median",
                )
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    engram_gate_triton(operands, out=out, config=cfg)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        engram_gate_triton(operands, out=out, config=cfg)
                gms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / 20
                if t_len == 8192:
                    prefill_us[cfg] = min(ms, gms) * 1e3
                print(
                    f"T={t_len} {cfg}: {ms * 1e3:.1f} us, graph {gms * 1e3:.1f} us, "
                    f"{100 * nbytes / (min(ms, gms) * 1e-3) / d2d:.1f}% of d2d"
                )
            except Exception as exc:
                print(f"T={t_len} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
    if args.write_config is not None and prefill_us:
        from engramrt.tuning import write_tuned_config

        best = min(prefill_us, key=prefill_us.__getitem__)
        path = write_tuned_config(
            "engram_gate",
            torch.cuda.get_device_name(device),
            ("hc", "dim", "element_bytes", "num_tokens"),
            [({"hc": hc, "dim": dim, "element_bytes": 2}, best)],
            args.write_config,
            measured="BENCHMARKS.md#gate-launch-configurations",
        )
        print(f"wrote {path}: {best}")


if __name__ == "__main__":
    main()
