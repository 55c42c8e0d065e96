"""Every lookup-kernel variant the benchmarks sweep writes the reference's bytes.

The decode-read and device-rate sweeps of :mod:`engramrt.bench.cases_lookup`
(tile, warps, bounded grid, pipelining, cache operator) run here through the
interpreter at small shapes with odd sizes, owned and non-owned columns,
ids outside the shard, an empty batch and a poisoned output larger than the
batch; the cached launcher and the plain ``kernel[grid]`` path alike.
"""

from __future__ import annotations

import re

import pytest
import torch
from tests.helpers import DEVICE, assert_same_bits, random_packed_table
from tests.lookup.test_lookup import random_ids

from engramrt.bench.cases_lookup import (
    DECODE_READ_SWEEP,
    DEVICE_RATE_SWEEP,
    HOST_GATHER_SWEEP,
    kernel_label,
)
from engramrt.errors import ValidationError
from engramrt.lookup import LookupKernelConfig, lookup_rows, lookup_rows_reference
from engramrt.lookup.tiers import DeviceOptions, HostOptions, TablePlacement, make_store

E = 256  # the sweeps are meant for V4.1 rows (264 bytes)
NUM_ROWS, ROW_BEGIN = 53, 1_000
SWEEP = [
    pytest.param(kernel, id=kernel_label(kernel))
    for kernel in dict.fromkeys((*DECODE_READ_SWEEP, *DEVICE_RATE_SWEEP))
    if not (kernel.hw_convert and not torch.cuda.is_available())  # see test_lookup.py
]


def shard_ids(num_tokens: int, num_cols: int, seed: int) -> torch.Tensor:
    """``[T, C]`` int32 ids of the shard, with ids below it, just past it and far
    past it at a few places (all read as rows of zeros)."""
    ids = random_ids((num_tokens, num_cols), ROW_BEGIN, ROW_BEGIN + NUM_ROWS, torch.int32, seed)
    if num_tokens >= 3:
        ids[0, 2] = ROW_BEGIN - 1
        ids[1, 3] = ROW_BEGIN + NUM_ROWS
        ids[2, 4] = 2**31 - 1
        ids[2, 5] = ROW_BEGIN + NUM_ROWS - 1  # the last row
    return ids


@pytest.fixture(scope="module")
def table() -> torch.Tensor:
    return random_packed_table(NUM_ROWS, E, seed=77).to(DEVICE)


@pytest.mark.parametrize("kernel", SWEEP)
def test_sweep_variant_writes_the_reference_bytes(
    kernel: LookupKernelConfig, table: torch.Tensor
) -> None:
    """19 tokens x 7 columns (133 lookups: a partial tile for every tile size), columns
    [1, 6) owned, out a slice of a NaN buffer with a padding row past the batch."""
    num_tokens, num_cols = 19, 7
    row_ids = shard_ids(num_tokens, num_cols, seed=5).to(DEVICE)
    expected = lookup_rows_reference(row_ids, table, E, 1, 6, ROW_BEGIN)
    assert bool((expected[0, 2] == 0).all()) and bool((expected[0, 0] == 0).all())
    buffer = torch.full(
        (num_tokens + 1, num_cols, E), float("nan"), dtype=torch.bfloat16, device=DEVICE
    )
    got = lookup_rows(
        row_ids,
        table,
        col_begin=1,
        col_end=6,
        row_begin=ROW_BEGIN,
        out=buffer[:num_tokens],
        backend="triton",
        kernel=kernel,
    )
    assert got.data_ptr() == buffer.data_ptr()
    assert_same_bits(got, expected)
    assert bool(buffer[num_tokens].isnan().all())  # nothing written past the batch
    if kernel.max_programs is not None:  # programs looping over several tiles, too
        buffer.fill_(float("nan"))
        looped = kernel.replace(max_programs=2)
        lookup_rows(
            row_ids,
            table,
            col_begin=1,
            col_end=6,
            row_begin=ROW_BEGIN,
            out=buffer[:num_tokens],
            backend="triton",
            kernel=looped,
        )
        assert_same_bits(buffer[:num_tokens], expected)
        assert bool(buffer[num_tokens].isnan().all())


@pytest.mark.parametrize("kernel", SWEEP[:3] + SWEEP[8:10])
def test_sweep_variant_with_an_empty_batch(kernel: LookupKernelConfig, table: torch.Tensor) -> None:
    """Zero tokens into the front of a poisoned buffer: nothing is written. The control,
    one token through the same buffer, is written with the reference's bytes (computed
    from the packed table in the test) and leaves the row after it poisoned."""
    poison = 0x7FA5  # a NaN payload the kernel never writes (its NaN is 0x7FC0)
    buffer = torch.full((2, 24, E), poison, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    row_ids = torch.empty((0, 24), dtype=torch.int32, device=DEVICE)
    got = lookup_rows(
        row_ids, table, row_begin=ROW_BEGIN, out=buffer[:0], backend="triton", kernel=kernel
    )
    assert (got.shape, got.dtype) == ((0, 24, E), torch.bfloat16)
    assert bool((buffer.view(torch.int16) == poison).all()), "an empty batch wrote rows"
    one = shard_ids(1, 24, seed=8).to(DEVICE)
    lookup_rows(one, table, row_begin=ROW_BEGIN, out=buffer[:1], backend="triton", kernel=kernel)
    assert_same_bits(buffer[:1], lookup_rows_reference(one, table, E, 0, 24, ROW_BEGIN))
    assert bool((buffer[1].view(torch.int16) == poison).all())


def test_the_sweep_can_fail(table: torch.Tensor) -> None:
    """Negative control: the bytes compared above differ for a shifted shard."""
    row_ids = shard_ids(5, 7, seed=6).to(DEVICE)
    got = lookup_rows(row_ids, table, row_begin=ROW_BEGIN, backend="triton")
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_bits(got, lookup_rows_reference(row_ids, table, E, 0, 7, ROW_BEGIN + 1))


@pytest.mark.parametrize("cached_launch", [True, False])
def test_launch_path_is_switchable(
    cached_launch: bool, table: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel goes through the cached launcher unless ``cached_launch=False``; the
    same bytes either way."""
    import engramrt.lookup.kernel as lookup_kernel

    calls = []
    launcher = lookup_kernel._launch_lookup_rows

    def recording(*args: object, **kwargs: object) -> None:
        calls.append(args[0])
        launcher(*args, **kwargs)

    monkeypatch.setattr(lookup_kernel, "_launch_lookup_rows", recording)
    row_ids = shard_ids(9, 6, seed=7).to(DEVICE)
    got = lookup_rows(
        row_ids,
        table,
        row_begin=ROW_BEGIN,
        backend="triton",
        kernel=LookupKernelConfig(rows_per_program=4, cached_launch=cached_launch),
    )
    assert_same_bits(got, lookup_rows_reference(row_ids, table, E, 0, 6, ROW_BEGIN))
    assert calls == ([(14,)] if cached_launch else [])  # 54 lookups in tiles of 4


@pytest.mark.parametrize("kernel", [SWEEP[1], SWEEP[9]])
def test_store_kernel_variant(kernel: LookupKernelConfig, table: torch.Tensor) -> None:
    """A store's ``kernel`` attribute, as the bench sets it, changes no byte."""
    placement = TablePlacement(DeviceOptions(backend="triton"), device=DEVICE)
    store = make_store(placement, packed=table.cpu())
    store.kernel = kernel  # read at every lookup
    row_ids = random_ids((11, 24), 0, NUM_ROWS, torch.int64, seed=8).to(DEVICE)
    assert_same_bits(store.lookup(row_ids), lookup_rows_reference(row_ids, table, E))


@pytest.mark.parametrize(("chunk_rows", "num_threads", "dedup"), HOST_GATHER_SWEEP)
def test_host_gather_settings_change_no_byte(
    chunk_rows: int, num_threads: int | None, dedup: bool, table: torch.Tensor
) -> None:
    """The host tier's gather settings of the bench sweep (every id twice, deduplicated
    or not) give the reference's bytes."""
    options = HostOptions(chunk_rows=chunk_rows, num_threads=num_threads, gpu_reads=False)
    store = make_store(TablePlacement(options, device=DEVICE), packed=table.cpu())
    store.dedup_min_rows = 0 if dedup else 1 << 62
    half = random_ids((13, 12), 0, NUM_ROWS, torch.int64, seed=9)
    row_ids = torch.cat([half, half.flip(0)], dim=1).to(DEVICE)
    assert_same_bits(store.lookup(row_ids), lookup_rows_reference(row_ids, table, E))


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [
        ("num_stages", 0, "expected None or an int >= 1"),
        ("num_stages", 2.0, "expected None or an int >= 1"),
        ("cache_modifier", ".cs", "expected one of '', '.ca', '.cg', '.cv'"),
        ("cache_modifier", None, "expected one of '', '.ca', '.cg', '.cv'"),
        ("cached_launch", 0, "expected a bool"),
    ],
)
def test_new_settings_name_the_bad_field(field: str, bad: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=rf"^{field} = {re.escape(repr(bad))}; {expected}"):
        LookupKernelConfig(**{field: bad})  # type: ignore[arg-type]


def test_labels_tell_the_variants_apart() -> None:
    labels = [kernel_label(k) for k in (*DECODE_READ_SWEEP, *DEVICE_RATE_SWEEP)]
    assert len(set(labels)) == len(dict.fromkeys((*DECODE_READ_SWEEP, *DEVICE_RATE_SWEEP)))
    assert kernel_label(LookupKernelConfig(32, 8, max_programs=16, num_stages=4)) == (
        "rows=32,warps=8,programs=16,stages=4"
    )


def test_hw_convert_resolves_by_platform() -> None:
    """None: the conversion instructions on a GPU, integer operations in the
    interpreter (whose casts are not the GPU's); True and False force one."""
    assert LookupKernelConfig().resolved_hw_convert(interpreted=False) is True
    assert LookupKernelConfig().resolved_hw_convert(interpreted=True) is False
    for forced in (True, False):
        settings = LookupKernelConfig(hw_convert=forced)
        assert settings.resolved_hw_convert(interpreted=False) is forced
        assert settings.resolved_hw_convert(interpreted=True) is forced


def test_uva_tier_defaults_to_its_bounded_grid() -> None:
    from engramrt.lookup.settings import tuned_lookup_config
    from engramrt.lookup.tiers.uva import UVA_KERNEL

    assert tuned_lookup_config("uva") == UVA_KERNEL
    assert UVA_KERNEL.max_programs is not None and UVA_KERNEL.max_programs >= 1
