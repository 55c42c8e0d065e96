"""wkv: block-fp8 dequantisation bit for bit, the projection within its derived bound.

Tolerance (derived in engramrt.layer.reference, above ``linear_tolerance``):
against the exact float64 ``x @ w.T``, with S = sum_k |x_k w_k|,
``|impl - exact| <= rho S + 2 K u_32 (1 + rho) S + ulp_bf16(|y| + e1) / 2``:
rho = 0 for a bf16 weight and 2^-8 + 2^-23 for an fp8 weight dequantised to
bf16 once at load (two roundings); 2 K u_32 for K products summed in fp32 in
any order, rounding or truncating; half a bf16 ulp for the stored result.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.helpers import assert_same_bits
from tests.layer.common import DEVICE, quantize_block_fp8

from engramrt.errors import CheckpointError
from engramrt.gate import assert_within_tolerance
from engramrt.layer import (
    BF16_DEQUANT_ROUNDING,
    EngramLinear,
    dequantize_block_fp8,
    dequantize_block_fp8_reference,
    linear_exact,
    linear_tolerance,
)
from engramrt.layer.linear import _DEQUANT_ROW_BLOCKS


def random_fp8_weight(out_features: int, in_features: int, seed: int):
    """fp8 values of every finite code and block scales of varied magnitude."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out_features, in_features), generator=g, dtype=torch.uint8)
    codes ^= ((codes & 0x7F) == 0x7F).to(torch.uint8)  # no NaN codes
    blocks = (math.ceil(out_features / 128), math.ceil(in_features / 128))
    scales = torch.exp(torch.randn(blocks, generator=g, dtype=torch.float64) * 3).float()
    return codes.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(128, 128), (300, 200), (1, 129), (257, 1), (130, 384)]
)
def test_dequantize_matches_blockwise_numpy(out_features: int, in_features: int) -> None:
    """Each 128 x 128 block times its own scale (partial blocks at the edges), fp32, bit for bit."""
    weight, scales = random_fp8_weight(out_features, in_features, seed=out_features + in_features)
    values = weight.float().numpy()
    expected = np.empty_like(values)
    for bi in range(scales.shape[0]):
        for bj in range(scales.shape[1]):
            rows = slice(bi * 128, (bi + 1) * 128)
            cols = slice(bj * 128, (bj + 1) * 128)
            expected[rows, cols] = values[rows, cols] * np.float32(scales[bi, bj].item())
    found = dequantize_block_fp8_reference(weight, scales)
    assert found.dtype == torch.float32
    assert np.array_equal(found.numpy().view(np.int32), expected.view(np.int32))
    exact = dequantize_block_fp8_reference(weight, scales, dtype=torch.float64)
    # float64 is exact: rounding it to fp32 gives the fp32 dequantisation
    assert torch.equal(exact.float(), found)


def test_dequantize_to_bf16_in_pieces() -> None:
    """The load path (pieces of 32 row blocks, bf16 out) equals bf16 of the fp32 reference."""
    out_features = 128 * _DEQUANT_ROW_BLOCKS + 200  # two pieces, the last partial
    weight, scales = random_fp8_weight(out_features, 40, seed=3)
    out = torch.full((out_features, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dequantize_block_fp8(weight, scales, out)
    assert_same_bits(out, dequantize_block_fp8_reference(weight, scales).bfloat16(), "weight")


def project(linear: EngramLinear, x: torch.Tensor) -> torch.Tensor:
    out = torch.full(
        (x.shape[0], linear.out_features), float("nan"), dtype=torch.bfloat16, device=DEVICE
    )
    result = linear(x, out=out)
    assert result.data_ptr() == out.data_ptr()
    return result


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(300, 200), (640, 768)])
def test_projection_within_derived_bound(
    fp8: bool, num_tokens: int, out_features: int, in_features: int
) -> None:
    g = torch.Generator().manual_seed(num_tokens + out_features)
    x = (torch.randn(num_tokens, in_features, generator=g) * 3).bfloat16().to(DEVICE)
    linear = EngramLinear(in_features, out_features, device=DEVICE)
    if fp8:
        weight, scales = random_fp8_weight(out_features, in_features, seed=num_tokens)
        linear.load(weight, scales)
        exact_weight = dequantize_block_fp8_reference(weight, scales, dtype=torch.float64)
        assert linear.weight_rounding == BF16_DEQUANT_ROUNDING
    else:
        weight = (torch.randn(out_features, in_features, generator=g) / 20).bfloat16()
        linear.load(weight)
        exact_weight = weight.double()
        assert linear.weight_rounding == 0.0
    exact_weight = exact_weight.to(DEVICE)
    y = project(linear, x)
    exact = linear_exact(x, exact_weight)
    tolerance = linear_tolerance(x, exact_weight, exact, weight_rounding=linear.weight_rounding)
    assert_within_tolerance(y, exact, tolerance, label="wkv")
    # ... and without out=
    assert_same_bits(linear(x), y, label="wkv without out=")


def test_bound_is_not_vacuous() -> None:
    """For a bf16 weight the bound is a few percent of a typical |y| (it is
    dominated by the worst-case fp32 accumulation term 2 K u_32 S)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 768, generator=g).bfloat16()
    weight = torch.randn(256, 768, generator=g).bfloat16().double()
    exact = linear_exact(x, weight)
    ratio = (linear_tolerance(x, weight, exact) / exact.abs()).median().item()
    assert ratio < 0.02, ratio


def test_negative_control_misplaced_block_scale() -> None:
    """Applying one block's scale to its neighbour (a transposed scale grid) is caught."""
    weight, scales = random_fp8_weight(256, 384, seed=5)
    linear = EngramLinear(384, 256, device=DEVICE)
    linear.load(weight, scales.flip(1).contiguous())  # same shape, blocks swapped
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 384, generator=g).bfloat16().to(DEVICE)
    exact_weight = dequantize_block_fp8_reference(weight, scales, dtype=torch.float64).to(DEVICE)
    exact = linear_exact(x, exact_weight)
    tolerance = linear_tolerance(x, exact_weight, exact, weight_rounding=linear.weight_rounding)
    with pytest.raises(AssertionError, match="outside the derived tolerance"):
        assert_within_tolerance(project(linear, x), exact, tolerance, label="wkv")


def test_negative_control_rounding_term_is_needed() -> None:
    """Leaving out the weight-rounding term rho S makes an fp8-loaded projection fail:
    the term is not slack."""
    weight, scales = random_fp8_weight(512, 768, seed=8)
    linear = EngramLinear(768, 512, device=DEVICE)
    linear.load(weight, scales)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(32, 768, generator=g).bfloat16().to(DEVICE)
    exact_weight = dequantize_block_fp8_reference(weight, scales, dtype=torch.float64).to(DEVICE)
    exact = linear_exact(x, exact_weight)
    tolerance = linear_tolerance(x, exact_weight, exact, weight_rounding=0.0)
    with pytest.raises(AssertionError, match="outside the derived tolerance"):
        assert_within_tolerance(project(linear, x), exact, tolerance, label="wkv")


def test_quantize_helper_round_trips() -> None:
    """The tests' fp8 checkpoint writer: dequantised weights within an e4m3 step."""
    g = torch.Generator().manual_seed(10)
    weight = torch.randn(200, 300, generator=g)
    fp8, scales = quantize_block_fp8(weight)
    assert fp8.dtype == torch.float8_e4m3fn and scales.shape == (2, 3)
    back = dequantize_block_fp8_reference(fp8, scales)
    block_scale = scales.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # e4m3 has 3 mantissa bits: relative step 2^-3, half of it when rounding; the
    # subnormal step is 2^-9 of the scale.
    assert bool(((back - weight).abs() <= weight.abs() / 16 + block_scale * 2**-10).all())


def test_load_errors() -> None:
    linear = EngramLinear(200, 300)
    weight, scales = random_fp8_weight(300, 200, seed=1)
    with pytest.raises(
        CheckpointError,
        match=r"w has shape \[200, 300\] dtype torch.float8_e4m3fn; expected shape \[300, 200\]",
    ):
        linear.load(weight.t().contiguous(), scales, name="w")
    with pytest.raises(CheckpointError, match=r"w_scale is missing"):
        linear.load(weight, name="w")
    with pytest.raises(CheckpointError, match=r"weight is a list"):
        linear.load([1, 2])  # type: ignore[arg-type]
