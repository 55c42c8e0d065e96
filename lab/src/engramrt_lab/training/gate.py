"""The Engram gate (SPEC §8) as an autograd function with a written-out backward.

Forward, per token ``t`` and stream ``h`` (``x = hidden[t, h]``, key ``k`` and
shared value ``v`` from ``kv``, ``w = q_weight[h] * k_weight[h]``)::

    r_x = rsqrt(mean(x^2) + eps),  r_k = rsqrt(mean(k^2) + eps)
    dot = sum_d (x r_x) w (k r_k) / sqrt(D)
    s   = sign(dot) * sqrt(max(|dot|, 1e-6)),   g = sigmoid(s)
    out = x + g v                       (g = 0 for masked tokens)

Backward, with ``G = d loss / d out`` (zero on masked tokens for every term
but ``d hidden``'s pass-through)::

    d g   = sum_d G v,            d v = sum_h g G,     d x += G
    d dot = d g * g (1 - g) / (2 sqrt(|dot|))   where |dot| >= 1e-6, else 0
    a     = d dot / sqrt(D)
    d x_n = a w k_n,   d k_n = a w x_n,   d w = sum_t a x_n k_n
    d q_weight = d w * k_weight,  d k_weight = d w * q_weight
    RMSNorm: d x = r_x d x_n - x r_x^3 / D * sum_d (d x_n x)   (same for k)

Non-differentiable points, defined as torch's autograd of the reference
(:func:`engramrt.gate.reference.gate_values_reference`) defines them:
``sign`` has derivative 0 everywhere; ``|dot|`` has derivative ``sign(dot)``
(0 at ``dot = 0``); the clamp ``max(|dot|, 1e-6)`` passes the gradient where
``|dot| >= 1e-6`` (at the floor itself too) and blocks it below. Below the
floor the gate is the constant ``sigmoid(±1e-3)``, so its gradient is 0.

With ``slope_floor`` above ``1e-6`` (training only; the forward is unchanged),
the backward uses ``0.5 / sqrt(max(|dot|, slope_floor))`` for ``d s / d dot``:
the exact slope where ``|dot| >= slope_floor`` and at most
``0.5 / sqrt(slope_floor)`` below it, where the exact one grows to 500. A
token whose key and query are nearly orthogonal then cannot send one step's
gradient norm (and so the clipping of every dense gradient) through the gate.

Math is in fp32 for fp32/bf16/fp16 inputs (float64 inputs stay float64, for
gradcheck). The output is unrounded (the compute dtype), unlike the inference
gate's bf16 store; gradients come back in each input's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engramrt.errors import ValidationError, expect
from engramrt.gate.reference import MIN_ABS_DOT, GateInputs

__all__ = ["engram_gate_train", "rms_norm_backward"]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _rms_normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * r`` and ``r = rsqrt(mean(x^2) + eps)`` over the last dim (``r`` keeps it)."""
    inv_rms = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return x * inv_rms, inv_rms


def rms_norm_backward(
    x: torch.Tensor, inv_rms: torch.Tensor, grad_normed: torch.Tensor
) -> torch.Tensor:
    """Gradient wrt ``x [..., D]`` of ``x * rsqrt(mean(x^2) + eps)`` given the
    gradient ``grad_normed`` of the normed value; ``inv_rms [..., 1]``."""
    dim = x.shape[-1]
    projection = (grad_normed * x).sum(dim=-1, keepdim=True)  # [..., 1]
    return inv_rms * grad_normed - x * inv_rms.pow(3) * (projection / dim)


class _EngramGate(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        kv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        token_mask: torch.Tensor | None,
        slope_floor: float,
    ) -> torch.Tensor:
        num_tokens, hc, dim = hidden.shape
        dtype = _compute_dtype(hidden, kv, q_weight, k_weight)
        x = hidden.to(dtype)  # [T, hc, D]
        keys = kv[:, : hc * dim].to(dtype).reshape(num_tokens, hc, dim)  # [T, hc, D]
        value = kv[:, hc * dim :].to(dtype)  # [T, D]
        weight = q_weight.to(dtype) * k_weight.to(dtype)  # [hc, D]
        x_normed, x_inv_rms = _rms_normed(x, eps)
        keys_normed, k_inv_rms = _rms_normed(keys, eps)
        dot = (x_normed * weight * keys_normed).sum(dim=-1) / math.sqrt(dim)  # [T, hc]
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(MIN_ABS_DOT)))
        if token_mask is not None:
            gate = torch.where(token_mask.view(num_tokens, 1), gate, 0.0)
        out = x + gate.unsqueeze(-1) * value.unsqueeze(1)  # [T, hc, D]
        ctx.save_for_backward(
            x, keys, value, q_weight, k_weight, x_inv_rms, k_inv_rms, dot, gate, token_mask
        )
        ctx.input_dtypes = (hidden.dtype, kv.dtype, q_weight.dtype, k_weight.dtype)
        ctx.slope_floor = slope_floor
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x, keys, value, q_weight, k_weight, x_inv_rms, k_inv_rms, dot, gate, token_mask) = (
            ctx.saved_tensors
        )
        hidden_dtype, kv_dtype, q_dtype, k_dtype = ctx.input_dtypes
        num_tokens, hc, dim = x.shape
        dtype = x.dtype
        grad = grad_out.to(dtype)  # [T, hc, D]
        q_w = q_weight.to(dtype)
        k_w = k_weight.to(dtype)
        grad_hidden = grad.clone()  # the residual x passes straight through
        if token_mask is not None:
            grad = torch.where(token_mask.view(num_tokens, 1, 1), grad, 0.0)
        grad_value = (gate.unsqueeze(-1) * grad).sum(dim=1)  # [T, D]
        grad_gate = (grad * value.unsqueeze(1)).sum(dim=-1)  # [T, hc]
        abs_dot = dot.abs()
        # d s / d dot = sign(dot) * sign(dot) / (2 sqrt(|dot|)) (the outer sign's and
        # |dot|'s) where the clamp passes (|dot| >= floor, as torch's clamp_min
        # backward), else 0; dot != 0 there, so the two signs multiply to 1.
        # A slope floor above the clamp's bounds the slope below it (training only).
        slope = torch.where(
            abs_dot >= MIN_ABS_DOT,
            0.5 / torch.sqrt(abs_dot.clamp_min(max(ctx.slope_floor, MIN_ABS_DOT))),
            0.0,
        )
        grad_dot = grad_gate * gate * (1 - gate) * slope / math.sqrt(dim)  # [T, hc]
        x_normed = x * x_inv_rms
        keys_normed = keys * k_inv_rms
        weight = q_w * k_w  # [hc, D]
        scaled = grad_dot.unsqueeze(-1)  # [T, hc, 1]
        grad_x_normed = scaled * weight * keys_normed
        grad_keys_normed = scaled * weight * x_normed
        grad_weight = (scaled * x_normed * keys_normed).sum(dim=0)  # [hc, D]
        grad_hidden = grad_hidden + rms_norm_backward(x, x_inv_rms, grad_x_normed)
        grad_keys = rms_norm_backward(keys, k_inv_rms, grad_keys_normed)  # [T, hc, D]
        grad_kv = torch.cat([grad_keys.reshape(num_tokens, hc * dim), grad_value], dim=1)
        return (
            grad_hidden.to(hidden_dtype),
            grad_kv.to(kv_dtype),
            (grad_weight * k_w).to(q_dtype),
            (grad_weight * q_w).to(k_dtype),
            None,
            None,
            None,
        )


def engram_gate_train(inputs: GateInputs, *, slope_floor: float = MIN_ABS_DOT) -> torch.Tensor:
    """The gated residual ``x + g * value`` of SPEC §8, differentiable in
    ``hidden``, ``kv``, ``q_weight`` and ``k_weight``.

    Args:
        inputs: the operands (:class:`~engramrt.gate.GateInputs`), any float
            dtype: ``hidden`` ``[T, hc, D]``; ``kv`` ``[T, (hc + 1) * D]``,
            ``hc`` keys, one per stream, then the value; ``q_weight``,
            ``k_weight`` ``[hc, D]``; ``eps`` > 0; ``token_mask`` optional
            bool ``[T]``, False forces the token's gate to 0.
        slope_floor: ``|dot|`` below which the backward holds the slope of the gate's
            square root at ``0.5 / sqrt(slope_floor)`` (see the module docstring);
            the default, the clamp's ``1e-6``, is the exact gradient.

    Returns:
        ``[T, hc, D]`` in the compute dtype (fp32, or float64 for float64 inputs).
    """
    expect(
        isinstance(inputs, GateInputs),
        ValidationError,
        f"inputs must be a GateInputs, got {type(inputs).__name__}",
    )
    hidden, kv, q_weight, k_weight, eps, token_mask = inputs
    expect(
        hidden.dim() == 3 and hidden.is_floating_point(),
        ValidationError,
        f"hidden must be a [T, hc, D] float tensor, got shape {tuple(hidden.shape)} "
        f"dtype {hidden.dtype}",
    )
    num_tokens, hc, dim = hidden.shape
    expect(
        kv.is_floating_point() and tuple(kv.shape) == (num_tokens, (hc + 1) * dim),
        ValidationError,
        f"kv must be a float tensor of shape [T, (hc + 1) * D] = {(num_tokens, (hc + 1) * dim)}, "
        f"got shape {tuple(kv.shape)} dtype {kv.dtype}",
    )
    for name, tensor in (("q_weight", q_weight), ("k_weight", k_weight)):
        expect(
            tensor.is_floating_point() and tuple(tensor.shape) == (hc, dim),
            ValidationError,
            f"{name} must be a float tensor of shape [hc, D] = {(hc, dim)}, got shape "
            f"{tuple(tensor.shape)} dtype {tensor.dtype}",
        )
    expect(eps > 0, ValidationError, f"eps must be > 0, got {eps}")
    if token_mask is not None:
        expect(
            token_mask.dtype == torch.bool and tuple(token_mask.shape) == (num_tokens,),
            ValidationError,
            f"token_mask must be a bool tensor of shape [T] = ({num_tokens},), got shape "
            f"{tuple(token_mask.shape)} dtype {token_mask.dtype}",
        )
    expect(
        math.isfinite(slope_floor) and slope_floor >= MIN_ABS_DOT,
        ValidationError,
        f"slope_floor must be a finite number >= {MIN_ABS_DOT} (the clamp's floor), got "
        f"{slope_floor}",
    )
    # apply takes the fields one by one: autograd tracks only tensors passed directly.
    out: torch.Tensor = _EngramGate.apply(*inputs, slope_floor)
    return out
