"""Benchmark cases of the fused Engram gate (SPEC §8) at V4.1 shapes.

The Triton kernel against the reference run eagerly on the same GPU, at a
decode-sized batch (T=256, where launch latency matters; target <= 15 µs)
and a prefill-sized one (T=8192, bandwidth-bound; target >= 85% of the
device copy ceiling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engramrt.bench.registry import Case, Inputs, register
from engramrt.gate import (
    assert_within_tolerance,
    engram_gate,
    engram_gate_reference,
    gate_tolerance,
)

HC = 4  # hidden streams
DIM = 5120  # model width D
EPS = 1e-6
_BF16_BYTES = 2


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


def _operands(
    inputs: Inputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    return (inputs["hidden"], inputs["kv"], inputs["q_weight"], inputs["k_weight"], inputs["eps"])


def _triton(inputs: Inputs) -> torch.Tensor:
    # validate=False: the shapes are ours, and host-side checks would add
    # microseconds to the T=256 eager timing that a serving loop would not pay.
    return engram_gate(*_operands(inputs), backend="triton", out=inputs["out"], validate=False)


def _torch_eager(inputs: Inputs) -> torch.Tensor:
    return engram_gate_reference(*_operands(inputs))


def _check(inputs: Inputs, outputs: dict[str, Any]) -> None:
    """Every implementation within the derived bound of the reference
    (see :func:`engramrt.gate.gate_tolerance`)."""
    expected = outputs["torch-eager"]
    tolerance = gate_tolerance(*_operands(inputs), expected=expected)
    for name, actual in outputs.items():
        if name != "torch-eager":
            assert_within_tolerance(actual, expected, tolerance, label=name)


@register
def gate_cases(quick: bool) -> list[Case]:
    token_counts = (256, 2048) if quick else (256, 8192)
    cases = []
    for num_tokens in token_counts:
        bytes_moved = _BF16_BYTES * num_tokens * (HC * DIM + (HC + 1) * DIM + HC * DIM)
        cases.append(
            Case(
                name=f"gate/T={num_tokens}",
                group="gate",
                params={"T": num_tokens, "hc": HC, "D": DIM, "dtype": "bf16"},
                make=_make(num_tokens),
                impls={"triton": _triton, "torch-eager": _torch_eager},
                baseline="torch-eager",
                check=_check,
                bytes_moved=bytes_moved,  # hidden + kv read, out written
                items=num_tokens,
                item_name="tokens",
                ceiling="d2d",
                graph=True,
                graph_impls=("triton",),
            )
        )
    return cases
