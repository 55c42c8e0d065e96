"""The gate's written-out backward against torch autograd of the reference."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.gate.reference import (
    GateInputs,
    assert_within_tolerance,
    engram_gate_reference,
    gate_tolerance,
    gate_values_reference,
)
from engramrt_lab.training import engram_gate_train
from engramrt_lab.training import gate as gate_module

EPS = 1e-6


def _dot_and_value(hidden, kv, q_weight, k_weight, eps):
    """SPEC §8's ``dot [T, hc]`` and the value ``[T, D]``, in the inputs' dtype."""
    num_tokens, hc, dim = hidden.shape
    keys = kv[:, : hc * dim].reshape(num_tokens, hc, dim)
    x_n = hidden * torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    k_n = keys * torch.rsqrt(keys.square().mean(dim=-1, keepdim=True) + eps)
    dot = (x_n * q_weight * k_weight * k_n).sum(dim=-1) / math.sqrt(dim)
    return dot, kv[:, hc * dim :]


def _reference_float64(hidden, kv, q_weight, k_weight, eps, token_mask=None):
    """SPEC §8 transcribed in the inputs' dtype (float64 here), for autograd."""
    num_tokens = hidden.shape[0]
    dot, value = _dot_and_value(hidden, kv, q_weight, k_weight, eps)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    out = hidden + gate.unsqueeze(-1) * value.unsqueeze(1)
    if token_mask is not None:
        out = torch.where(token_mask.view(num_tokens, 1, 1), out, hidden)
    return out


def _inputs(num_tokens, hc, dim, dtype, seed, min_abs_dot=1e-2):
    """Random inputs whose every |dot| is at least ``min_abs_dot`` (away from the clamp)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(100):
        hidden = torch.randn(num_tokens, hc, dim, generator=generator, dtype=dtype)
        kv = torch.randn(num_tokens, (hc + 1) * dim, generator=generator, dtype=dtype)
        q_weight = 1 + 0.5 * torch.randn(hc, dim, generator=generator, dtype=dtype)
        k_weight = 1 + 0.5 * torch.randn(hc, dim, generator=generator, dtype=dtype)
        dots = _dots(hidden, kv, q_weight, k_weight)
        if bool((dots.abs() >= min_abs_dot).all()):
            return [t.requires_grad_() for t in (hidden, kv, q_weight, k_weight)]
    raise AssertionError("no input away from the clamp was drawn")


def _dots(hidden, kv, q_weight, k_weight):
    with torch.no_grad():
        return _dot_and_value(hidden, kv, q_weight, k_weight, EPS)[0]


def _grads(fn, inputs, grad_out):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize(("num_tokens", "hc", "dim"), [(3, 2, 8), (1, 1, 5), (4, 3, 7)])
def test_gradcheck_float64(num_tokens, hc, dim):
    inputs = _inputs(num_tokens, hc, dim, torch.float64, seed=num_tokens * 100 + dim)
    assert torch.autograd.gradcheck(
        lambda h, kv, q, k: engram_gate_train(GateInputs(h, kv, q, k, EPS)),
        inputs,
        eps=1e-6,
        atol=1e-7,
    )


def test_gradcheck_with_token_mask():
    inputs = _inputs(4, 2, 6, torch.float64, seed=7)
    mask = torch.tensor([True, False, True, False])
    assert torch.autograd.gradcheck(
        lambda h, kv, q, k: engram_gate_train(GateInputs(h, kv, q, k, EPS, mask)),
        inputs,
        eps=1e-6,
        atol=1e-7,
    )
    grad_out = torch.randn(4, 2, 6, dtype=torch.float64)
    ours = _grads(lambda *a: engram_gate_train(GateInputs(*a, EPS, mask)), inputs, grad_out)
    expected = _grads(lambda *a: _reference_float64(*a, EPS, mask), inputs, grad_out)
    for name, a, b in zip(("hidden", "kv", "q_weight", "k_weight"), ours, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    # A masked token's hidden gradient is the output gradient, bit for bit.
    assert torch.equal(ours[0][~mask], grad_out[~mask])


def _scale_at(inputs, target_dots):
    """Rescale q_weight per stream so token 0's dots equal ``target_dots [hc]``
    (up to rounding); the other tokens' dots scale by the same factor."""
    hidden, kv, q_weight, k_weight = (t.detach() for t in inputs)
    dots = _dots(hidden, kv, q_weight, k_weight)[0]  # [hc]
    q_weight = q_weight * (target_dots / dots).unsqueeze(-1)
    return [t.clone().requires_grad_() for t in (hidden, kv, q_weight, k_weight)]


@pytest.mark.parametrize(
    "target", [0.0, 3e-7, -5e-7, 2e-6, -4e-6, 1e-3], ids=lambda v: f"dot={v:g}"
)
def test_at_and_near_the_clamp_matches_reference_autograd(target):
    inputs = _inputs(1, 2, 8, torch.float64, seed=11)
    inputs = _scale_at(inputs, torch.tensor([target, -target], dtype=torch.float64))
    dots = _dots(*inputs)[0]
    torch.testing.assert_close(dots.abs(), torch.full_like(dots, abs(target)), rtol=1e-9, atol=0)
    grad_out = torch.randn(1, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ours = _grads(lambda *a: engram_gate_train(GateInputs(*a, EPS)), inputs, grad_out)
    expected = _grads(lambda *a: _reference_float64(*a, EPS), inputs, grad_out)
    for name, a, b in zip(("hidden", "kv", "q_weight", "k_weight"), ours, expected, strict=True):
        # float64 with a 1/sqrt(|dot|) slope up to 500: differences are rounding only.
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    # Above the floor the weights get a gradient; below it (the gate constant) none.
    assert bool(expected[2].abs().sum() > 0) == (abs(target) >= 1e-6)


def test_below_floor_gate_has_no_slope():
    inputs = _inputs(1, 2, 8, torch.float64, seed=5)
    inputs = _scale_at(inputs, torch.tensor([1e-7, 0.0], dtype=torch.float64))
    grad_out = torch.randn(1, 2, 8, dtype=torch.float64)
    _, grad_kv, grad_q, grad_k = _grads(
        lambda *a: engram_gate_train(GateInputs(*a, EPS)), inputs, grad_out
    )
    assert torch.equal(grad_q, torch.zeros_like(grad_q))
    assert torch.equal(grad_k, torch.zeros_like(grad_k))
    assert torch.equal(grad_kv[:, :16], torch.zeros_like(grad_kv[:, :16]))  # keys
    assert grad_kv[:, 16:].abs().sum() > 0  # the value still gets g * grad


def test_fp32_matches_autograd_of_engramrt_reference():
    """fp32 forward and backward against torch autograd of gate_values_reference."""
    num_tokens, hc, dim = 5, 2, 32
    inputs = _inputs(num_tokens, hc, dim, torch.float32, seed=21)
    grad_out = torch.randn(num_tokens, hc, dim)

    def reference(hidden, kv, q_weight, k_weight):
        gate = gate_values_reference(hidden, kv, q_weight, k_weight, EPS)
        return hidden + gate.unsqueeze(-1) * kv[:, hc * dim :].unsqueeze(1)

    out = engram_gate_train(GateInputs(*inputs, EPS))
    expected_bf16 = engram_gate_reference(*(t.detach() for t in inputs), EPS)
    tolerance = gate_tolerance(*(t.detach() for t in inputs), EPS, expected_bf16)
    assert_within_tolerance(out.detach().to(torch.bfloat16), expected_bf16, tolerance)

    ours = _grads(lambda *a: engram_gate_train(GateInputs(*a, EPS)), inputs, grad_out)
    expected = _grads(reference, inputs, grad_out)
    for name, a, b in zip(("hidden", "kv", "q_weight", "k_weight"), ours, expected, strict=True):
        # fp32, |dot| >= 1e-2: both sides reorder O(D) roundings of terms bounded by
        # the gradient's scale; 1e-4 relative leaves room for the 1/sqrt(|dot|) slope.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_bf16_inputs_get_bf16_gradients():
    inputs = [t.detach().bfloat16().requires_grad_() for t in _inputs(2, 2, 16, torch.float32, 9)]
    out = engram_gate_train(GateInputs(*inputs, EPS))
    assert out.dtype == torch.float32
    out.sum().backward()
    for tensor in inputs:
        assert tensor.grad is not None and tensor.grad.dtype == torch.bfloat16


def test_wrong_backward_is_caught(monkeypatch):
    """Negative control: a 1% error in the RMSNorm backward fails both checks."""
    inputs = _inputs(3, 2, 8, torch.float64, seed=300 + 8)
    right = gate_module.rms_norm_backward
    monkeypatch.setattr(gate_module, "rms_norm_backward", lambda x, r, g: 1.01 * right(x, r, g))
    assert not torch.autograd.gradcheck(
        lambda h, kv, q, k: engram_gate_train(GateInputs(h, kv, q, k, EPS)),
        inputs,
        eps=1e-6,
        atol=1e-7,
        raise_exception=False,
    )
    grad_out = torch.randn(3, 2, 8, dtype=torch.float64)
    ours = _grads(lambda *a: engram_gate_train(GateInputs(*a, EPS)), inputs, grad_out)
    expected = _grads(lambda *a: _reference_float64(*a, EPS), inputs, grad_out)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours[0], expected[0], rtol=1e-9, atol=1e-9)


def test_wrong_clamp_rule_is_caught(monkeypatch):
    """Negative control: letting the gradient through below the floor differs from
    the reference's autograd at |dot| < 1e-6."""
    inputs = _inputs(1, 2, 8, torch.float64, seed=5)
    inputs = _scale_at(inputs, torch.tensor([3e-7, -3e-7], dtype=torch.float64))
    monkeypatch.setattr(gate_module, "MIN_ABS_DOT", 0.0)
    grad_out = torch.randn(1, 2, 8, dtype=torch.float64)
    ours = _grads(lambda *a: engram_gate_train(GateInputs(*a, EPS)), inputs, grad_out)
    expected = _grads(lambda *a: _reference_float64(*a, EPS), inputs, grad_out)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours[2], expected[2], rtol=1e-9, atol=1e-9)


def test_bad_inputs_are_refused():
    hidden, kv, q_weight, k_weight = (t.detach() for t in _inputs(2, 2, 4, torch.float32, 1))
    with pytest.raises(ValidationError, match=r"kv must be .* \(2, 12\)"):
        engram_gate_train(GateInputs(hidden, kv[:, :10], q_weight, k_weight, EPS))
    with pytest.raises(ValidationError, match="k_weight"):
        engram_gate_train(GateInputs(hidden, kv, q_weight, k_weight[:1], EPS))
    with pytest.raises(ValidationError, match="eps must be > 0, got 0"):
        engram_gate_train(GateInputs(hidden, kv, q_weight, k_weight, 0.0))
    with pytest.raises(ValidationError, match="inputs must be a GateInputs, got tuple"):
        engram_gate_train((hidden, kv, q_weight, k_weight, EPS))
    with pytest.raises(ValidationError, match="token_mask"):
        engram_gate_train(
            GateInputs(hidden, kv, q_weight, k_weight, EPS, torch.ones(2, dtype=torch.int64))
        )


def _reference_slope_floor(hidden, kv, q_weight, k_weight, eps, floor):
    """The reference's forward with the backward slope of sign(dot) sqrt(|dot|) held at
    0.5 / sqrt(floor) below |dot| = floor (straight-through: the value is the reference's,
    the gradient a linear branch's below the floor), float64, for autograd."""
    dot, value = _dot_and_value(hidden, kv, q_weight, k_weight, eps)
    exact = torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6))
    surrogate = torch.where(
        dot.abs() >= floor,
        torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(floor)),
        dot / (2 * math.sqrt(floor)),
    )
    s = exact.detach() + surrogate - surrogate.detach()
    return hidden + torch.sigmoid(s).unsqueeze(-1) * value.unsqueeze(1)


def test_slope_floor_bounds_the_backward_and_keeps_the_forward():
    """slope_floor: the forward is the reference's bit for bit; the gradients equal
    autograd of a straight-through reference whose slope is held at 0.5 / sqrt(floor)
    below the floor. Control: a floor of 0.3 puts some of these tokens below it, and
    there the exact backward (the default floor) differs."""
    floor = 0.3
    inputs = _inputs(12, 3, 8, torch.float64, seed=11, min_abs_dot=1e-3)
    dots = _dots(*inputs)
    assert bool((dots.abs() < floor).any()) and bool((dots.abs() >= floor).any())
    grad_out = torch.randn(
        12, 3, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )

    def train(floor_):
        return lambda h, kv, q, k: engram_gate_train(
            GateInputs(h, kv, q, k, EPS), slope_floor=floor_
        )

    with torch.no_grad():
        assert torch.equal(train(floor)(*inputs), train(1e-6)(*inputs))
    got = _grads(train(floor), inputs, grad_out)
    want = _grads(lambda *a: _reference_slope_floor(*a, EPS, floor), inputs, grad_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    exact = _grads(train(1e-6), inputs, grad_out)
    assert not torch.allclose(got[1], exact[1])


@pytest.mark.parametrize("floor", [0.0, 1e-7, float("nan"), float("inf")])
def test_slope_floor_below_the_clamp_is_refused(floor):
    inputs = _inputs(2, 1, 4, torch.float64, seed=1)
    with pytest.raises(
        ValidationError, match=f"slope_floor must be a finite number >= 1e-06.*got {floor}"
    ):
        engram_gate_train(GateInputs(*inputs, EPS), slope_floor=floor)
