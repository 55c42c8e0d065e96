"""Row quantisation (SPEC §6): the reference against an independent numpy
oracle, and the Triton kernels against the reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.helpers import DEVICE

from engramrt.errors import ValidationError
from engramrt.quant import (
    dequantize_rows,
    dequantize_rows_reference,
    quantize_rows,
    quantize_rows_reference,
)

# --------------------------------------------------------------------------
# Independent oracle: e4m3fn decoded from its bit fields, RNE by search.
# --------------------------------------------------------------------------


def e4m3fn_code_values() -> np.ndarray:
    """float64 value of each of the 256 codes (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    magnitude = np.where(
        exponent == 0,
        mantissa / 8.0 * 2.0**-6,
        (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0),
    )
    magnitude = np.where((codes & 0x7F) == 0x7F, np.nan, magnitude)
    return sign * magnitude


CODE_VALUES = e4m3fn_code_values()
# Finite non-negative magnitudes are codes 0..0x7E, increasing with the code.
POSITIVE = CODE_VALUES[:0x7F]
assert np.all(np.diff(POSITIVE) > 0) and POSITIVE[-1] == 448.0


def oracle_e4m3fn_rne(x: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn code of each float64 (exact) ``x``, ties to even, saturating."""
    magnitude = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(POSITIVE, magnitude, side="left"), 0, 0x7E)
    lo = np.clip(hi - 1, 0, 0x7E)
    d_hi = POSITIVE[hi] - magnitude
    d_lo = magnitude - POSITIVE[lo]
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = np.where(pick_lo, lo, hi)
    code = np.where(POSITIVE[hi] == magnitude, hi, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def oracle_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """SPEC §6 with exact arithmetic: the smallest e with 448 * 2**e >= amax."""
    blocks = x.to(torch.float32).double().numpy().reshape(*x.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), float(np.float32(1e-4)))
    exponent = np.ceil(np.log2(amax / 448.0)).astype(np.int64) - 1
    for _ in range(3):  # fix log2's rounding exactly: 448 * 2**e is exact in float64
        exponent = np.where(
            448.0 * np.exp2(exponent.astype(np.float64)) < amax, exponent + 1, exponent
        )
    assert np.all(448.0 * np.exp2(exponent.astype(np.float64)) >= amax)
    assert np.all(448.0 * np.exp2(exponent.astype(np.float64) - 1) < amax)
    scaled = blocks / np.exp2(exponent.astype(np.float64))[..., None]  # exact
    codes = oracle_e4m3fn_rne(scaled).reshape(x.shape)
    return codes, (exponent + 127).astype(np.uint8)


def as_bytes(values: torch.Tensor) -> np.ndarray:
    return values.view(torch.uint8).cpu().numpy()


def assert_same_bytes(found: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a = found.contiguous().view(torch.uint8).cpu()
    b = expected.contiguous().view(torch.uint8).cpu()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ; first at " + ", ".join(
        f"{tuple(i)}: {a[tuple(i)].item():#04x} != {b[tuple(i)].item():#04x}"
        for i in diff[:8].tolist()
    )


def random_rows(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    """Rows whose blocks span many magnitudes (never all zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    magnitude = torch.exp2(
        torch.randint(-30, 30, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    )
    x = (x.reshape(*shape[:-1], -1, 32) * magnitude).reshape(shape)
    return x.to(dtype)


# --------------------------------------------------------------------------
# The oracle itself, and the reference against it.
# --------------------------------------------------------------------------


def test_oracle_rounding_known_values() -> None:
    cases = [
        (1.0, 0x38),
        (1.0625, 0x38),  # tie between 1.0 (even) and 1.125
        (1.1875, 0x3A),  # tie between 1.125 and 1.25 (even)
        (1.0625 + 2**-20, 0x39),  # just above the tie
        (448.0, 0x7E),
        (500.0, 0x7E),  # saturates
        (-448.0, 0xFE),
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # tie between 0 (even) and 2**-9
        (3 * 2.0**-10, 0x02),  # tie between 2**-9 and 2 * 2**-9 (even)
        (-(2.0**-12), 0x80),  # rounds to negative zero
        (-0.0, 0x80),
        (0.0, 0x00),
        (2.0**-6, 0x08),  # smallest normal
        (15 * 2.0**-10, 0x08),  # tie between 7 * 2**-9 (odd) and 2**-6 (even)
    ]  # a list: 0.0 and -0.0 are equal as dict keys
    got = oracle_e4m3fn_rne(np.array([value for value, _ in cases]))
    assert [int(c) for c in got] == [code for _, code in cases]


def test_oracle_matches_torch_cast_on_clamped_values() -> None:
    """torch's cast is RNE below 448; the oracle agrees on dense, tie-heavy inputs."""
    grid = np.concatenate([POSITIVE, (POSITIVE[1:] + POSITIVE[:-1]) / 2])  # every tie
    rng = np.random.default_rng(1)
    dense = rng.uniform(0, 448, 20000) * 2.0 ** rng.integers(-14, 1, 20000)
    x = np.concatenate([grid, -grid, dense, -dense]).astype(np.float32)
    torch_codes = as_bytes(torch.from_numpy(x).to(torch.float8_e4m3fn))
    assert np.array_equal(oracle_e4m3fn_rne(x.astype(np.float64)), torch_codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_quantize_matches_oracle(dtype: torch.dtype) -> None:
    x = random_rows((5, 3, 96), dtype=dtype, seed=2)
    if dtype == torch.float16:
        x = x.float().clamp(-6e4, 6e4).to(dtype)  # keep finite in fp16
        x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
    values, scales = quantize_rows_reference(x)
    codes, scale_bytes = oracle_quantize(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (5, 3, 3)
    assert np.array_equal(as_bytes(values), codes)
    assert np.array_equal(scales.numpy(), scale_bytes)


def edge_blocks() -> torch.Tensor:
    """One row per edge case, each a single block of 32 values."""
    rng = np.random.default_rng(3)
    rows = []
    rows.append(np.zeros(32))  # all zero: amax floored at 1e-4
    rows.append(np.full(32, -0.0))  # negative zeros
    rows.append(np.exp2(np.arange(-16, 16, dtype=np.float64)))  # powers of two
    rows.append(np.concatenate([[448.0, -448.0], rng.uniform(-448, 448, 30)]))  # s = 1 exactly
    rows.append(np.concatenate([[-448.0], rng.uniform(-1, 1, 31)]))
    for k in (-20, -3, 0, 5, 30):  # amax / 448 exactly a power of two
        rows.append(np.concatenate([[448.0 * 2.0**k], rng.uniform(-1, 1, 31) * 448.0 * 2.0**k]))
        above = float(np.nextafter(np.float32(448.0 * 2.0**k), np.float32(np.inf)))
        rows.append(np.concatenate([[above], rng.uniform(-1, 1, 31) * above]))  # one ulp above
    rows.append(np.concatenate([[1e-4], np.zeros(31)]))  # exactly at the floor
    rows.append(np.concatenate([[5e-5, -3e-5], np.zeros(30)]))  # below the floor
    rows.append(np.concatenate([[448.0], (np.arange(31) + 0.5) * 2.0**-9]))  # subnormal ties
    rows.append(np.concatenate([[448.0], 1.0 + (2 * np.arange(31) + 1) / 16.0]))  # normal ties
    rows.append(np.concatenate([[1.75 * 2.0**10], np.full(31, -(2.0**-3))]))  # mantissa 0x600000
    rows.append(np.concatenate([[3e38], rng.uniform(-3e38, 3e38, 31)]))  # near fp32 max
    return torch.tensor(np.stack(rows), dtype=torch.float32)


def test_reference_quantize_edge_cases() -> None:
    x = edge_blocks()
    values, scales = quantize_rows_reference(x)
    codes, scale_bytes = oracle_quantize(x)
    assert np.array_equal(as_bytes(values), codes)
    assert np.array_equal(scales.numpy(), scale_bytes)
    assert scales[0].item() == 127 - 22  # ceil(log2(fp32(1e-4) / 448)) = -22
    assert as_bytes(values[1]).tolist() == [0x80] * 32  # negative zero survives
    assert scales[3].item() == 127 and as_bytes(values[3])[:2].tolist() == [0x7E, 0xFE]


def test_scale_exponent_formulas_agree_on_every_mantissa() -> None:
    """The reference reads ceil(log2(s)) from the bits of s = fp32(amax / 448);
    the kernel reads it from amax's bits (ea - 8 + (m > 0x600000)). Both equal
    the exact ceil(log2(amax / 448)) for every fp32 mantissa; exponents only
    shift all three by the same amount while everything stays normal."""
    mantissa = np.arange(1 << 23, dtype=np.uint32)
    for biased in (114, 127, 200):  # amax around 2**-13, 1 and 2**73
        amax = ((np.uint32(biased) << np.uint32(23)) | mantissa).view(np.float32)
        s_bits = (amax / np.float32(448.0)).view(np.uint32)  # numpy: IEEE fp32 division
        from_s = ((s_bits >> 23) & 0xFF).astype(np.int64) + ((s_bits & 0x7FFFFF) != 0)
        from_amax = biased - 8 + (mantissa > 0x600000)
        assert np.array_equal(from_s, from_amax)
        exact = from_amax - 127  # check against the exact real quotient
        amax64 = amax.astype(np.float64)
        assert np.all(448.0 * np.exp2(exact.astype(np.float64)) >= amax64)
        assert np.all(448.0 * np.exp2(exact.astype(np.float64) - 1) < amax64)


finite_fp32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(finite_fp32, min_size=32, max_size=32), st.integers(-40, 40))
def test_quantize_property_reference_and_kernel(block: list[float], shift: int) -> None:
    """Any finite block (subnormals, huge values, ties): reference = oracle,
    kernel = reference; a second block is the first scaled by 2**shift."""
    first = torch.tensor(block, dtype=torch.float32)
    second = (first.double() * 2.0**shift).clamp(-3.4e38, 3.4e38).float()
    x = torch.stack([first, second]).reshape(1, 64)
    values, scales = quantize_rows_reference(x)
    codes, scale_bytes = oracle_quantize(x)
    assert np.array_equal(as_bytes(values), codes)
    assert np.array_equal(scales.numpy(), scale_bytes)
    kernel_values, kernel_scales = quantize_rows(x.to(DEVICE), backend="triton")
    assert_same_bytes(kernel_values, values, "values")
    assert_same_bytes(kernel_scales, scales, "scales")


# --------------------------------------------------------------------------
# Kernels against the reference.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((7, 256), torch.float32),
        ((3, 5, 96), torch.bfloat16),
        ((9, 32), torch.float16),
        ((1, 160), torch.float32),
    ],
)
def test_quantize_kernel_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = random_rows(shape, dtype=torch.float32, seed=4)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype).to(DEVICE)
    ref_values, ref_scales = quantize_rows(x, backend="reference")
    values, scales = quantize_rows(x, backend="triton")
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert_same_bytes(values, ref_values, "values")
    assert_same_bytes(scales, ref_scales, "scales")


def test_quantize_kernel_edge_cases() -> None:
    x = edge_blocks().to(DEVICE)
    ref_values, ref_scales = quantize_rows(x, backend="reference")
    values, scales = quantize_rows(x, backend="triton")
    assert_same_bytes(values, ref_values, "values")
    assert_same_bytes(scales, ref_scales, "scales")


def every_value_and_scale_byte() -> tuple[torch.Tensor, torch.Tensor]:
    """values [2048, 32] and scales [2048, 1]: all 256 x 256 (value, scale) byte pairs."""
    values = torch.arange(256, dtype=torch.uint8).reshape(8, 32).repeat(256, 1)
    scales = torch.arange(256).repeat_interleave(8).to(torch.uint8).reshape(2048, 1)
    return values, scales


def test_reference_dequantize_matches_exact_products() -> None:
    values, scales = every_value_and_scale_byte()
    rows = dequantize_rows_reference(values.view(torch.float8_e4m3fn), scales)
    decoded = CODE_VALUES[values.numpy()]
    scale = np.exp2(scales.numpy().astype(np.float64) - 127)
    exact = decoded * scale  # exact in float64
    # Where the exact product is a normal bf16 it must come back unrounded;
    # subnormal, overflowing and NaN cases are covered against the kernel.
    normal = np.isfinite(exact) & (np.abs(exact) >= 2.0**-126) & (np.abs(exact) < 2.0**127)
    normal &= (scales.numpy() > 0) & (scales.numpy() < 255)
    got = rows.float().double().numpy()
    assert np.array_equal(got[normal], exact[normal])
    zero_scale = np.broadcast_to(scales.numpy() == 0, got.shape) & np.isfinite(decoded)
    assert np.all(got[zero_scale] == 0)
    nan_bits = rows.view(torch.int16).numpy()[np.isnan(decoded)]
    assert np.all(nan_bits == 0x7FC0)


HW_CONVERT = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="the interpreter's fp8/bf16 casts are not the GPU's (see test_hw_convert_in_interpreter)",
        ),
    ),
]


@pytest.mark.parametrize("hw_convert", HW_CONVERT)
def test_dequantize_kernel_matches_reference_on_every_byte_pair(hw_convert: bool) -> None:
    values, scales = every_value_and_scale_byte()
    values, scales = values.to(DEVICE), scales.to(DEVICE)
    expected = dequantize_rows(values, scales, backend="reference")
    out = torch.full(values.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = dequantize_rows(values, scales, out=out, backend="triton", hw_convert=hw_convert)
    assert got.data_ptr() == out.data_ptr()
    assert_same_bytes(got, expected, "bf16 rows")


def test_hw_convert_in_interpreter() -> None:
    """The hardware-conversion variant traces and agrees where the interpreter's
    casts are exact: finite codes, normal products (the GPU run checks the rest)."""
    values, scales = every_value_and_scale_byte()
    finite = (values & 0x7F) != 0x7F
    values = torch.where(finite, values, values ^ 1)
    normal = ((scales >= 20) & (scales <= 230)).squeeze(1)
    values, scales = values[normal].to(DEVICE), scales[normal].to(DEVICE)
    expected = dequantize_rows(values, scales, backend="reference")
    assert_same_bytes(
        dequantize_rows(values, scales, backend="triton", hw_convert=True), expected, "bf16"
    )


def test_dequantize_accepts_e8m0_scales_and_fp8_values() -> None:
    g = torch.Generator().manual_seed(5)
    values = torch.randint(0, 256, (6, 3, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 136, (6, 3, 2), generator=g, dtype=torch.uint8)
    expected = dequantize_rows(values.to(DEVICE), scales.to(DEVICE), backend="reference")
    # Independently of the reference: torch's own fp8 -> fp32 conversion times 2**(b - 127),
    # exact in fp32 and in bf16 (4 significant bits times a power of two, no overflow here).
    by_torch = values.view(torch.float8_e4m3fn).float() * torch.exp2(
        scales.float() - 127
    ).repeat_interleave(32, dim=-1)
    nan = torch.isnan(by_torch)
    assert nan.any() and torch.equal(torch.isnan(expected.float().cpu()), nan)
    assert_same_bytes(expected.cpu()[~nan], by_torch.bfloat16()[~nan], "reference vs torch")
    for backend in ("reference", "triton"):
        got = dequantize_rows(
            values.view(torch.float8_e4m3fn).to(DEVICE),
            scales.view(torch.float8_e8m0fnu).to(DEVICE),
            backend=backend,
        )
        assert got.dtype == torch.bfloat16 and got.shape == (6, 3, 64)
        assert_same_bytes(got, expected, backend)


def test_round_trip_error_bound() -> None:
    """|x - dq(q(x))| <= 2**-4 |x| (half an e4m3 ulp) or half a subnormal step."""
    x = random_rows((11, 128), seed=6).to(DEVICE)
    values, scales = quantize_rows(x)
    back = dequantize_rows(values, scales).float()
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    err = (back - x).abs()
    worst = (err - bound).flatten().topk(3)
    assert bool((err <= bound).all()), f"worst excess over the bound: {worst.values.tolist()}"


POISON_BF16 = 0x7FA5  # a NaN payload neither kernel writes (their NaN is 0x7FC0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_rows(backend: str) -> None:
    """Zero rows quantise to zero rows of the right dtypes, and dequantising them into
    a poisoned buffer writes nothing; the control, one row through the same buffer, is
    written and equals the exact products (so the check would see a stray write)."""
    gen = torch.Generator().manual_seed(17)
    x = (torch.randn(3, 64, generator=gen) * 5).to(DEVICE)  # fresh, never zeros
    values, scales = quantize_rows(x[:0], backend=backend)
    assert (values.shape, values.dtype, values.device) == ((0, 64), torch.float8_e4m3fn, x.device)
    assert (scales.shape, scales.dtype, scales.device) == ((0, 2), torch.uint8, x.device)
    buffer = torch.full((2, 64), POISON_BF16, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    got = dequantize_rows(values, scales, out=buffer[:0], backend=backend)
    assert (got.shape, got.dtype) == ((0, 64), torch.bfloat16)
    assert bool((buffer.view(torch.int16) == POISON_BF16).all()), "an empty batch wrote rows"
    # Control: one row through the same path and buffer; its bytes are the oracle's.
    one_values, one_scales = quantize_rows(x[:1], backend=backend)
    codes, exponents = oracle_quantize(x[:1].cpu())
    assert np.array_equal(as_bytes(one_values), codes)
    assert np.array_equal(one_scales.cpu().numpy(), exponents)
    dequantize_rows(one_values, one_scales, out=buffer[:1], backend=backend)
    exact = CODE_VALUES[codes] * np.exp2(np.repeat(exponents.astype(np.float64) - 127, 32, -1))
    want = torch.from_numpy(exact).to(torch.bfloat16)  # bf16 rounding of the exact product
    assert torch.equal(buffer[:1].cpu().view(torch.int16), want.view(torch.int16))
    assert bool((buffer[1:].view(torch.int16) == POISON_BF16).all())


def test_negative_controls() -> None:
    """The comparisons above can fail: ties rounded away from zero (what
    Triton's interpreter cast does) and truncation both disagree with the oracle."""
    ties = (POSITIVE[1:] + POSITIVE[:-1]) / 2  # exactly between two codes
    away = np.searchsorted(POSITIVE, ties).astype(np.uint8)
    assert not np.array_equal(oracle_e4m3fn_rne(ties), away)
    above_ties = ties * (1 + 2**-20)
    truncated = (np.searchsorted(POSITIVE, above_ties) - 1).astype(np.uint8)
    assert not np.array_equal(oracle_e4m3fn_rne(above_ties), truncated)


# --------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------


def test_errors_name_the_problem() -> None:
    with pytest.raises(
        ValidationError, match=r"rows of 48 values; expected a positive multiple of 32"
    ):
        quantize_rows(torch.ones(2, 48))
    with pytest.raises(ValidationError, match=r"x has dtype torch.int32"):
        quantize_rows(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValidationError, match=r"expected finite values"):
        quantize_rows(torch.tensor([[float("inf")] + [1.0] * 31]))
    values = torch.zeros(2, 64, dtype=torch.uint8)
    with pytest.raises(ValidationError, match=r"scales has shape \(2, 3\); expected \(2, 2\)"):
        dequantize_rows(values, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValidationError, match=r"values has dtype torch.float32"):
        dequantize_rows(values.float(), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValidationError, match=r"scales has dtype torch.int32"):
        dequantize_rows(values, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValidationError, match=r"out is torch.float32"):
        dequantize_rows(values, torch.zeros(2, 2, dtype=torch.uint8), out=torch.empty(2, 64))
