"""Rows of any format through every tier: a store built with ``row_format=BF16`` keeps and
gathers its rows bit for bit (rows of any width, words of any size), sizes its file by
the format's row bytes, refuses rows of another size, and refuses the fp8 lookup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.helpers import CUDA, DEVICE, TIERS, random_bf16_rows, random_packed_table

from engramrt.errors import CheckpointError, ValidationError
from engramrt.family import BF16, FP8_UE8M0
from engramrt.lookup import gather_packed_rows_reference
from engramrt.lookup.tiers import (
    DiskRowStore,
    RowStore,
    SyntheticRowStore,
    TablePlacement,
    make_store,
    tier_class,
)
from engramrt.packed import word_dtype_for

WIDTHS = [1, 7, 12, 160]
"""bf16 row widths: 2-, 14-, 24- and 320-byte rows (int16 words, 7 int16 words, 3 int64
words, 40 int64 words: none a power of two but the first)."""


def bf16_store(tier: str, rows: torch.Tensor, tmp_path: Path, **options: object) -> RowStore:
    """A ``tier`` store (its options class made from ``options``) of bf16 rows ``rows``
    (bytes) from ``make_store``."""
    return make_store(
        TablePlacement(tier_class(tier).options_type(**options), DEVICE),  # type: ignore[arg-type]
        packed=rows,
        row_format=BF16,
        path=tmp_path / f"{tier}.rows",
    )


def test_row_format_inverse_and_words() -> None:
    for width in (1, 7, 12, 160):
        assert BF16.width_for(BF16.row_bytes(width)) == width
    assert FP8_UE8M0.width_for(264) == 256 and FP8_UE8M0.width_for(33) == 32
    for fmt, bad in ((BF16, 321), (BF16, 0), (FP8_UE8M0, 320), (FP8_UE8M0, 32)):
        with pytest.raises(ValidationError, match=rf"rows of {bad} bytes; expected {fmt.name}"):
            fmt.width_for(bad)
    # The widest word dividing a row: what the host gather and the copy kernels read.
    words = {2: torch.int16, 14: torch.int16, 12: torch.int32, 16: torch.int64}
    words |= {24: torch.int64, 264: torch.int64, 320: torch.int64}
    for row_bytes, dtype in words.items():
        assert word_dtype_for(row_bytes) == dtype, row_bytes


@pytest.mark.parametrize("width", [1, 3, 6, 7, 8, 12, 160])
def test_gather_kernel_copies_rows_of_any_size(width: int) -> None:
    """The raw-row copy kernel (device, UVA and host GPU reads, cache fills) over bf16 rows:
    repeats, any order, ids outside the table (rows of zeros), an empty batch."""
    from engramrt.lookup.kernel import gather_packed_rows_triton

    rows = random_bf16_rows(37, width, seed=width)
    table = rows.to(DEVICE)
    row_begin = 1000
    ids = torch.tensor([1036, 1000, 1017, 1017, 999, 1037, 1003, -1, 1036], device=DEVICE)
    out = torch.full((ids.shape[0], rows.shape[1]), 0xA5, dtype=torch.uint8, device=DEVICE)
    words = table.view(word_dtype_for(rows.shape[1]))
    got = gather_packed_rows_triton(ids, words, out, row_begin=row_begin, num_rows=37)
    expected = gather_packed_rows_reference(ids.cpu(), rows, row_begin)
    assert torch.equal(got.cpu(), expected)
    inside = torch.tensor([0, 1, 2, 3, 6, 8])
    assert torch.equal(got.cpu()[inside], rows[ids.cpu()[inside] - row_begin])
    assert not got.cpu()[[4, 5, 7]].any()  # outside the table: zeros
    empty = torch.empty((0, rows.shape[1]), dtype=torch.uint8, device=DEVICE)
    assert gather_packed_rows_triton(ids[:0], words, empty, num_rows=37).shape == (0, 2 * width)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("width", WIDTHS)
def test_tiers_keep_and_gather_bf16_rows(tier: str, width: int, tmp_path: Path) -> None:
    rows = random_bf16_rows(53, width, seed=100 + width)
    store = bf16_store(tier, rows, tmp_path)
    assert store.row_format == BF16
    assert (store.E, store.row_bytes, store.nbytes) == (width, 2 * width, 53 * 2 * width)
    g = torch.Generator().manual_seed(width)
    for ids in (
        torch.randint(0, 53, (40,), generator=g),  # repeats, any order
        torch.tensor([52, 0, 52, 26, 1]),
        torch.arange(53).flip(0),
        torch.empty(0, dtype=torch.int64),
    ):
        got = store.gather_packed(ids)
        assert got.device == store.device and got.dtype == torch.uint8
        assert torch.equal(got.cpu(), rows[ids])
        # As values: the same bf16 bits (bit patterns, NaNs included).
        values = got.cpu().view(torch.bfloat16).view(torch.int16)
        assert torch.equal(values, rows[ids].view(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(not CUDA, reason="the GPU's reads and the pinned staging need a GPU")
@pytest.mark.parametrize("gpu_reads", [True, False], ids=["gpu-reads", "cpu-gather"])
def test_host_tier_paths_over_bf16_rows(gpu_reads: bool, tmp_path: Path) -> None:
    """Both of the host tier's gathers on a GPU: the device's reads of mapped host memory,
    and the CPU's gather into pinned staging in pieces of 7 rows."""
    rows = random_bf16_rows(301, 160, seed=8)
    store = bf16_store("host", rows, tmp_path, gpu_reads=gpu_reads, chunk_rows=7)
    ids = torch.randint(0, 301, (100,), generator=torch.Generator().manual_seed(9))
    assert torch.equal(store.gather_packed(ids.to(DEVICE)).cpu(), rows[ids])
    assert torch.equal(store.gather_packed(ids).cpu(), rows[ids])  # ids on the host


@pytest.mark.parametrize("tier", TIERS)
def test_written_pieces_and_a_corrupted_byte_show(tier: str, tmp_path: Path) -> None:
    """Rows written in pieces land where they belong; a byte changed in the store shows in
    that row's gather and nowhere else (the comparison can fail)."""
    rows = random_bf16_rows(20, 12, seed=3)
    store = make_store(
        TablePlacement(tier, DEVICE),
        num_rows=20,
        E=12,
        row_format=BF16,
        path=tmp_path / f"{tier}.rows",
        new_file=True,
    )
    store.write_rows(13, rows[13:])
    store.write_rows(0, rows[:13])
    every = torch.arange(20)
    assert torch.equal(store.gather_packed(every).cpu(), rows)
    changed = rows[5:6].clone()
    changed[0, 17] ^= 0x40
    store.write_rows(5, changed)
    got = store.gather_packed(every).cpu()
    assert not torch.equal(got, rows)
    assert (got != rows).nonzero().tolist() == [[5, 17]]


def test_disk_file_is_sized_by_the_format(tmp_path: Path) -> None:
    rows = random_bf16_rows(7, 160, seed=4)
    path = tmp_path / "ple.rows"
    make_store(TablePlacement("disk"), packed=rows, row_format=BF16, path=path)
    assert path.stat().st_size == 7 * 320
    reopened = DiskRowStore(path, None, 160, row_format=BF16)
    assert reopened.num_rows == 7
    assert torch.equal(reopened.gather_packed(torch.arange(7)).cpu(), rows)
    with pytest.raises(
        CheckpointError,
        match=r"has 2240 bytes; expected a multiple of the 24-byte rows \(bf16 rows of width 12\)",
    ):
        DiskRowStore(path, None, 12, row_format=BF16)
    with pytest.raises(
        CheckpointError, match=r"expected 8 rows x 320 B = 2560 bytes \(bf16 rows of width 160\)"
    ):
        DiskRowStore(path, 8, 160, row_format=BF16)
    with pytest.raises(CheckpointError, match=r"multiple of the 264-byte rows \(fp8-ue8m0-32"):
        DiskRowStore(path, None, 256)  # the default format: fp8 rows of 264 B


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_rows_of_the_wrong_size_are_refused(tier: str, tmp_path: Path) -> None:
    rows = random_bf16_rows(6, 160, seed=5)
    store = bf16_store(tier, rows, tmp_path)
    fp8_rows = random_packed_table(6, 256, seed=6)  # 264 B
    with pytest.raises(
        ValidationError,
        match=r"packed is torch.uint8 \(6, 264\); expected uint8 \[n, 320\] \(bf16 rows of "
        r"width 160\)",
    ):
        store.write_rows(0, fp8_rows)
    with pytest.raises(ValidationError, match="E = 12 but packed rows hold E = 160 values"):
        make_store(TablePlacement(tier), packed=rows, E=12, row_format=BF16, path=tmp_path / "b")
    with pytest.raises(ValidationError, match=r"rows of 321 bytes; expected bf16 rows"):
        make_store(
            TablePlacement(tier),
            packed=torch.zeros((2, 321), dtype=torch.uint8),
            row_format=BF16,
            path=tmp_path / "c",
        )
    with pytest.raises(ValidationError, match=r"row_format = 'bf16'; expected a RowFormat"):
        make_store(TablePlacement(tier), num_rows=2, E=8, row_format="bf16")  # type: ignore[arg-type]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("validate", [True, False])
def test_the_fp8_lookup_refuses_bf16_rows(tier: str, validate: bool, tmp_path: Path) -> None:
    """bf16 rows of width 132 are 264 bytes, as fp8 rows of E = 256: the byte count cannot
    tell them apart, the store's format does, whatever the checks are set to."""
    rows = random_bf16_rows(9, 132, seed=7)
    store = bf16_store(tier, rows, tmp_path, validate=validate)
    assert store.validate is validate
    assert store.row_bytes == FP8_UE8M0.row_bytes(256)
    ids = torch.zeros((2, 3), dtype=torch.int64, device=DEVICE)
    with pytest.raises(
        ValidationError,
        match=r"lookup\(\) on \w+ \(tier='\w+'\) of bf16 rows of width 132; the lookup kernel "
        r"dequantises fp8-ue8m0-32 rows: expected a store of row_format=FP8_UE8M0, or read "
        r"these rows with gather_packed\(\)",
    ):
        store.lookup(ids)
    # The same bytes as fp8 rows of E = 256: a lookup (the control: it runs).
    fp8_store = make_store(TablePlacement(tier, DEVICE), packed=rows, path=tmp_path / "fp8")
    assert fp8_store.row_format == FP8_UE8M0 and fp8_store.E == 256
    assert fp8_store.lookup(ids).shape == (2, 3, 256)


def test_the_synthetic_tier_holds_fp8_rows_only() -> None:
    with pytest.raises(
        ValidationError,
        match=r"row_format = 'bf16' for tier='synthetic'; expected one it can hold "
        r"\(fp8-ue8m0-32\)",
    ):
        SyntheticRowStore(10, 160, row_format=BF16, device="cpu")
    assert SyntheticRowStore(10, 256, device="cpu").row_bytes == 264
