"""Ids outside a table, with checks off: every path reads them as rows of zeros
(the reference's definition) and never reads outside the table."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import DEVICE, assert_same_bits, random_packed_table
from tests.lookup.stores import store_of

from engramrt.cache import SetAssociativeLfu, probe_gather_reference
from engramrt.errors import ValidationError
from engramrt.lookup import gather_packed_rows_reference, lookup_rows, lookup_rows_reference
from engramrt.lookup.tiers import DeviceOptions, SyntheticRowStore
from engramrt.packed import unpack_rows, word_dtype_for
from engramrt.quant import dequantize_rows_reference

INT32_MAX = 2**31 - 1


def ids_with_bad_ones(
    shape: tuple[int, int], row_begin: int, num_rows: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random in-table ids with out-of-table ones at random places: negative, the
    first past the table, one below it, 10**6 past it and int32's maximum.
    Returns the ids and the mask of the bad places."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(row_begin, row_begin + num_rows, shape, generator=g)
    bad_values = torch.tensor(
        [-1, -(2**31), row_begin + num_rows, row_begin - 1, row_begin + num_rows + 10**6, INT32_MAX]
    )
    bad = torch.zeros(shape, dtype=torch.bool)
    places = torch.randperm(ids.numel(), generator=g)[: 3 * bad_values.numel()]
    bad.view(-1)[places] = True
    ids.view(-1)[places] = bad_values.repeat(3)
    return ids.to(dtype), bad


def dequantised_rows(table: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Rows ``table[local]`` dequantised, without the lookup's code path."""
    values, scales = unpack_rows(table.index_select(0, local.reshape(-1)))
    return dequantize_rows_reference(values, scales).reshape(*local.shape, -1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("row_begin", [0, 1000])
def test_reference_reads_ids_outside_the_table_as_zero_rows(
    dtype: torch.dtype, row_begin: int
) -> None:
    num_rows, E = 37, 64
    table = random_packed_table(num_rows, E, seed=1)
    ids, bad = ids_with_bad_ones((19, 6), row_begin, num_rows, dtype, seed=2)
    got = lookup_rows_reference(ids, table, E, row_begin=row_begin)
    assert bad.any() and (~bad).any()
    assert torch.equal(got[bad].view(torch.int16), torch.zeros_like(got[bad].view(torch.int16)))
    # Control: the other ids read their table rows, computed without the lookup.
    expected = dequantised_rows(table, ids[~bad].to(torch.int64) - row_begin)
    assert_same_bits(got[~bad], expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("row_begin", "cols"), [(0, (0, None)), (1000, (1, 5))])
def test_kernel_masks_ids_outside_the_table(
    dtype: torch.dtype, row_begin: int, cols: tuple[int, int | None]
) -> None:
    num_rows, E = 37, 64
    table = random_packed_table(num_rows, E, seed=3).to(DEVICE)
    ids, bad = ids_with_bad_ones((23, 6), row_begin, num_rows, dtype, seed=4)
    col_begin, col_end = cols
    expected = lookup_rows_reference(ids, table.cpu(), E, col_begin, col_end, row_begin)
    out = torch.full((23, 6, E), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = lookup_rows(
        ids.to(DEVICE),
        table,
        col_begin=col_begin,
        col_end=col_end,
        row_begin=row_begin,
        out=out,
        backend="triton",
    )
    assert_same_bits(got, expected)
    owned = torch.zeros(6, dtype=torch.bool)
    owned[col_begin:col_end] = True
    inside = ~bad & owned
    assert_same_bits(
        got.cpu()[inside], dequantised_rows(table.cpu(), ids[inside].to(torch.int64) - row_begin)
    )
    assert not got.view(torch.int16).cpu()[bad].any()  # zeros at the bad places


def test_check_ids_still_rejects_them() -> None:
    table = random_packed_table(10, 32, seed=5).to(DEVICE)
    ids = torch.full((2, 3), 4, dtype=torch.int64, device=DEVICE)
    ids[1, 2] = 10**6
    lookup_rows(ids, table)  # unchecked: defined, zeros
    with pytest.raises(ValidationError, match=r"row_ids\[1, 2\] = 1000000 for hash column 2"):
        lookup_rows(ids, table, check_ids=True)


def test_empty_table_reads_zeros() -> None:
    table = random_packed_table(0, 32, seed=6).to(DEVICE)
    ids = torch.tensor([[0, 5], [-1, 2**40]], device=DEVICE)
    for backend in ("reference", "triton"):
        got = lookup_rows(ids, table, backend=backend)
        assert not got.view(torch.int16).any()


@pytest.mark.parametrize("row_begin", [0, 500])
def test_packed_gather_masks_ids_outside_the_table(row_begin: int) -> None:
    from engramrt.lookup.kernel import gather_packed_rows_triton

    num_rows, E = 29, 256
    table = random_packed_table(num_rows, E, seed=7).to(DEVICE)
    ids, bad = ids_with_bad_ones((41, 1), row_begin, num_rows, torch.int64, seed=8)
    ids, bad = ids[:, 0], bad[:, 0]
    expected = gather_packed_rows_reference(ids, table.cpu(), row_begin)
    assert not expected[bad].any()
    assert torch.equal(expected[~bad], table.cpu()[ids[~bad] - row_begin])  # control
    out = torch.full((41, table.shape[1]), 0xA5, dtype=torch.uint8, device=DEVICE)
    word = word_dtype_for(table.shape[1])
    got = gather_packed_rows_triton(
        ids.to(DEVICE), table.view(word), out, row_begin=row_begin, num_rows=num_rows
    )
    assert torch.equal(got.cpu(), expected)


def test_cache_probe_reading_misses_masks_ids_outside_the_backing() -> None:
    from engramrt.cache.kernel import probe_gather_triton

    num_rows, E, row_begin = 40, 64, 300
    backing = random_packed_table(num_rows, E, seed=9).to(DEVICE)
    policy = SetAssociativeLfu(4, 2, DEVICE)
    cache_rows = torch.zeros((policy.num_slots + 1, backing.shape[1]), dtype=torch.uint8)
    cache_rows = cache_rows.to(DEVICE)
    ids, bad = ids_with_bad_ones((9, 4), row_begin, num_rows, torch.int64, seed=10)
    ids = ids.to(DEVICE)
    poison = torch.full((9, 4, E), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out_ref, out_kernel = poison.clone(), poison.clone()
    geometry = dict(num_sets=policy.num_sets, ways=policy.ways, col_begin=0, col_end=4)
    slots_ref = probe_gather_reference(
        ids,
        policy.tags,
        cache_rows,
        out_ref,
        backing=backing,
        backing_row_begin=row_begin,
        **geometry,
    )
    slots = torch.full((9, 4), -99, dtype=torch.int64, device=DEVICE)
    probe_gather_triton(
        ids,
        policy.tags,
        cache_rows,
        out_kernel,
        slots,
        backing=backing,
        backing_row_begin=row_begin,
        **geometry,
    )
    assert torch.equal(slots.cpu(), slots_ref.cpu())
    assert_same_bits(out_kernel, out_ref)
    assert not out_kernel.view(torch.int16).cpu()[bad].any()
    inside = ~bad
    expected = dequantised_rows(backing.cpu(), ids.cpu()[inside] - row_begin)
    assert_same_bits(out_kernel.cpu()[inside], expected)  # control: the backing's rows


@pytest.mark.parametrize("tier", ["device", "synthetic"])
def test_unchecked_store_lookup_is_defined(tier: str) -> None:
    """The device tier reads zeros; the synthetic tier computes any id's row."""
    table = random_packed_table(50, 32, seed=11)
    if tier == "device":
        store = store_of(DeviceOptions(backend="triton"), table, row_begin=7)
    else:
        store = SyntheticRowStore(50, 32, row_begin=7)
    ids, bad = ids_with_bad_ones((8, 3), 7, 50, torch.int64, seed=12)
    got = store.lookup(ids.to(DEVICE))
    if tier == "device":
        assert_same_bits(got, lookup_rows_reference(ids, table, 32, row_begin=7))
        assert not got.view(torch.int16).cpu()[bad].any()
    assert torch.isfinite(got.float()).all()
