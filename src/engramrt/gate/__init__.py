"""The Engram gate: ``out = x + g * value`` with a per-stream RMS-normalised dot gate.

:func:`engram_gate` is the stable entry point: it takes the operands as one
:class:`GateInputs`, checks them (when asked), picks the Triton kernel
(:mod:`.kernel`) or the PyTorch reference (:mod:`.reference`) and writes a
bf16 ``[T, hc, D]`` result. The kernel module, and with it Triton, is
imported only when the kernel runs.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from engramrt._backend import resolve_backend
from engramrt.errors import ValidationError, describe_tensor
from engramrt.gate.reference import (
    GateInputs,
    assert_within_tolerance,
    engram_gate_reference,
    gate_tolerance,
    gate_values_reference,
)

__all__ = [
    "GateInputs",
    "assert_within_tolerance",
    "engram_gate",
    "engram_gate_reference",
    "gate_tolerance",
    "gate_values_reference",
]

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT32_MAX = 2**31 - 1


def engram_gate(
    inputs: GateInputs,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Gate the Engram value into each hidden stream (SPEC §8).

    For token t and stream h, with ``x = hidden[t, h]``, key
    ``k = kv[t, h*D:(h+1)*D]`` and value ``v = kv[t, hc*D:]`` (one value
    shared by all streams), in fp32::

        dot = sum_d rms(x) * q_weight[h] * k_weight[h] * rms(k) / sqrt(D)
        g   = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))
        out = x + g * v

    where ``rms(y) = y * rsqrt(mean(y^2) + eps)``.

    Args:
        inputs: the operands (:class:`GateInputs`): ``hidden`` ``[T, hc, D]``
            bf16 (fp16 and fp32 accepted); ``kv`` ``[T, (hc + 1) * D]``, same
            dtype family, ``hc`` keys then the value; ``q_weight``,
            ``k_weight`` ``[hc, D]`` RMSNorm weights, any float dtype; ``eps``
            a positive float; ``token_mask`` optional bool ``[T]``. **False
            forces that token's gate to 0, so its hidden state passes through
            unchanged** (bit for bit for bf16 ``hidden``; rounded to bf16
            otherwise). Use it for padding.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see
            :mod:`engramrt._backend`).
        out: optional preallocated ``[T, hc, D]`` bf16 result (a fixed
            address for CUDA graphs); returned when given.
        validate: check shapes, dtypes, devices, contiguity and ``eps`` on the
            host (never reading device memory). Pass False on a hot path
            whose inputs are known good.

    Returns:
        ``[T, hc, D]`` bf16. ``T = 0`` returns an empty tensor without a launch.
    """
    if validate:
        _validate(inputs, out)
    implementation = resolve_backend(backend, inputs.hidden.device)
    if implementation == "triton":
        from engramrt.gate.kernel import engram_gate_triton

        return engram_gate_triton(inputs, out)
    result = engram_gate_reference(*inputs)
    if out is None:
        return result
    return out.copy_(result)


def _validate(inputs: GateInputs, out: torch.Tensor | None) -> None:
    """Host-side checks only: shapes, dtypes, devices, strides and eps."""
    if not isinstance(inputs, GateInputs):
        raise ValidationError(f"inputs is a {type(inputs).__name__}, expected a GateInputs")
    hidden, kv, q_weight, k_weight, eps, token_mask = inputs
    for name, tensor in (
        ("hidden", hidden),
        ("kv", kv),
        ("q_weight", q_weight),
        ("k_weight", k_weight),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"{name} is a {type(tensor).__name__}, expected a torch.Tensor")
    if hidden.dim() != 3:
        raise ValidationError(
            f"hidden has {describe_tensor(hidden, device=True)}, expected 3 dimensions [T, hc, D]"
        )
    num_tokens, hc, dim = hidden.shape
    if hc < 1 or dim < 1:
        raise ValidationError(
            f"hidden has {describe_tensor(hidden, device=True)}, expected hc >= 1 and D >= 1"
        )
    if hidden.dtype not in _ACTIVATION_DTYPES:
        raise ValidationError(f"hidden has dtype {hidden.dtype}, expected bf16, fp16 or fp32")
    if kv.dtype not in _ACTIVATION_DTYPES:
        raise ValidationError(f"kv has dtype {kv.dtype}, expected bf16, fp16 or fp32")
    kv_width = (hc + 1) * dim
    if tuple(kv.shape) != (num_tokens, kv_width):
        raise ValidationError(
            f"kv has {describe_tensor(kv, device=True)}, expected [T, (hc + 1) * D] = "
            f"[{num_tokens}, {kv_width}] "
            f"for hidden of shape {tuple(hidden.shape)}"
        )
    if kv_width > _INT32_MAX:
        raise ValidationError(
            f"kv rows are {kv_width} elements wide, expected at most {_INT32_MAX}"
        )
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (hc, dim):
            raise ValidationError(
                f"{name} has {describe_tensor(weight, device=True)}, expected [hc, D] = "
                f"[{hc}, {dim}] "
                f"for hidden of shape {tuple(hidden.shape)}"
            )
        if not weight.is_floating_point():
            raise ValidationError(f"{name} has dtype {weight.dtype}, expected a float dtype")
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise ValidationError(f"eps is {eps!r} ({type(eps).__name__}), expected a positive float")
    # rsqrt on the GPU flushes subnormals to zero, so eps must be a normal fp32.
    if not (math.isfinite(eps) and eps >= torch.finfo(torch.float32).tiny):
        raise ValidationError(
            f"eps is {eps!r}, expected a finite float >= {torch.finfo(torch.float32).tiny:.3g} (> 0)"
        )
    tensors = [("hidden", hidden), ("kv", kv), ("q_weight", q_weight), ("k_weight", k_weight)]
    if token_mask is not None:
        if not isinstance(token_mask, torch.Tensor):
            raise ValidationError(
                f"token_mask is a {type(token_mask).__name__}, expected a bool tensor [T]"
            )
        if token_mask.dtype != torch.bool or tuple(token_mask.shape) != (num_tokens,):
            raise ValidationError(
                f"token_mask has {describe_tensor(token_mask, device=True)}, expected bool [T] = "
                f"[{num_tokens}]"
            )
        tensors.append(("token_mask", token_mask))
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValidationError(f"out is a {type(out).__name__}, expected a bf16 tensor")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, hc, dim):
            raise ValidationError(
                f"out has {describe_tensor(out, device=True)}, expected bf16 [T, hc, D] = "
                f"[{num_tokens}, {hc}, {dim}]"
            )
        tensors.append(("out", out))
    for name, tensor in tensors:
        if tensor.device != hidden.device:
            raise ValidationError(
                f"{name} is on device {tensor.device}, expected {hidden.device} (the device of hidden)"
            )
        if not tensor.is_contiguous():
            raise ValidationError(
                f"{name} has strides {tensor.stride()} for {describe_tensor(tensor, device=True)}, "
                "expected a contiguous tensor"
            )
