"""The Engram gate in plain PyTorch: the definition the Triton kernel must meet.

SPEC §8, in fp32. For every token t and hidden stream h (of ``hc``), with
``x = hidden[t, h]``, key ``k = kv[t, h*D:(h+1)*D]`` (one key per stream) and
value ``v = kv[t, hc*D:]`` (shared by every stream)::

    dot  = sum_d (x * rsqrt(mean(x^2) + eps)) * q_w[h] * k_w[h] * (k * rsqrt(mean(k^2) + eps)) / sqrt(D)
    g    = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))
    out  = x + g * v                      (stored bf16)

A token whose ``token_mask`` entry is False has its gate forced to 0: its
output is its hidden state, unchanged bit for bit (rounded to bf16 when the
hidden state is wider). We write that as a select, not as ``x + 0 * v``,
because ``0 * inf`` is NaN and ``-0.0 + 0.0`` is ``+0.0``.

:class:`GateInputs` carries the operands as one value, in the order of
:func:`engram_gate_reference`'s parameters.

This module also holds the error bound an fp32 implementation must meet
against the reference (:func:`gate_tolerance`) and the comparison that
reports the worst mismatches (:func:`assert_within_tolerance`); the tests
and the benchmark check both use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "MIN_ABS_DOT",
    "GateInputs",
    "assert_within_tolerance",
    "bound_by_token_chunks",
    "engram_gate_reference",
    "gate_tolerance",
    "gate_values_reference",
    "ulp_bf16",
]

# The floor under |dot| before the square root: it keeps the gate's slope
# d g / d dot (which grows like 1 / sqrt|dot|) finite at dot = 0.
MIN_ABS_DOT = 1e-6


class GateInputs(NamedTuple):
    """The operands of one gate call (SPEC §8).

    :func:`engramrt.gate.engram_gate` (inference) and
    the lab's training gate (``engramrt_lab.training``) take it whole, check it once
    and hand it unchanged to the implementation they run. Its fields are
    :func:`engram_gate_reference`'s parameters in order, so
    ``engram_gate_reference(*inputs)`` is the definition of both.

    A NamedTuple rather than a frozen dataclass: serving builds one per layer
    and step, and a tuple is the cheaper of the two to build.

    Attributes:
        hidden: ``[T, hc, D]`` hidden streams.
        kv: ``[T, (hc + 1) * D]``: ``hc`` keys, one per stream, then the value.
        q_weight: ``[hc, D]`` per-stream RMSNorm weight of the hidden state.
        k_weight: ``[hc, D]`` per-stream RMSNorm weight of the key.
        eps: the RMSNorm epsilon (> 0).
        token_mask: optional bool ``[T]``; False forces the token's gate to 0
            so its hidden state passes through unchanged (padding).
    """

    hidden: torch.Tensor
    kv: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    token_mask: torch.Tensor | None = None


def gate_values_reference(
    hidden: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The gate ``g [T, hc]`` fp32 of SPEC §8 (before masking), in fp32.

    Shapes as in :func:`engram_gate_reference`.
    """
    num_tokens, hc, dim = hidden.shape
    x = hidden.float()  # [T, hc, D]
    keys = kv[:, : hc * dim].float().reshape(num_tokens, hc, dim)  # [T, hc, D]
    x_normed = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    keys_normed = keys * torch.rsqrt(keys.square().mean(dim=-1, keepdim=True) + eps)
    dot = (x_normed * q_weight.float() * k_weight.float() * keys_normed).sum(dim=-1)
    dot = dot / math.sqrt(dim)  # [T, hc]
    return torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(MIN_ABS_DOT)))


def engram_gate_reference(
    hidden: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated residual ``x + g * value`` of SPEC §8, computed in fp32.

    Args:
        hidden: ``[T, hc, D]`` hidden streams (any float dtype).
        kv: ``[T, (hc + 1) * D]``: ``hc`` keys, one per stream, then the value.
        q_weight, k_weight: ``[hc, D]`` per-stream RMSNorm weights.
        eps: the RMSNorm epsilon (> 0).
        token_mask: optional bool ``[T]``; False forces the token's gate to 0
            so its hidden state passes through unchanged.

    Returns:
        ``[T, hc, D]`` bf16. Inputs are assumed valid; :func:`engramrt.gate.engram_gate`
        checks them. A :class:`GateInputs` ``inputs`` is computed by
        ``engram_gate_reference(*inputs)``.
    """
    num_tokens, hc, dim = hidden.shape
    x = hidden.float()  # [T, hc, D]
    value = kv[:, hc * dim :].float()  # [T, D]
    gate = gate_values_reference(hidden, kv, q_weight, k_weight, eps)  # [T, hc]
    out = x + gate.unsqueeze(-1) * value.unsqueeze(1)  # [T, hc, D]
    if token_mask is not None:
        out = torch.where(token_mask.view(num_tokens, 1, 1), out, x)
    return out.to(torch.bfloat16)


# --------------------------------------------------------------------------
# How far an fp32 implementation may be from the reference.
#
# Both compute in fp32 (unit roundoff u = 2^-24) and differ only in the order
# of operations (summation order, where the RMS factors are applied, FMA) and
# in the accuracy of rsqrt / sqrt / exp / division (GPU approximations are
# within 2 ulp, i.e. 4u relative). Per token and stream, with
# A = sum_d |x_n * q_w * k_w * k_n| / sqrt(D) (so |dot| <= A):
#
# 1. dot. Each side sums D terms, each the result of at most 5 roundings (the
#    reference rounds x * rx, k * rk and three products), in some order:
#    error <= gamma_{D+4} * A ~ (D + 4) u A. Each RMS factor rsqrt(mean(.^2)+eps)
#    sums D positive squares, divides and adds eps (relative error (D + 2) u),
#    which the square root halves, plus 4u for rsqrt itself; two factors give
#    (D + 10) u relative; the final scaling by 1/sqrt(D) adds 4u. One side:
#    (2D + 18) u A; kernel against reference: delta = (4D + 36) u A, rounded up to
#    (4D + 40) u A to absorb second-order terms.
# 2. g = sigmoid(s), s = sign(dot) sqrt(max(|dot|, 1e-6)). If |dot| > delta both
#    sides have the sign of dot, and sqrt's slope on [|dot| - delta, inf) is at
#    most 1 / (2 sqrt(max(|dot| - delta, 1e-6))), so |ds| <= delta times that.
#    Otherwise the signs may differ and |ds| <= 2 sqrt(max(|dot| + delta, 1e-6)).
#    sqrt's own rounding adds 2 * 4u |s|. sigmoid's slope is at most 1/4, and
#    evaluating 1 / (1 + exp(-s)) costs each side (1.5 |s| + 8) u absolutely
#    (exp through exp2 amplifies the rounding of s * log2(e) by |s|):
#    |dg| <= |ds| / 4 + 2 (1.5 |s| + 8) u.
# 3. out = x + g v in fp32: |dg| |v| plus two roundings per side,
#    <= |dg| |v| + 4u (|x| + |v|)  (g <= 1).
# 4. bf16 store: |bf16(a) - bf16(b)| <= |a - b| + ulp(a)/2 + ulp(b)/2
#    <= |a - b| + ulp_bf16(max(|a|, |b|)): the fp32 values may straddle a
#    rounding boundary, so the results may differ by one bf16 ulp more.
#    Triton's CPU interpreter (3.6) stores bf16 by truncation (error below one
#    ulp instead of half), so there the term is 1.5 ulp (truncating_store=True).
# Masked tokens are a select of x on both sides: tolerance 0 (one ulp under a
# truncating store when hidden is wider than bf16).
# --------------------------------------------------------------------------

_U = 2.0**-24  # fp32 unit roundoff
_BF16_MIN_SUBNORMAL = 2.0**-133


def ulp_bf16(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at ``magnitude`` (>= 0), as float64."""
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(magnitude), exponent - 8)  # 8 significant bits
    return ulp.clamp_min(_BF16_MIN_SUBNORMAL)


def bound_by_token_chunks(
    like: torch.Tensor,
    chunk_tokens: int,
    chunk_bound: Callable[[int, int], torch.Tensor],
) -> torch.Tensor:
    """A float64 bound shaped like ``like`` (tokens first), built ``chunk_tokens``
    tokens at a time so that the float64 work of a tolerance stays small at
    benchmark sizes.

    ``chunk_bound(start, stop)`` is the bound of tokens ``[start, stop)``; no
    tokens give an empty bound on ``like``'s device.
    """
    num_tokens = like.shape[0]
    bounds = [
        chunk_bound(start, min(start + chunk_tokens, num_tokens))
        for start in range(0, num_tokens, chunk_tokens)
    ]
    if not bounds:
        return torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    return torch.cat(bounds)


def gate_tolerance(
    hidden: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    expected: torch.Tensor,
    token_mask: torch.Tensor | None = None,
    *,
    truncating_store: bool = False,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Per-element bound ``[T, hc, D]`` (float64) on |implementation - reference|.

    ``expected`` is the reference output (bf16). ``truncating_store`` says the
    implementation rounds fp32 to bf16 toward zero (Triton's interpreter)
    rather than to nearest. The derivation is in the comment above. Work is
    done in float64, ``chunk_tokens`` tokens at a time to bound memory at
    benchmark sizes.
    """
    store_ulps = 1.5 if truncating_store else 1.0
    masked_ulps = 1.0 if truncating_store and hidden.dtype != torch.bfloat16 else 0.0
    _, hc, dim = hidden.shape
    weight = q_weight.double() * k_weight.double()  # [hc, D]

    def chunk_bound(start: int, stop: int) -> torch.Tensor:
        x = hidden[start:stop].double()  # [t, hc, D]
        keys = kv[start:stop, : hc * dim].double().reshape(-1, hc, dim)
        value = kv[start:stop, hc * dim :].double().unsqueeze(1)  # [t, 1, D]
        x_n = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
        k_n = keys * torch.rsqrt(keys.square().mean(dim=-1, keepdim=True) + eps)
        terms = x_n * weight * k_n
        dot = terms.sum(dim=-1) / math.sqrt(dim)  # [t, hc]
        magnitude_bound = terms.abs().sum(dim=-1) / math.sqrt(dim)  # A

        # 1. dot
        delta = 1.01 * (4 * dim + 40) * _U * magnitude_bound
        # 2. gate
        abs_dot = dot.abs()
        same_sign_slope = 0.5 / torch.sqrt((abs_dot - delta).clamp_min(MIN_ABS_DOT))
        flip_bound = 2.0 * torch.sqrt((abs_dot + delta).clamp_min(MIN_ABS_DOT))
        d_inner = torch.where(abs_dot > delta, delta * same_sign_slope, flip_bound)
        inner = torch.sqrt(abs_dot.clamp_min(MIN_ABS_DOT))  # |s|
        d_inner = d_inner + 8 * _U * inner
        d_gate = d_inner / 4 + 2 * (1.5 * inner + 8) * _U  # [t, hc]
        # 3. out in fp32
        d_out = d_gate.unsqueeze(-1) * value.abs() + 4 * _U * (x.abs() + value.abs())
        # 4. bf16 rounding of both sides
        ref = expected[start:stop].double().abs()
        larger = ref * (1 + 2.0**-8) + d_out
        bound = d_out + store_ulps * ulp_bf16(larger)
        if token_mask is not None:
            keep = token_mask[start:stop].view(-1, 1, 1)
            bound = torch.where(keep, bound, masked_ulps * ulp_bf16(x.abs()))
        return bound

    return bound_by_token_chunks(hidden, chunk_tokens, chunk_bound)


def assert_within_tolerance(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerance: torch.Tensor,
    *,
    label: str = "actual",
    show: int = 8,
) -> None:
    """Raise ``AssertionError`` listing the worst mismatches when any element
    of ``actual`` is farther than ``tolerance`` from ``expected`` (NaN counts
    as a mismatch)."""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{label} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    error = (actual.double() - expected.double()).abs()
    bad = ~(error <= tolerance)  # NaN compares False, so it is caught here
    if not bool(bad.any()):
        return
    excess = torch.where(bad, (error - tolerance).nan_to_num(nan=math.inf), -math.inf)
    worst = torch.topk(excess.flatten(), k=min(show, int(bad.sum()))).indices
    lines = [
        f"{int(bad.sum())} of {actual.numel()} elements of {label} are outside the derived "
        f"tolerance; worst:"
    ]
    for flat in worst.tolist():
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))
        lines.append(
            f"  {index}: {label}={actual[index].item()!r} reference={expected[index].item()!r} "
            f"|diff|={error[index].item():.3g} tolerance={tolerance[index].item():.3g}"
        )
    raise AssertionError("\n".join(lines))
