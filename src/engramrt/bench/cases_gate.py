"""Benchmark cases of the fused Engram gate (SPEC §8) at V4.1 shapes.

The Triton kernel against the reference run eagerly on the same GPU, at a
decode-sized batch (T=256, where launch latency matters) and a
prefill-sized one (T=8192, bandwidth-bound); the targets are in
BENCHMARKS.md#against-the-targets. Beside the default configuration each
case times the launch configurations of :data:`GATE_SWEEP`; with
``engramrt bench --write-config DIR`` the fastest at T=8192 becomes the
entry for its shape in ``DIR/engram_gate.<device>.json`` (read by
:func:`engramrt.gate.config.default_gate_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engramrt.bench.registry import Case, Inputs, Tuning, register
from engramrt.gate import (
    GateInputs,
    assert_within_tolerance,
    engram_gate,
    engram_gate_reference,
    gate_tolerance,
)
from engramrt.gate.config import GateKernelConfig

HC = 4  # hidden streams
DIM = 5120  # model width D
EPS = 1e-6
_BF16_BYTES = 2

GATE_SWEEP: tuple[GateKernelConfig, ...] = (
    GateKernelConfig(1024, 4, None, 1),  # the default at hc=4, D=5120 before this sweep
    GateKernelConfig(1024, 4, 4, 1),
    GateKernelConfig(2048, 8, 2, 1),
    # decode: several programs per token, and/or all chunks' loads issued at once
    GateKernelConfig(1024, 4, None, 1, streams_per_program=1),
    GateKernelConfig(1024, 4, None, 1, streams_per_program=2),
    GateKernelConfig(1024, 8, None, 1, unroll=True),
    GateKernelConfig(1024, 16, None, 1, unroll=True),
    GateKernelConfig(1024, 8, None, 1, streams_per_program=2, unroll=True),
    GateKernelConfig(1024, 4, None, 1, streams_per_program=1, unroll=True),
    GateKernelConfig(2048, 8, None, 1, streams_per_program=2, unroll=True),
    GateKernelConfig(512, 4, None, 1, streams_per_program=1, unroll=True),
    GateKernelConfig(2048, 16, None, 1, unroll=True),
)
"""Launch configurations timed beside the default at every gate case."""


def config_label(config: GateKernelConfig) -> str:
    """``block=1024,warps=8,per_sm=None,stages=1,streams=2,unroll`` for an implementation's name."""
    label = (
        f"block={config.block_d},warps={config.num_warps},per_sm={config.programs_per_sm},"
        f"stages={config.num_stages}"
    )
    if config.streams_per_program is not None:
        label += f",streams={config.streams_per_program}"
    return label + (",unroll" if config.unroll else "")


def _make(num_tokens: int) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        """Fresh random bf16 activations; RMSNorm weights near 1."""
        return {
            "hidden": torch.randn(num_tokens, HC, DIM, device=device).bfloat16(),
            "kv": torch.randn(num_tokens, (HC + 1) * DIM, device=device).bfloat16(),
            "q_weight": (1.0 + 0.1 * torch.randn(HC, DIM, device=device)).bfloat16(),
            "k_weight": (1.0 + 0.1 * torch.randn(HC, DIM, device=device)).bfloat16(),
            "eps": EPS,
            # a fixed output address, so the kernel call can be graph-captured
            "out": torch.empty(num_tokens, HC, DIM, device=device, dtype=torch.bfloat16),
        }

    return make


def _operands(inputs: Inputs) -> GateInputs:
    return GateInputs(
        inputs["hidden"], inputs["kv"], inputs["q_weight"], inputs["k_weight"], inputs["eps"]
    )


def _triton(inputs: Inputs) -> torch.Tensor:
    # validate=False: the shapes are ours, and host-side checks would add
    # microseconds to the T=256 eager timing that a serving loop would not pay.
    return engram_gate(_operands(inputs), backend="triton", out=inputs["out"], validate=False)


def _triton_config(config: GateKernelConfig) -> Callable[[Inputs], torch.Tensor]:
    def run(inputs: Inputs) -> torch.Tensor:
        from engramrt.gate.kernel import engram_gate_triton

        return engram_gate_triton(_operands(inputs), out=inputs["out"], config=config)

    return run


def _torch_eager(inputs: Inputs) -> torch.Tensor:
    return engram_gate_reference(*_operands(inputs))


def _check(inputs: Inputs, outputs: dict[str, Any]) -> None:
    """Every implementation within the derived bound of the reference
    (see :func:`engramrt.gate.gate_tolerance`)."""
    expected = outputs["torch-eager"]
    hidden, kv, q_weight, k_weight, eps, _ = _operands(inputs)  # no token mask in these cases
    tolerance = gate_tolerance(hidden, kv, q_weight, k_weight, eps, expected=expected)
    for name, actual in outputs.items():
        if name != "torch-eager":
            assert_within_tolerance(actual, expected, tolerance, label=name)


@register
def gate_cases(quick: bool) -> list[Case]:
    token_counts = (256, 2048) if quick else (256, 8192)
    cases = []
    for num_tokens in token_counts:
        bytes_moved = _BF16_BYTES * num_tokens * (HC * DIM + (HC + 1) * DIM + HC * DIM)
        impls: dict[str, Callable[[Inputs], Any]] = {
            "triton": _triton,
            "torch-eager": _torch_eager,
        }
        configs = {f"triton[{config_label(config)}]": config for config in GATE_SWEEP}
        for name, config in configs.items():
            impls[name] = _triton_config(config)
        # the prefill size picks the shape's entry: bandwidth-bound, and at T=256 no
        # configuration has beaten it (BENCHMARKS.md#gate-launch-configurations)
        tuning = None
        if num_tokens == 8192:
            tuning = Tuning(
                kernel="engram_gate",
                key_fields=("hc", "dim", "element_bytes", "num_tokens"),
                match={"hc": HC, "dim": DIM, "element_bytes": _BF16_BYTES},
                configs=configs,
                measured="BENCHMARKS.md#gate-launch-configurations",
            )
        cases.append(
            Case(
                name=f"gate/T={num_tokens}",
                params={"T": num_tokens, "hc": HC, "D": DIM, "dtype": "bf16"},
                make=_make(num_tokens),
                impls=impls,
                check=_check,
                bytes_moved=bytes_moved,  # hidden + kv read, out written
                items=num_tokens,
                item_name="tokens",
                graph=True,
                tuning=tuning,
            )
        )
    return cases
