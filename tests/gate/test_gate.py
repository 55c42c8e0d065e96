"""The fused Engram gate: kernel against reference, reference against float64.

On machines without a GPU the kernel runs through Triton's CPU interpreter
(small shapes); on a GPU the same tests run on the device.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from tests.helpers import DEVICE

from engramrt._backend import interpreter_enabled
from engramrt.errors import ValidationError
from engramrt.gate import (
    GateInputs,
    assert_within_tolerance,
    engram_gate,
    engram_gate_reference,
    gate_tolerance,
)
from engramrt.gate.kernel import GateKernelConfig, default_gate_config, engram_gate_triton

EPS = 1e-6

# ---------------------------------------------------------------------------
# Tolerance between the kernel and the reference (gate_tolerance), derived
# from the arithmetic; u = 2^-24, A = sum_d |x_n q_w k_w k_n| / sqrt(D) >= |dot|.
#  dot: both sides sum D terms of <= 5 roundings each in different orders
#       (gamma_{D+4} A each) and apply two RMS factors whose mean of squares
#       has relative error (D + 2) u, halved by the square root, + 4u for an
#       approximate rsqrt, + 4u for the final 1/sqrt(D) scaling:
#       |d dot| <= delta = (4D + 40) u A  (relative error of dot <= delta / |dot|).
#  g:   s = sign(dot) sqrt(max(|dot|, 1e-6)). With |dot| > delta the signs agree
#       and |ds| <= delta / (2 sqrt(max(|dot| - delta, 1e-6))); otherwise
#       |ds| <= 2 sqrt(max(|dot| + delta, 1e-6)). sigmoid' <= 1/4, so
#       |dg| <= |ds| / 4 + (sqrt and sigmoid rounding: 8u|s| + 2(1.5|s| + 8)u).
#  out: |dg| |v| + 4u (|x| + |v|) in fp32 (two roundings per side, g <= 1).
#  bf16: the two fp32 results may straddle a rounding boundary, so the stored
#       values differ by at most one more bf16 ulp of the result (1.5 ulp when
#       one side truncates, as Triton's CPU interpreter does).
#  Masked tokens: both sides select x, so 0 (bit for bit).
# ---------------------------------------------------------------------------
TRUNCATING_STORE = DEVICE.type == "cpu" and interpreter_enabled()


def make_inputs(
    num_tokens: int,
    hc: int,
    dim: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    weight_dtype: torch.dtype = torch.bfloat16,
    masked: bool = False,
) -> dict:
    """Fresh random inputs (never zeros): hidden and kv of varied scale,
    weights near 1 like trained RMSNorm weights, about 1 token in 3 masked."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hc, dim, generator=gen) * 2.0 + 0.1
    kv = torch.randn(num_tokens, (hc + 1) * dim, generator=gen) * 1.5
    q_weight = 1.0 + 0.3 * torch.randn(hc, dim, generator=gen)
    k_weight = 1.0 + 0.3 * torch.randn(hc, dim, generator=gen)
    token_mask = torch.rand(num_tokens, generator=gen) > 0.35 if masked else None
    inputs = {
        "hidden": hidden.to(dtype),
        "kv": kv.to(dtype),
        "q_weight": q_weight.to(weight_dtype),
        "k_weight": k_weight.to(weight_dtype),
        "eps": EPS,
        "token_mask": token_mask,
    }
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def poisoned_out(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=torch.bfloat16, device=like.device)


def check_against_reference(actual: torch.Tensor, inputs: dict, label: str = "kernel") -> None:
    expected = engram_gate_reference(**inputs)
    tolerance = gate_tolerance(**inputs, expected=expected, truncating_store=TRUNCATING_STORE)
    assert_within_tolerance(actual, expected, tolerance, label=label)


# --- kernel against reference ------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dim", [33, 64, 100, 128])
@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 17])
def test_kernel_matches_reference(num_tokens: int, hc: int, dim: int, masked: bool) -> None:
    inputs = make_inputs(
        num_tokens, hc, dim, seed=num_tokens * 1000 + hc * 100 + dim, masked=masked
    )
    out = poisoned_out(inputs["hidden"])
    result = engram_gate(GateInputs(**inputs), backend="triton", out=out)
    assert result.data_ptr() == out.data_ptr()
    assert result.shape == (num_tokens, hc, dim) and result.dtype == torch.bfloat16
    check_against_reference(result, inputs)


@pytest.mark.parametrize(
    ("num_tokens", "hc", "dim", "config"),
    [
        # several chunks with a partial last one (D=100 in chunks of 32, 16): the
        # reverse second pass and the D tail mask
        (17, 4, 100, GateKernelConfig(block_d=32, num_warps=1)),
        (5, 3, 33, GateKernelConfig(block_d=16, num_warps=2)),
        # one program per token instead of the persistent loop
        (5, 2, 64, GateKernelConfig(block_d=64, num_warps=1, programs_per_sm=None)),
        # chunk wider than D, hc not a power of two
        (5, 3, 100, GateKernelConfig(block_d=256, num_warps=4, programs_per_sm=3)),
    ],
)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_kernel_configs(
    num_tokens: int, hc: int, dim: int, config: GateKernelConfig, masked: bool
) -> None:
    inputs = make_inputs(num_tokens, hc, dim, seed=7 + dim, masked=masked)
    out = poisoned_out(inputs["hidden"])
    engram_gate_triton(GateInputs(**inputs), out=out, config=config)
    check_against_reference(out, inputs)


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float64),
    ],
)
def test_kernel_accepts_wider_dtypes(dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    inputs = make_inputs(5, 2, 100, seed=11, dtype=dtype, weight_dtype=weight_dtype, masked=True)
    result = engram_gate(GateInputs(**inputs), backend="triton")
    assert result.dtype == torch.bfloat16
    check_against_reference(result, inputs)


def test_zero_dot_gives_half_gate() -> None:
    # A zero key gives dot = 0 exactly, so sign(dot) = 0 and g = sigmoid(0) = 1/2.
    inputs = make_inputs(3, 2, 64, seed=5)
    inputs["kv"][:, :64] = 0
    result = engram_gate(GateInputs(**inputs), backend="triton")
    check_against_reference(result, inputs)
    value = inputs["kv"][:, 2 * 64 :].float()
    expected_stream0 = (inputs["hidden"][:, 0].float() + 0.5 * value).bfloat16()
    torch.testing.assert_close(result[:, 0], expected_stream0, atol=0, rtol=2**-7)


def test_empty_batch_returns_without_launch() -> None:
    inputs = make_inputs(0, 4, 64, seed=1)
    result = engram_gate(GateInputs(**inputs), backend="triton")
    assert result.shape == (0, 4, 64) and result.dtype == torch.bfloat16
    out = poisoned_out(inputs["hidden"])
    assert engram_gate(GateInputs(**inputs), backend="triton", out=out) is out
    # Nothing written around the empty output; one token (the control) is written there.
    buffer = torch.full((2, 4, 64), float("nan"), dtype=torch.bfloat16, device=out.device)
    engram_gate(GateInputs(**inputs), backend="triton", out=buffer[:0])
    assert bool(buffer.isnan().all())
    one = make_inputs(1, 4, 64, seed=2)
    engram_gate(GateInputs(**one), backend="triton", out=buffer[:1])
    check_against_reference(buffer[:1], one)
    assert bool(buffer[1].isnan().all())


def test_fresh_output_and_reference_backend() -> None:
    inputs = make_inputs(5, 2, 33, seed=3, masked=True)
    fresh = engram_gate(GateInputs(**inputs), backend="triton")
    check_against_reference(fresh, inputs)
    out = poisoned_out(inputs["hidden"])
    through_reference = engram_gate(GateInputs(**inputs), backend="reference", out=out)
    assert through_reference is out
    assert torch.equal(out, engram_gate_reference(**inputs))


# --- masked tokens ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_masked_tokens_pass_through_bit_for_bit(backend: str) -> None:
    inputs = make_inputs(17, 4, 100, seed=21, masked=True)
    mask = inputs["token_mask"]
    assert mask.any() and not mask.all()
    # Values that x + 0 * v would not preserve: -0.0 in hidden, inf in the value.
    dropped = (~mask).nonzero().flatten()
    inputs["hidden"][dropped[0], 0, :5] = -0.0
    inputs["kv"][dropped[0], 4 * 100 :] = float("inf")
    result = engram_gate(GateInputs(**inputs), backend=backend, out=poisoned_out(inputs["hidden"]))
    kept_bits = result[~mask].view(torch.int16)
    assert torch.equal(kept_bits, inputs["hidden"][~mask].view(torch.int16))
    # and the gate did act on the others
    assert not torch.equal(result[mask], inputs["hidden"][mask])


# --- reference against an independent float64 computation ----------------


def gate_float64(hidden, kv, q_weight, k_weight, eps, token_mask=None) -> torch.Tensor:
    """SPEC §8 written out per stream in float64, without the reference's code."""
    num_tokens, hc, dim = hidden.shape
    out = torch.empty(num_tokens, hc, dim, dtype=torch.float64, device=hidden.device)
    value = kv[:, hc * dim :].double()
    for h in range(hc):
        x = hidden[:, h].double()
        key = kv[:, h * dim : (h + 1) * dim].double()
        x_rms = torch.sqrt((x * x).sum(dim=1) / dim + eps)
        key_rms = torch.sqrt((key * key).sum(dim=1) / dim + eps)
        weight = q_weight[h].double() * k_weight[h].double()
        dot = (x * weight * key).sum(dim=1) / (x_rms * key_rms * math.sqrt(dim))
        magnitude = torch.sqrt(torch.maximum(dot.abs(), torch.full_like(dot, 1e-6)))
        gate = 1.0 / (1.0 + torch.exp(-torch.sign(dot) * magnitude))
        if token_mask is not None:
            gate = torch.where(token_mask, gate, torch.zeros_like(gate))
        out[:, h] = x + gate[:, None] * value
    return out


@pytest.mark.parametrize(("num_tokens", "hc", "dim"), [(17, 4, 100), (5, 1, 33), (9, 2, 1024)])
def test_reference_matches_float64(num_tokens: int, hc: int, dim: int) -> None:
    inputs = make_inputs(num_tokens, hc, dim, seed=num_tokens + dim, masked=True)
    expected64 = gate_float64(**inputs)
    reference = engram_gate_reference(**inputs)
    # The float64 result is exact to ~1e-16: one side of the two-sided bound.
    tolerance = gate_tolerance(**inputs, expected=reference)
    assert_within_tolerance(reference, expected64, tolerance, label="reference")
    # Sharper than the bound: fp32 errors rarely move a value across a bf16
    # rounding boundary, so the reference is the rounded float64 result almost
    # everywhere.
    agree = (reference == expected64.to(torch.bfloat16)).double().mean().item()
    assert agree > 0.97, f"reference equals bf16(float64) on only {agree:.1%} of elements"


# --- negative controls: the comparison can fail ----------------------------


def test_comparison_catches_a_perturbed_output() -> None:
    inputs = make_inputs(5, 2, 64, seed=9)
    out = engram_gate(GateInputs(**inputs), backend="triton")
    expected = engram_gate_reference(**inputs)
    tolerance = gate_tolerance(**inputs, expected=expected, truncating_store=TRUNCATING_STORE)
    assert_within_tolerance(out, expected, tolerance)
    index = (3, 1, 17)
    perturbed = out.clone()
    perturbed[index] = (out[index].double() + 2 * tolerance[index] + 1e-3).to(torch.bfloat16)
    with pytest.raises(AssertionError, match=r"\(3, 1, 17\)"):
        assert_within_tolerance(perturbed, expected, tolerance, label="kernel")
    unwritten = out.clone()
    unwritten[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"1 of 640 elements"):
        assert_within_tolerance(unwritten, expected, tolerance, label="kernel")


def test_comparison_catches_the_wrong_key() -> None:
    # A plausible kernel bug: every stream uses key 0.
    inputs = make_inputs(5, 4, 64, seed=13)
    wrong = dict(inputs)
    kv = inputs["kv"].clone()
    kv[:, 64 : 4 * 64] = kv[:, :64].repeat(1, 3)
    wrong["kv"] = kv
    with pytest.raises(AssertionError, match="outside the derived tolerance"):
        check_against_reference(engram_gate_reference(**wrong), inputs, label="wrong-key")


# --- validation --------------------------------------------------------------


def _bad(name: str, **changes):
    return pytest.param(changes, name, id=f"{name}-{'-'.join(changes)}")


T, HC, D = 5, 2, 33


@pytest.mark.parametrize(
    ("changes", "parameter"),
    [
        _bad("hidden", hidden=torch.randn(T, HC * D).bfloat16()),
        _bad("hidden", hidden=torch.randint(0, 9, (T, HC, D))),
        _bad("hidden", hidden=torch.randn(T, D, HC).bfloat16().transpose(1, 2)),
        _bad("kv", kv=torch.randn(T, HC * D).bfloat16()),
        _bad("kv", kv=torch.randn(T + 1, (HC + 1) * D).bfloat16()),
        _bad("kv", kv=torch.randn(T, (HC + 1) * D, dtype=torch.float64)),
        _bad("q_weight", q_weight=torch.randn(HC + 1, D)),
        _bad("k_weight", k_weight=torch.randn(HC, D + 1)),
        _bad("k_weight", k_weight=torch.randint(0, 9, (HC, D))),
        _bad("eps", eps=0.0),
        _bad("eps", eps=-1e-6),
        _bad("eps", eps=float("nan")),
        _bad("eps", eps="1e-6"),
        _bad("token_mask", token_mask=torch.ones(T + 1, dtype=torch.bool)),
        _bad("token_mask", token_mask=torch.ones(T, dtype=torch.uint8)),
        _bad("token_mask", token_mask=torch.ones(T, dtype=torch.bool, device="meta")),
        _bad("out", out=torch.empty(T, HC, D)),
        _bad("out", out=torch.empty(T, HC, D + 1, dtype=torch.bfloat16)),
    ],
)
def test_bad_input_raises_validation_error(changes: dict, parameter: str) -> None:
    inputs = make_inputs(T, HC, D, seed=17)
    for name, value in changes.items():
        on_device = isinstance(value, torch.Tensor) and value.device.type != "meta"
        inputs[name] = value.to(DEVICE) if on_device else value
    out = inputs.pop("out", None)
    with pytest.raises(ValidationError) as caught:
        engram_gate(GateInputs(**inputs), out=out, backend="reference")
    message = str(caught.value)
    assert message.startswith(parameter), message


def test_loose_operands_are_refused() -> None:
    inputs = make_inputs(T, HC, D, seed=17)
    with pytest.raises(ValidationError, match=r"^inputs is a Tensor, expected a GateInputs"):
        engram_gate(inputs["hidden"], backend="reference")
    with pytest.raises(ValidationError, match=r"^inputs is a tuple, expected a GateInputs"):
        engram_gate(tuple(inputs.values()), backend="reference")
    # the control: the same operands as a GateInputs pass
    engram_gate(GateInputs(**inputs), backend="reference")


def test_validation_can_be_switched_off() -> None:
    inputs = make_inputs(T, HC, D, seed=19)
    inputs["eps"] = 0.5  # valid; only checks that validate=False still computes
    result = engram_gate(GateInputs(**inputs), backend="triton", validate=False)
    check_against_reference(result, inputs)


# --- configuration and imports ---------------------------------------------


@pytest.mark.parametrize(("hc", "dim"), [(4, 5120), (1, 5120), (4, 128), (3, 33), (8, 1)])
def test_default_config_is_sane(hc: int, dim: int) -> None:
    config = default_gate_config(hc, dim)
    assert config.block_d >= 8 and config.block_d & (config.block_d - 1) == 0
    hc_pad = 1 << (hc - 1).bit_length()
    assert hc_pad * config.block_d <= 8192 or config.block_d == 8  # the register budget
    assert 1 <= config.num_warps <= 8
    if (hc, dim) == (4, 5120):  # the configuration measured best on the H200
        assert (config.block_d, config.num_warps, config.programs_per_sm) == (1024, 4, None)


def test_importing_the_gate_does_not_import_triton() -> None:
    code = "import sys, engramrt.gate\nprint('triton' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
