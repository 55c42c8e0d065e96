"""Benchmark cases of the row quantisation (SPEC §6): quantise and dequantise.

Rows of ``E = 256`` values. Quantise reads bf16 rows (what a float table
converts from) and writes fp8 values plus ue8m0 scale bytes; dequantise
reads those and writes bf16. The Triton kernels against the reference run
eagerly on the same GPU; outputs must match byte for byte before timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engramrt.bench.registry import Case, Inputs, assert_same_bits, register
from engramrt.quant import (
    dequantize_rows,
    dequantize_rows_reference,
    quantize_rows,
    quantize_rows_reference,
)

E = 256


def _make(num_rows: int) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        """bf16 rows whose blocks span many magnitudes, and their quantised form."""
        blocks = torch.randn(num_rows, E // 32, 32, device=device)
        blocks *= torch.exp2(torch.randint(-20, 20, (num_rows, E // 32, 1), device=device).float())
        x = blocks.reshape(num_rows, E).bfloat16()
        values, scales = quantize_rows_reference(x)
        return {
            "x": x,
            "values": values,
            "scales": scales,
            # fixed output addresses (graph capture), one per implementation so
            # the check sees what each one wrote
            "out": torch.empty((num_rows, E), dtype=torch.bfloat16, device=device),
            "out_hw": torch.empty((num_rows, E), dtype=torch.bfloat16, device=device),
        }

    return make


def _quantize_triton(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(inputs["x"], backend="triton", check_finite=False)


def _quantize_torch_eager(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_reference(inputs["x"])


def _dequantize_triton(inputs: Inputs) -> torch.Tensor:
    return dequantize_rows(inputs["values"], inputs["scales"], out=inputs["out"], backend="triton")


def _dequantize_triton_hw_convert(inputs: Inputs) -> torch.Tensor:
    return dequantize_rows(
        inputs["values"], inputs["scales"], out=inputs["out_hw"], backend="triton", hw_convert=True
    )


def _dequantize_torch_eager(inputs: Inputs) -> torch.Tensor:
    return dequantize_rows_reference(inputs["values"], inputs["scales"])


def _as_bytes(output: Any) -> list[torch.Tensor]:
    tensors = output if isinstance(output, tuple) else (output,)
    return [t.contiguous().view(torch.uint8) for t in tensors]


def _check(inputs: Inputs, outputs: dict[str, Any]) -> None:
    """Every implementation's bytes equal the baseline's (the reference)."""
    expected = _as_bytes(outputs["torch-eager"])
    for name, output in outputs.items():
        for index, (got, want) in enumerate(zip(_as_bytes(output), expected, strict=True)):
            assert_same_bits(f"{name} output {index}", got, want)


@register
def quant_cases(quick: bool) -> list[Case]:
    row_counts = (65536,) if quick else (65536, 1 << 20)
    cases = []
    packed_bytes = E + E // 32
    for num_rows in row_counts:
        cases.append(
            Case(
                name=f"quant/quantize/rows={num_rows}",
                params={"op": "quantize", "rows": num_rows, "E": E, "input": "bf16"},
                make=_make(num_rows),
                impls={"triton": _quantize_triton, "torch-eager": _quantize_torch_eager},
                check=_check,
                bytes_moved=num_rows * (E * 2 + packed_bytes),  # bf16 read, fp8 + scales written
                items=num_rows,
                item_name="rows",
            )
        )
        cases.append(
            Case(
                name=f"quant/dequantize/rows={num_rows}",
                params={"op": "dequantize", "rows": num_rows, "E": E},
                make=_make(num_rows),
                impls={
                    "triton": _dequantize_triton,
                    "triton[hw_convert]": _dequantize_triton_hw_convert,
                    "torch-eager": _dequantize_torch_eager,
                },
                check=_check,
                bytes_moved=num_rows * (packed_bytes + E * 2),  # fp8 + scales read, bf16 written
                items=num_rows,
                item_name="rows",
                graph=True,
            )
        )
    return cases
