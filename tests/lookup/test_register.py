"""Host memory registered for CUDA in pieces: the pieces cover the range exactly, never
share a page, and a store over them reads and writes every row as one range."""

from __future__ import annotations

import itertools

import pytest
import torch
from tests.helpers import CUDA, DEVICE, assert_same_bits, random_packed_table

from engramrt import memory
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import HostOptions, TablePlacement, UvaOptions, make_store

GIB = 1 << 30


@pytest.mark.parametrize(
    ("pointer", "nbytes", "cpus"),
    [
        (4096 * 3, 16 * GIB + 5, 16),
        (64, 3 * GIB, 16),  # an allocation not on a page
        (123_456_789, 100 * GIB, 16),
        (0, GIB + 100, 16),  # one piece: below two pieces' worth
        (1 << 21, 40 * GIB, 4),  # as many pieces as CPUs
    ],
)
def test_register_spans_cover_the_range_on_page_bounds(
    pointer: int, nbytes: int, cpus: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    spans = memory.register_spans(pointer, nbytes)
    assert spans[0][0] == pointer
    assert sum(size for _, size in spans) == nbytes
    for (address, size), (following, _) in itertools.pairwise(spans):
        assert address + size == following  # contiguous, no overlap
        assert following % (1 << 21) == 0  # on a huge page bound: no page in two pieces
    expected = max(1, min(cpus, nbytes // memory.REGISTER_PIECE_BYTES))
    assert len(spans) == expected


@pytest.mark.skipif(not CUDA, reason="registers host memory with CUDA")
@pytest.mark.parametrize(
    "options", [HostOptions(gpu_reads=True), UvaOptions()], ids=["host", "uva"]
)
def test_a_table_registered_in_pieces_reads_and_writes_as_one(
    options: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows written from the device across piece bounds, then read by the GPU across
    them, equal the reference (one CUDA copy may not span two registrations)."""
    monkeypatch.setattr(memory, "REGISTER_PIECE_BYTES", 4 << 20)
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: set(range(8)))
    num_rows = (40 << 20) // 264  # ten 4 MiB pieces of 264-byte rows
    table = random_packed_table(num_rows, 256, seed=3)
    store = make_store(TablePlacement(options, device=DEVICE), num_rows=num_rows, E=256)  # type: ignore[arg-type]
    store.write_rows(0, table.to(DEVICE))  # one write across every piece
    g = torch.Generator().manual_seed(4)
    row_ids = torch.randint(0, num_rows, (64, 24), generator=g)
    row_ids[0] = torch.arange(24) * (num_rows // 24)  # rows in every piece
    assert_same_bits(store.lookup(row_ids.to(DEVICE)), lookup_rows_reference(row_ids, table, 256))


def test_mapped_rows_view_reads_the_same_rows_as_another_dtype() -> None:
    """The word view the gathers read: same address and rows, the new element type."""
    from engramrt.lookup.mapped import MappedHostRows

    rows = MappedHostRows(0x7F00_0000_1000, 123)
    words = rows.view(torch.int64)
    assert (words.data_ptr(), words.num_rows, words.dtype) == (rows.data_ptr(), 123, torch.int64)
    assert rows.dtype == torch.uint8  # the original is untouched
