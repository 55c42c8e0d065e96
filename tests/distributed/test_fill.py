"""The parallel fill writes exactly the synthetic rows; the placement helpers report honestly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramrt import memory
from engramrt.distributed import SharedHostTable
from engramrt.distributed.fill import (
    advise_hugepages,
    bind_rows,
    fill_synthetic_rows,
    hugepage_state,
    memory_policy,
    numa_nodes,
    synthetic_loader,
    synthetic_rows_numpy,
)
from engramrt.errors import ValidationError
from engramrt.lookup.tiers.synthetic import synthetic_packed_rows


def _reference(first: int, count: int, E: int, seed: int) -> torch.Tensor:
    return synthetic_packed_rows(torch.arange(first, first + count), E, seed)


@pytest.mark.parametrize("seed", [0, 5, -3])
@pytest.mark.parametrize(
    ("first", "count"),
    [(0, 1), (123, 37), (2**31 - 40, 80), (384_016_682 - 9, 9), (2**40 + 11, 13)],
)
def test_numpy_rows_equal_the_torch_definition(seed: int, first: int, count: int) -> None:
    expected = _reference(first, count, 256, seed).numpy()
    assert np.array_equal(synthetic_rows_numpy(first, count, 256, seed), expected)


def test_numpy_rows_other_head_dim_and_empty() -> None:
    assert np.array_equal(synthetic_rows_numpy(7, 11, 64, 2), _reference(7, 11, 64, 2).numpy())
    assert synthetic_rows_numpy(7, 0, 64).shape == (0, 66)


@pytest.mark.parametrize(
    ("num_rows", "threads", "block_rows"), [(1, 4, None), (1001, 3, 64), (4099, 8, 100)]
)
def test_parallel_fill_is_bit_exact(num_rows: int, threads: int, block_rows: int | None) -> None:
    target = torch.full((num_rows, 264), 0xA5, dtype=torch.uint8)  # poisoned
    stats = fill_synthetic_rows(
        target, 256, seed=4, row_begin=1_000_003, num_threads=threads, block_rows=block_rows
    )
    assert torch.equal(target, _reference(1_000_003, num_rows, 256, 4))
    assert (stats.num_rows, stats.nbytes, stats.num_threads) == (num_rows, num_rows * 264, threads)


def test_fill_control_other_seed_or_offset_differs() -> None:
    """The comparison above can fail: another seed or row offset gives other bytes."""
    target = torch.empty((300, 264), dtype=torch.uint8)
    fill_synthetic_rows(target, 256, seed=4, row_begin=10, num_threads=2)
    assert not torch.equal(target, _reference(10, 300, 256, 5))
    assert not torch.equal(target, _reference(11, 300, 256, 4))


def test_fill_view_of_a_larger_tensor_and_empty() -> None:
    whole = torch.zeros((50, 264), dtype=torch.uint8)
    fill_synthetic_rows(whole[10:20], 256, row_begin=10, num_threads=3)
    assert torch.equal(whole[10:20], _reference(10, 10, 256, 0))
    assert not whole[:10].any() and not whole[20:].any()  # nothing outside the range
    assert fill_synthetic_rows(whole[:0], 256).num_rows == 0


@pytest.mark.parametrize(
    ("target", "kwargs", "message"),
    [
        (torch.empty((4, 263), dtype=torch.uint8), {}, r"\[num_rows, 264\] uint8"),
        (torch.empty((4, 264), dtype=torch.int16), {}, "expected a contiguous"),
        (torch.empty((264, 4), dtype=torch.uint8).t(), {}, "not contiguous"),
        (torch.empty((4, 264), dtype=torch.uint8), {"num_threads": 0}, "num_threads=0"),
        (torch.empty((4, 264), dtype=torch.uint8), {"row_begin": -1}, "row_begin=-1"),
        (torch.empty((4, 264), dtype=torch.uint8), {"device": "meta"}, "device='meta'"),
        (torch.empty((4, 264), dtype=torch.uint8), {"block_rows": 0}, "block_rows=0"),
        (torch.empty((4, 264), dtype=torch.uint8), {"copy": "dma"}, "copy='dma'; expected"),
    ],
)
def test_fill_refuses_bad_arguments(target, kwargs, message) -> None:
    with pytest.raises(ValidationError, match=message):
        fill_synthetic_rows(target, 256, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("copy", ["staged", "direct"])
def test_cuda_fill_is_bit_exact(copy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of copying a GPU fill out; the direct one over a target registered in
    pieces that blocks and rows straddle, then unregistered (registering it again works)."""
    monkeypatch.setattr(memory, "REGISTER_PIECE_BYTES", 4 << 20)
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: set(range(8)))
    target = torch.full((40_000, 264), 0xA5, dtype=torch.uint8)  # 10 MiB: two pieces
    assert len(memory.register_spans(target.data_ptr(), target.numel())) == 2
    fill_synthetic_rows(
        target, 256, seed=2, row_begin=77, device="cuda", block_rows=3001, copy=copy
    )
    assert torch.equal(target, _reference(77, 40_000, 256, 2))
    owner = type("Owner", (), {})()
    assert memory.cuda_host_register(owner, target) == 0  # the fill left it unregistered
    del owner


def test_loader_publishes_the_synthetic_rows(tmp_path) -> None:
    stats: list = []
    loader = synthetic_loader(256, 3, row_begin=500, num_threads=2, hugepages=True, stats=stats)
    table = SharedHostTable.create_or_attach("fill-test", 777, 264, loader, directory=tmp_path)
    assert table.created and table.shared and len(stats) == 1
    assert torch.equal(table.rows, _reference(500, 777, 256, 3))
    del table
    SharedHostTable.remove("fill-test", tmp_path)


def test_sparse_reservation_publishes_the_same_rows(tmp_path) -> None:
    """reserve="truncate": the fill's writers allocate the pages; the table is the same."""
    loader = synthetic_loader(256, 6, num_threads=3)
    table = SharedHostTable.create_or_attach(
        "fill-sparse", 1234, 264, loader, directory=tmp_path, reserve="truncate"
    )
    assert table.created and torch.equal(table.rows, _reference(0, 1234, 256, 6))
    again = SharedHostTable.attach("fill-sparse", 1234, 264, directory=tmp_path)
    assert torch.equal(again.rows, table.rows)
    del table, again
    SharedHostTable.remove("fill-sparse", tmp_path)
    with pytest.raises(ValidationError, match="reserve='lazy'; expected 'fallocate' or"):
        SharedHostTable.create_or_attach(
            "fill-sparse", 4, 264, loader, directory=tmp_path, reserve="lazy"
        )


def test_memory_policy_and_hugepage_reports() -> None:
    nodes = numa_nodes()
    assert nodes and all(node >= 0 for node in nodes)
    for mode in ("interleave", "bind"):
        with memory_policy(mode) as outcome:
            assert outcome.startswith(("applied", "not applied"))
            rows = torch.ones((1000, 264), dtype=torch.uint8)  # allocation works either way
            assert int(rows.sum()) == 264_000
    with memory_policy("none") as outcome:
        assert outcome == "none"
    with pytest.raises(ValidationError, match="mode='spread'"), memory_policy("spread"):
        pass
    with pytest.raises(ValidationError, match="nodes=\\[-1\\]"), memory_policy("bind", [-1]):
        pass
    rows = torch.zeros((4096, 264), dtype=torch.uint8)
    for mode in ("interleave", "bind"):
        assert bind_rows(rows, mode).startswith(("applied", "not applied"))
        assert int(rows.sum()) == 0  # the bytes are untouched
    assert bind_rows(rows, "none") == "none" and bind_rows(rows[:0], "bind") == "empty"
    with pytest.raises(ValidationError, match="mode='spread'"):
        bind_rows(rows, "spread")
    with pytest.raises(ValidationError, match="mode='spread'"):
        synthetic_loader(256, numa=("spread", None))
    assert advise_hugepages(rows) == "ok" or advise_hugepages(rows).startswith("madvise")
    assert advise_hugepages(rows[:0]) == "empty"
    state = hugepage_state("/")
    assert {"thp_enabled", "thp_shmem_enabled", "meminfo_bytes", "directory_mount"} <= set(state)


def test_hugepage_state_reports_the_mount_on_top(monkeypatch: pytest.MonkeyPatch) -> None:
    """A remounted directory is listed twice in /proc/mounts; the later line is in force."""
    from engramrt.distributed import fill

    mounts = (
        "tmpfs /dev/shm tmpfs rw,size=100k 0 0\n"
        "tmpfs /dev/shm/x tmpfs rw,size=5k 0 0\n"
        "tmpfs /dev/shm tmpfs rw,size=200k,huge=always 0 0\n"
    )
    real = fill._read
    monkeypatch.setattr(
        fill, "_read", lambda path: mounts if path == "/proc/mounts" else real(path)
    )
    monkeypatch.setattr(fill.Path, "resolve", lambda self: self)
    assert hugepage_state("/dev/shm")["directory_mount"]["options"] == "rw,size=200k,huge=always"
