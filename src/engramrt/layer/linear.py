"""``wkv``: the Engram layer's projection ``[T, C*E] -> [T, (hc+1)*D]``, no bias.

Checkpoints store the weight ``[out, in]`` either as bf16 or as float8
e4m3fn with fp32 block scales ``weight_scale_inv [ceil(out/128), ceil(in/128)]``
(DeepSeek's layout for linear layers; dequantised weight = fp8 value * scale).

An fp8 weight is dequantised to bf16 **once, at load**, and every forward
is a plain bf16 GEMM with fp32 accumulation (cuBLAS on a GPU). The trade-off:

- memory: 2 bytes per weight instead of 1 (+ 4 bytes per 128 x 128 block).
  At V4.1-Flash shapes (``[25600, 6144]``) that is 315 MB instead of 157 MB
  per Engram layer, +157 MB per layer and rank (the projection is
  replicated across sequence-parallel ranks), next to a 94 GiB table;
- speed: one bf16 GEMM per step, most of the whole layer step at decode
  and prefill sizes alike (BENCHMARKS.md#the-layer-step-part-by-part). An
  fp8 GEMM would halve the weight bytes and double the peak rate, so it is
  the next lever, but it needs the activations quantised to
  fp8 as well (another rounding of the rows: a different result, and a
  looser tolerance) and a block-scaled GEMM kernel;
- numerics: the bf16 weight is ``bf16(fp32(fp8 * scale))``, within
  :data:`~engramrt.layer.reference.BF16_DEQUANT_ROUNDING` of the exact
  product (see :func:`~engramrt.layer.reference.linear_tolerance`).

On a CPU the forward is the reference: fp32 operands, fp32 GEMM, bf16
result (the CPU bf16 GEMM's accumulation precision is the BLAS library's
choice; fp32 makes it ours).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engramrt.errors import CheckpointError, describe_tensor
from engramrt.layer.reference import (
    BF16_DEQUANT_ROUNDING,
    WEIGHT_BLOCK,
    dequantize_block_fp8_reference,
)

__all__ = ["EngramLinear", "dequantize_block_fp8"]

# Rows of the weight dequantised per step at load: bounds the fp32
# temporaries to 32 blocks of rows (100 MB at in = 6144).
_DEQUANT_ROW_BLOCKS = 32


def dequantize_block_fp8(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Write ``bf16(fp32(weight * scale))`` into ``out`` ``[out, in]``, in row pieces.

    ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32) may live on
    another device than ``out`` (e.g. a CPU checkpoint); each piece is moved
    to ``out``'s device before it is dequantised there.
    """
    out_features = weight.shape[0]
    step = WEIGHT_BLOCK * _DEQUANT_ROW_BLOCKS
    for row in range(0, out_features, step):
        stop = min(row + step, out_features)
        piece = weight[row:stop].to(out.device)
        scales = weight_scale_inv[row // WEIGHT_BLOCK : math.ceil(stop / WEIGHT_BLOCK)]
        out[row:stop] = dequantize_block_fp8_reference(piece, scales.to(out.device))
    return out


class EngramLinear(nn.Module):
    """``y = x @ weight.T`` (no bias) with a bf16 compute weight.

    Args:
        in_features: ``C * E``.
        out_features: ``(hc + 1) * D``.
        device: where the weight lives.

    Attributes:
        weight: ``[out_features, in_features]`` bf16 parameter (zeros until
            :meth:`load`, so an unloaded layer adds nothing).
        weight_rounding: relative error of ``weight`` against the checkpoint's
            exact weight: 0 for a bf16 checkpoint, ``BF16_DEQUANT_ROUNDING``
            after an fp8 one (used by the tolerance).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.bfloat16, device=device),
            requires_grad=False,
        )
        self.weight_rounding = 0.0

    @property
    def scale_shape(self) -> tuple[int, int]:
        """Shape of the ``weight_scale_inv`` an fp8 checkpoint weight carries."""
        return (
            math.ceil(self.out_features / WEIGHT_BLOCK),
            math.ceil(self.in_features / WEIGHT_BLOCK),
        )

    @torch.no_grad()
    def load(
        self,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor | None = None,
        *,
        name: str = "weight",
    ) -> None:
        """Load a checkpoint weight: bf16, or float8_e4m3fn with its block scales.

        Args:
            weight: ``[out_features, in_features]`` bf16 or float8_e4m3fn, any device.
            weight_scale_inv: ``[ceil(out/128), ceil(in/128)]`` float32, required
                for (and only for) an fp8 weight.
            name: the tensor's name in error messages (``"wkv"`` in the layer).

        Raises:
            CheckpointError: naming the tensor, the expected and the found
                shape and dtype.
        """
        expected = (self.out_features, self.in_features)
        if not isinstance(weight, torch.Tensor):
            raise CheckpointError(
                f"{name} is a {type(weight).__name__}; expected a tensor {list(expected)}"
            )
        if weight.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise CheckpointError(
                f"{name} has {describe_tensor(weight)}; expected dtype torch.bfloat16 or "
                f"torch.float8_e4m3fn (with {name}_scale) of shape {list(expected)}"
            )
        if tuple(weight.shape) != expected:
            raise CheckpointError(
                f"{name} has {describe_tensor(weight)}; expected shape {list(expected)} "
                f"([out, in] = [(hc+1)*D, C*E])"
            )
        scale_name = f"{name}_scale"
        if weight.dtype == torch.bfloat16:
            if weight_scale_inv is not None:
                raise CheckpointError(
                    f"{scale_name} was given ({describe_tensor(weight_scale_inv)}) for a bf16 "
                    f"{name}; expected None (only float8_e4m3fn weights carry block scales)"
                )
            self.weight.copy_(weight)
            self.weight_rounding = 0.0
            return
        expected_scale = self.scale_shape
        if weight_scale_inv is None:
            raise CheckpointError(
                f"{scale_name} is missing for the float8_e4m3fn {name}; expected float32 "
                f"{list(expected_scale)} (weight_scale_inv, one scale per "
                f"{WEIGHT_BLOCK}x{WEIGHT_BLOCK} block)"
            )
        if not isinstance(weight_scale_inv, torch.Tensor) or (
            weight_scale_inv.dtype != torch.float32
            or tuple(weight_scale_inv.shape) != expected_scale
        ):
            found = (
                describe_tensor(weight_scale_inv)
                if isinstance(weight_scale_inv, torch.Tensor)
                else type(weight_scale_inv).__name__
            )
            raise CheckpointError(
                f"{scale_name} has {found}; expected dtype torch.float32 shape "
                f"{list(expected_scale)} (one scale per {WEIGHT_BLOCK}x{WEIGHT_BLOCK} block of "
                f"{name} {list(expected)})"
            )
        if not bool(torch.isfinite(weight_scale_inv).all()):
            bad = [int(i) for i in torch.nonzero(~torch.isfinite(weight_scale_inv))[0]]
            raise CheckpointError(
                f"{scale_name}{bad} = {weight_scale_inv[tuple(bad)].item()}; expected finite scales"
            )
        dequantize_block_fp8(weight, weight_scale_inv, self.weight)
        self.weight_rounding = BF16_DEQUANT_ROUNDING

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, in_features]`` bf16 -> ``[T, out_features]`` bf16 (into ``out`` when given).

        On CUDA one cuBLAS bf16 GEMM writes ``out`` directly (no allocation,
        capturable); elsewhere the fp32 reference runs.
        """
        if x.device.type == "cuda":
            if out is None:
                return torch.mm(x, self.weight.t())
            return torch.mm(x, self.weight.t(), out=out)
        result = torch.mm(x.float(), self.weight.float().t())
        if out is None:
            return result.to(torch.bfloat16)
        return out.copy_(result)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
