"""Row lookup (SPEC §6-7): packing, the reference, and the Triton gather +
dequantise kernel against the reference, byte for byte."""

from __future__ import annotations

import re

import pytest
import torch
from tests.helpers import DEVICE, assert_same_bits, random_packed_table

from engramrt.errors import ValidationError
from engramrt.lookup import (
    LookupKernelConfig,
    gather_packed_rows_reference,
    lookup_rows,
    lookup_rows_reference,
    pack_rows,
    row_bytes_for,
    row_width_for,
    unpack_rows,
)
from engramrt.quant import dequantize_rows_reference, quantize_rows_reference


def random_ids(
    shape: tuple[int, int], low: int, high: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


# --------------------------------------------------------------------------
# Packing and the reference.
# --------------------------------------------------------------------------


def test_row_bytes() -> None:
    assert row_bytes_for(256) == 264 and row_width_for(264) == 256
    assert row_bytes_for(32) == 33 and row_width_for(99) == 96
    for bad in (0, 100, 256, 265):
        with pytest.raises(ValidationError, match=f"packed rows have {bad} bytes"):
            row_width_for(bad)


def test_pack_unpack_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 256, (3, 4, 96), generator=g, dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )
    scales = torch.randint(0, 256, (3, 4, 3), generator=g, dtype=torch.uint8)
    packed = pack_rows(values, scales.view(torch.float8_e8m0fnu))
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4, 99)
    assert torch.equal(packed[..., :96], values.view(torch.uint8))
    assert torch.equal(packed[..., 96:], scales)
    got_values, got_scales = unpack_rows(packed)
    assert got_values.dtype == torch.float8_e4m3fn and got_scales.dtype == torch.uint8
    assert torch.equal(got_values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(got_scales, scales)
    with pytest.raises(ValidationError, match=r"scales \(3, 4, 2\)"):
        pack_rows(values, scales[..., :2])
    with pytest.raises(ValidationError, match=r"packed is torch\.int8"):
        unpack_rows(packed.view(torch.int8))


def test_reference_is_gather_then_dequantize_with_zero_columns() -> None:
    """Independent restatement: quantise float rows, look them up one by one."""
    E, num_rows, row_begin = 64, 40, 1000
    g = torch.Generator().manual_seed(1)
    floats = torch.randn(num_rows, E, generator=g) * 3
    values, scales = quantize_rows_reference(floats)
    table = pack_rows(values, scales)
    row_ids = random_ids((5, 7), row_begin, row_begin + num_rows, torch.int64, seed=2)
    row_ids[:, 0] = -12345  # not owned: never read
    got = lookup_rows_reference(row_ids, table, E, col_begin=2, col_end=6, row_begin=row_begin)
    assert got.shape == (5, 7, E) and got.dtype == torch.bfloat16
    for t in range(5):
        for c in range(7):
            if 2 <= c < 6:
                local = int(row_ids[t, c]) - row_begin
                expected = dequantize_rows_reference(values[local], scales[local])
                assert torch.equal(got[t, c].view(torch.int16), expected.view(torch.int16))
            else:
                assert torch.equal(got[t, c].view(torch.int16), torch.zeros(E, dtype=torch.int16))


# --------------------------------------------------------------------------
# Kernel against the reference.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("T", "C", "E", "id_dtype", "cols", "row_begin"),
    [
        (7, 5, 256, torch.int32, (0, 5), 0),
        (13, 3, 96, torch.int64, (1, 3), 777),
        (1, 24, 256, torch.int64, (8, 16), 2**33),  # ids past int32
        (9, 7, 32, torch.int32, (0, 0), 5),  # no owned column: all zeros
        (3, 11, 160, torch.int32, (10, 11), 50),
    ],
)
def test_kernel_matches_reference(
    T: int, C: int, E: int, id_dtype: torch.dtype, cols: tuple[int, int], row_begin: int
) -> None:
    num_rows = 53
    table = random_packed_table(num_rows, E, seed=T * C + E).to(DEVICE)
    row_ids = random_ids((T, C), row_begin, row_begin + num_rows, torch.int64, seed=E)
    row_ids[:, : cols[0]] = -1  # columns of other shards may hold anything
    row_ids[:, cols[1] :] = 2**40
    if id_dtype == torch.int32:
        row_ids = row_ids.clamp(-(2**31), 2**31 - 1)
    row_ids = row_ids.to(id_dtype).to(DEVICE)
    col_begin, col_end = cols
    expected = lookup_rows_reference(row_ids, table, E, col_begin, col_end, row_begin)
    out = torch.full((T, C, E), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = lookup_rows(
        row_ids,
        table,
        col_begin=col_begin,
        col_end=col_end,
        row_begin=row_begin,
        out=out,
        backend="triton",
    )
    assert got.data_ptr() == out.data_ptr()
    assert_same_bits(got, expected)


HW_CONVERT = [
    False,
    None,  # the default: conversion instructions on a GPU, integer ones in the interpreter
    pytest.param(
        True,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="the interpreter's fp8/bf16 casts are not the GPU's (see test_hw_convert_in_interpreter)",
        ),
    ),
]


@pytest.mark.parametrize("hw_convert", HW_CONVERT)
def test_kernel_variants_match_reference(hw_convert: bool | None) -> None:
    """Both conversion variants, every value byte, scale bytes 0..255 (subnormal
    and overflowing products, NaN codes, 0 * inf)."""
    E, num_rows = 256, 256
    g = torch.Generator().manual_seed(30)
    values = torch.arange(256, dtype=torch.uint8).roll(7).repeat(num_rows, 1)
    scales = torch.randint(0, 256, (num_rows, E // 32), generator=g, dtype=torch.uint8)
    table = pack_rows(values.view(torch.float8_e4m3fn), scales).to(DEVICE)
    row_ids = random_ids((33, 9), 0, num_rows, torch.int32, seed=31).to(DEVICE)
    expected = lookup_rows_reference(row_ids, table, E, 1, 8)
    got = lookup_rows(
        row_ids,
        table,
        col_begin=1,
        col_end=8,
        backend="triton",
        kernel=LookupKernelConfig(hw_convert=hw_convert),
    )
    assert_same_bits(got, expected)


def test_hw_convert_in_interpreter() -> None:
    """The hardware-conversion variant traces and agrees where the interpreter's
    casts are exact (finite codes, normal products); the GPU run checks the rest."""
    table = random_packed_table(40, 96, seed=32)
    values = table[:, :96]
    values ^= ((values & 0x7F) == 0x7F).to(torch.uint8)  # no NaN codes
    table = table.to(DEVICE)
    row_ids = random_ids((7, 5), 0, 40, torch.int64, seed=33).to(DEVICE)
    expected = lookup_rows_reference(row_ids, table, 96, 1, 4)
    assert_same_bits(
        lookup_rows(
            row_ids,
            table,
            col_begin=1,
            col_end=4,
            backend="triton",
            kernel=LookupKernelConfig(hw_convert=True),
        ),
        expected,
    )


@pytest.mark.parametrize(
    ("E", "word"),
    [(256, torch.int64), (128, torch.int32), (64, torch.int16), (32, torch.uint8)],
)
def test_packed_gather_kernel_matches_reference(E: int, word: torch.dtype) -> None:
    """Raw row copies by the widest word that divides the row (264, 132, 66, 33 bytes):
    every row in order, duplicates and a partial last program too."""
    from engramrt.lookup.kernel import gather_packed_rows_triton
    from engramrt.packed import word_dtype_for

    num_rows, row_begin = 41, 1_000_003
    table = random_packed_table(num_rows, E, seed=E).to(DEVICE)
    assert word_dtype_for(table.shape[1]) == word
    for count, dtype in ((0, torch.int64), (1, torch.int32), (37, torch.int64)):
        ids = random_ids((count, 1), row_begin, row_begin + num_rows, dtype, seed=count)[:, 0]
        if count > 1:
            ids[-1] = ids[0]  # a duplicate
            ids[1] = row_begin + num_rows - 1  # the last row
        ids = ids.to(DEVICE)
        expected = gather_packed_rows_reference(ids, table, row_begin)
        out = torch.full((count, table.shape[1]), 0xA5, dtype=torch.uint8, device=DEVICE)
        got = gather_packed_rows_triton(
            ids, table.view(word), out, row_begin=row_begin, num_rows=num_rows
        )
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got.cpu(), expected.cpu())


def test_packed_gather_reference_negative_control() -> None:
    """The check above can fail: a row off by one differs."""
    table = random_packed_table(5, 32, seed=3)
    ids = torch.tensor([10, 12], dtype=torch.int64)
    assert torch.equal(gather_packed_rows_reference(ids, table, 10), table[[0, 2]])
    assert not torch.equal(gather_packed_rows_reference(ids, table, 9), table[[0, 2]])


def test_kernel_with_strided_ids_duplicates_and_extremes() -> None:
    E, num_rows = 64, 17
    table = random_packed_table(num_rows, E, seed=3).to(DEVICE)
    ids_ct = random_ids((6, 19), 0, num_rows, torch.int32, seed=4)
    ids_ct[0, :3] = torch.tensor([0, num_rows - 1, 0], dtype=torch.int32)  # both ends, repeated
    row_ids = ids_ct.to(DEVICE).t()  # [19, 6], non-contiguous
    assert not row_ids.is_contiguous()
    expected = lookup_rows_reference(row_ids, table, E)
    for rows_per_program, num_warps in ((None, None), (1, 1), (8, 2)):
        got = lookup_rows(
            row_ids,
            table,
            backend="triton",
            kernel=LookupKernelConfig(rows_per_program=rows_per_program, num_warps=num_warps),
        )
        assert_same_bits(got, expected)


@pytest.mark.parametrize("max_programs", [1, 2, 3, 5, 64])
def test_kernel_with_few_programs_serving_several_tiles(max_programs: int) -> None:
    """Programs looping over consecutive tiles write every lookup once, the last tile
    partial, the non-owned columns zero: the same bytes as one tile per program."""
    E, num_rows = 32, 40
    table = random_packed_table(num_rows, E, seed=11).to(DEVICE)
    row_ids = random_ids((23, 5), 0, num_rows, torch.int64, seed=12).to(DEVICE)
    expected = lookup_rows_reference(row_ids, table, E, col_begin=1, col_end=4)
    out = torch.full((23, 5, E), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = lookup_rows(
        row_ids,
        table,
        col_begin=1,
        col_end=4,
        out=out,
        backend="triton",
        # 115 lookups in tiles of 4 rows: 29 tiles, the last one of 3
        kernel=LookupKernelConfig(rows_per_program=4, max_programs=max_programs),
    )
    assert_same_bits(got, expected)


def test_tiles_per_program_bounds_the_grid() -> None:
    from engramrt.lookup.kernel import tiles_per_program

    assert tiles_per_program(29, None) == 1
    assert tiles_per_program(29, 64) == 1
    for tiles in range(1, 200):
        for max_programs in (1, 2, 3, 7, 16, 32):
            per = tiles_per_program(tiles, max_programs)
            assert per & (per - 1) == 0  # a power of two
            programs = -(-tiles // per)
            assert programs <= max_programs
            assert per == 1 or 2 * programs > max_programs - 1  # no needlessly small grid


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [
        ("max_programs", 0, "expected None or an int >= 1"),
        ("max_programs", -3, "expected None or an int >= 1"),
        ("max_programs", 2.5, "expected None or an int >= 1"),
        ("rows_per_program", 0, "expected None or an int >= 1"),
        ("rows_per_program", True, "expected None or an int >= 1"),
        ("num_warps", 3, "expected None or one of 1, 2, 4, 8, 16, 32"),
        ("num_warps", 64, "expected None or one of 1, 2, 4, 8, 16, 32"),
        ("hw_convert", 1, "expected None or a bool"),
    ],
)
def test_kernel_settings_name_the_bad_field(field: str, bad: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=rf"^{field} = {re.escape(repr(bad))}; {expected}"):
        LookupKernelConfig(**{field: bad})  # type: ignore[arg-type]


def test_kernel_settings_are_frozen_and_hashable() -> None:
    settings = LookupKernelConfig(rows_per_program=8, num_warps=2)
    with pytest.raises(AttributeError):
        settings.num_warps = 4  # type: ignore[misc]
    assert settings == LookupKernelConfig(8, 2) and hash(settings) == hash(LookupKernelConfig(8, 2))
    assert settings.replace(num_warps=4) == LookupKernelConfig(8, 4)


def test_lookup_rows_refuses_loose_settings() -> None:
    table = random_packed_table(4, 32, seed=7).to(DEVICE)
    row_ids = torch.zeros((2, 2), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValidationError, match=r"kernel = 16; expected a LookupKernelConfig"):
        lookup_rows(row_ids, table, backend="triton", kernel=16)  # type: ignore[arg-type]


def test_backends_agree_and_auto_runs() -> None:
    table = random_packed_table(30, 96, seed=5).to(DEVICE)
    row_ids = random_ids((5, 3), 0, 30, torch.int64, seed=6).to(DEVICE)
    reference = lookup_rows(row_ids, table, backend="reference")
    assert_same_bits(lookup_rows(row_ids, table), reference)
    out = torch.full_like(reference, float("nan"))
    assert_same_bits(lookup_rows(row_ids, table, backend="reference", out=out), reference)


def test_empty_batch() -> None:
    table = random_packed_table(4, 32, seed=7).to(DEVICE)
    for backend in ("reference", "triton"):
        got = lookup_rows(
            torch.empty((0, 24), dtype=torch.int32, device=DEVICE), table, backend=backend
        )
        assert got.shape == (0, 24, 32)
        # Nothing written around an empty output; with one token (the control) exactly
        # that token's rows are, equal to the reference, and the rest keeps its poison.
        # (The poison is a sentinel, not NaN: random fp8 bytes include NaN codes.)
        sentinel = -12288.0
        buffer = torch.full((2, 24, 32), sentinel, dtype=torch.bfloat16, device=DEVICE)
        for tokens in (0, 1):
            row_ids = torch.randint(0, 4, (tokens, 24), dtype=torch.int32, device=DEVICE)
            lookup_rows(row_ids, table, backend=backend, out=buffer[:tokens])
            assert bool((buffer[tokens:] == sentinel).all())
            assert_same_bits(buffer[:tokens], lookup_rows_reference(row_ids, table, 32))
        assert not bool((buffer[:1] == sentinel).all())


def test_negative_control_poisoned_output_is_caught() -> None:
    """A kernel that skipped a row would leave NaN poison and fail the comparison."""
    table = random_packed_table(8, 32, seed=8).to(DEVICE)
    row_ids = random_ids((3, 2), 0, 8, torch.int64, seed=9).to(DEVICE)
    expected = lookup_rows_reference(row_ids, table, 32)
    poisoned = torch.full_like(expected, float("nan"))
    poisoned[:2] = expected[:2]  # the last token "not written"
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_bits(poisoned, expected)


# --------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------


def test_checked_mode_names_column_and_id() -> None:
    table = random_packed_table(10, 32, seed=10).to(DEVICE)
    row_ids = torch.full((4, 6), 105, dtype=torch.int64, device=DEVICE)
    row_ids[:, 0] = 99999  # not owned: allowed
    row_ids[2, 4] = 110  # owned, one past the shard's last row
    for backend in ("reference", "triton"):
        with pytest.raises(
            ValidationError,
            match=r"row_ids\[2, 4\] = 110 for hash column 4; expected .* \[100, 110\)",
        ):
            lookup_rows(row_ids, table, col_begin=1, row_begin=100, check_ids=True, backend=backend)
    row_ids[2, 4] = 99
    with pytest.raises(ValidationError, match=r"row_ids\[2, 4\] = 99"):
        lookup_rows(row_ids, table, col_begin=1, row_begin=100, check_ids=True)
    row_ids[2, 4] = 109
    lookup_rows(row_ids, table, col_begin=1, row_begin=100, check_ids=True)


def test_argument_errors() -> None:
    table = random_packed_table(10, 32, seed=11).to(DEVICE)
    ids = torch.zeros((2, 3), dtype=torch.int64, device=DEVICE)
    with pytest.raises(
        ValidationError,
        match=r"row_ids has dtype torch\.float32; expected torch\.int32 or torch\.int64",
    ):
        lookup_rows(ids.float(), table)
    with pytest.raises(ValidationError, match=r"row_ids has shape \(6,\); expected \[T, C\]"):
        lookup_rows(ids.reshape(-1), table)
    with pytest.raises(ValidationError, match=r"packed_table is torch.int8 \(10, 33\)"):
        lookup_rows(ids, table.view(torch.int8))
    with pytest.raises(ValidationError, match="packed rows have 30 bytes"):
        lookup_rows(ids, table[:, :30].contiguous())
    with pytest.raises(ValidationError, match=r"columns \[col_begin, col_end\) = \[2, 4\)"):
        lookup_rows(ids, table, col_begin=2, col_end=4)
    with pytest.raises(ValidationError, match=r"out is torch.bfloat16 \(2, 3, 64\)"):
        lookup_rows(ids, table, out=torch.empty((2, 3, 64), dtype=torch.bfloat16, device=DEVICE))
