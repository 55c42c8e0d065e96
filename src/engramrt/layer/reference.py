"""The Engram layer in plain PyTorch: the definition the fast path must meet.

SPEC §8: ``rows [T, C, E]`` (bf16, from the table lookup) are flattened to
``[T, C*E]``, projected by ``wkv`` (no bias) to ``kv [T, (hc+1)*D]``, and
the gate (:func:`engramrt.gate.engram_gate_reference`) mixes the value into
the hidden streams.

``wkv`` is stored by DeepSeek checkpoints either as bf16 or as float8
e4m3fn with one fp32 scale per 128 x 128 block (``weight_scale_inv``,
``[ceil(out/128), ceil(in/128)]``; dequantised weight = fp8 value * scale).

Definitions here:

- :func:`dequantize_block_fp8_reference`: the dequantised weight, in fp32
  (what DeepSeek's ``weight_dequant`` computes before it stores bf16) or,
  with ``dtype=torch.float64``, exactly (a 4-bit e4m3 significand times a
  24-bit fp32 scale fits in float64's 53 bits).
- :func:`engram_linear_reference`: ``bf16(fp32(x) @ fp32(w).T)``, the
  projection with fp32 operands and fp32 accumulation.
- :func:`engram_layer_reference`: rows -> kv -> gate, returning ``(out, kv)``.

and the bounds an implementation must meet (:func:`linear_tolerance`,
:func:`assert_layer_within_tolerance`; the derivation is in the comment
above :func:`linear_tolerance`).
"""

from __future__ import annotations

import torch

from engramrt.gate.reference import (
    assert_within_tolerance,
    bound_by_token_chunks,
    engram_gate_reference,
    gate_tolerance,
    ulp_bf16,
)

__all__ = [
    "BF16_DEQUANT_ROUNDING",
    "WEIGHT_BLOCK",
    "assert_layer_within_tolerance",
    "dequantize_block_fp8_reference",
    "engram_layer_reference",
    "engram_linear_reference",
    "linear_exact",
    "linear_tolerance",
]

WEIGHT_BLOCK = 128
"""Rows and columns of a linear weight sharing one ``weight_scale_inv`` entry."""

_U32 = 2.0**-24  # fp32 unit roundoff
_U64 = 2.0**-53  # float64 unit roundoff
_UBF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)

BF16_DEQUANT_ROUNDING = _UBF16 + 2 * _U32
"""Relative error of a weight dequantised to bf16 the way :class:`~engramrt.layer.EngramLinear`
does it: ``bf16(fp32(fp8 * scale))`` rounds twice, ``|w_bf16 - w| <= (u_bf16 + u_32 + u_bf16 u_32) |w|``,
which ``u_bf16 + 2 u_32`` covers."""


def dequantize_block_fp8_reference(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``weight[o, i] * weight_scale_inv[o // 128, i // 128]`` in ``dtype``.

    Args:
        weight: ``[out, in]`` float8_e4m3fn.
        weight_scale_inv: ``[ceil(out/128), ceil(in/128)]`` float32, one
            scale per 128 x 128 block (partial blocks at the edges).
        dtype: float32 (one rounding of the product, as DeepSeek's
            ``weight_dequant``) or float64 (exact).

    Returns:
        ``[out, in]`` in ``dtype`` on ``weight``'s device.
    """
    out_features, in_features = weight.shape
    scale = weight_scale_inv.to(dtype)
    scale = scale.repeat_interleave(WEIGHT_BLOCK, dim=0)[:out_features]
    scale = scale.repeat_interleave(WEIGHT_BLOCK, dim=1)[:, :in_features]  # [out, in]
    return weight.to(dtype) * scale


def engram_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``bf16(x @ weight.T)`` with fp32 operands and fp32 accumulation.

    Args:
        x: ``[T, K]`` activations (bf16 rows in the layer).
        weight: ``[N, K]`` any float dtype (bf16 compute weight in the layer).

    Returns:
        ``[T, N]`` bf16.
    """
    return torch.mm(x.float(), weight.float().t()).to(torch.bfloat16)


def linear_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float64: exact products for bf16 ``x`` and a weight of
    at most 28 significant bits (bf16, or fp8 times an fp32 scale); the float64
    sum of K terms is within ``K u_64 sum|x w|`` of the real one."""
    return torch.mm(x.double(), weight.double().t())


# --------------------------------------------------------------------------
# How far an implementation of y = x W^T may be from the exact (float64) y.
#
# The implementation this bounds (EngramLinear on any device):
#   * x is bf16 and used as is (the rows are bf16 by SPEC §6);
#   * the compute weight is w' = w (1 + r_k) with |r_k| <= rho: rho = 0 for a
#     bf16 checkpoint weight, BF16_DEQUANT_ROUNDING for an fp8 weight
#     dequantised to bf16 once at load;
#   * products x_k w'_k are exact in fp32 (8 + 8 significant bits <= 24);
#   * the K products are summed in fp32 in any order (cuBLAS tiles, split-K,
#     CPU blocking). Each addition errs by at most 2 u_32 of its result even
#     when it truncates instead of rounding (tensor-core accumulators may), so
#     |sum' - sum(x w')| <= 2 (K - 1) u_32 sum|x w'| (first order; the (1 + ..)
#     of the second order is absorbed by the 1.01 below);
#   * the fp32 sum is rounded to bf16 to nearest: half a bf16 ulp of it.
# With S = sum_k |x_k w_k| and y the exact result:
#   e1 = rho S + 2 K u_32 (1 + rho) S          (weight rounding + accumulation)
#   |bf16(sum') - y| <= e1 + ulp_bf16(|y| + e1) / 2
# ulp_bf16 is taken at |y| + e1 >= |sum'|, an upper bound of the ulp of the
# value actually rounded. The float64 reference itself errs by at most
# K u_64 S, added so the bound holds against the computed reference.
#
# The bound is worst case: with random signs the accumulation error grows like
# sqrt(K) u_32 rather than K u_32. For D = 5120, C*E = 6144 and bf16 weights
# it is ~4% of a typical |y|; with rho = 2^-8 (fp8 weights) the rounding term
# rho S dominates (~20% of a typical |y|; the typical error is ~0.4%). It
# still catches structural mistakes (a transposed weight, a scale applied to
# the wrong 128 x 128 block, a dropped column), which change y by O(|y|) or more.
# --------------------------------------------------------------------------


def linear_tolerance(
    x: torch.Tensor,
    weight: torch.Tensor,
    expected: torch.Tensor,
    *,
    weight_rounding: float = 0.0,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Per-element bound ``[T, N]`` (float64) on ``|impl(x, weight) - expected|``.

    Args:
        x: ``[T, K]`` bf16 activations, as the implementation received them.
        weight: ``[N, K]`` the exact weight (bf16 checkpoint weight, or the
            float64 dequantised fp8 weight).
        expected: ``[T, N]`` float64 :func:`linear_exact` of ``x`` and ``weight``.
        weight_rounding: relative error of the implementation's compute
            weight against ``weight`` (0, or :data:`BF16_DEQUANT_ROUNDING`).
        chunk_tokens: tokens per piece of the ``|x| @ |w|^T`` product, to
            bound memory at benchmark sizes.

    The derivation is in the comment above this function.
    """
    depth = x.shape[1]
    rho = float(weight_rounding)
    magnitude_weight = weight.double().abs().t()  # [K, N]

    def chunk_bound(start: int, stop: int) -> torch.Tensor:
        magnitude = torch.mm(x[start:stop].double().abs(), magnitude_weight)  # S, [t, N]
        e1 = 1.01 * (rho + 2 * depth * _U32 * (1 + rho)) * magnitude + depth * _U64 * magnitude
        return e1 + 0.5 * ulp_bf16(expected[start:stop].abs() + e1)

    return bound_by_token_chunks(expected, chunk_tokens, chunk_bound)


def engram_layer_reference(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    wkv_weight: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer of SPEC §8 from looked-up rows.

    Args:
        hidden: ``[T, hc, D]`` hidden streams.
        rows: ``[T, C, E]`` bf16 rows (the lookup's output).
        wkv_weight: ``[(hc+1)*D, C*E]`` compute weight (bf16).
        q_weight, k_weight: ``[hc, D]``.
        eps: RMSNorm epsilon.
        token_mask: optional bool ``[T]`` (False: hidden passes through).

    Returns:
        ``(out [T, hc, D] bf16, kv [T, (hc+1)*D] bf16)``.
    """
    kv = engram_linear_reference(rows.flatten(1), wkv_weight)
    return engram_gate_reference(hidden, kv, q_weight, k_weight, eps, token_mask), kv


def assert_layer_within_tolerance(
    *,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    wkv_exact: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    weight_rounding: float = 0.0,
    truncating_store: bool = False,
    label: str = "layer",
) -> None:
    """Check one layer step stage by stage; raise listing the worst mismatches.

    Rather than push a kv error bound through the gate (whose slope
    ``1 / sqrt|dot|`` makes such a bound loose near ``dot = 0``), each stage
    is checked against the reference applied to that stage's *actual* input:

    1. ``kv`` within :func:`linear_tolerance` of the exact ``rows @ wkv_exact.T``;
    2. ``out`` within :func:`engramrt.gate.gate_tolerance` of
       ``engram_gate_reference(hidden, kv)``.

    Rows are checked by the caller (bit for bit against the lookup reference).
    Together the checks bound every stage of the step.
    """
    flat_rows = rows.flatten(1)
    exact = linear_exact(flat_rows, wkv_exact)
    kv_tolerance = linear_tolerance(flat_rows, wkv_exact, exact, weight_rounding=weight_rounding)
    assert_within_tolerance(kv, exact, kv_tolerance, label=f"{label} kv")
    expected = engram_gate_reference(hidden, kv, q_weight, k_weight, eps, token_mask)
    out_tolerance = gate_tolerance(
        hidden,
        kv,
        q_weight,
        k_weight,
        eps,
        expected,
        token_mask,
        truncating_store=truncating_store,
    )
    assert_within_tolerance(out, expected, out_tolerance, label=f"{label} out")
