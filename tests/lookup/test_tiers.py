"""Storage tiers: every tier returns the reference's bytes, checks capacity
before allocating, and rejects bad ids and arguments with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.helpers import CUDA, DEVICE, TIERS, assert_same_bits, random_packed_table, tier_store

from engramrt import memory
from engramrt.errors import CapacityError, CheckpointError, ValidationError
from engramrt.lookup import LookupKernelConfig, lookup_rows_reference
from engramrt.lookup.tiers import (
    DeviceOptions,
    DeviceRowStore,
    DiskRowStore,
    HostGatherRowStore,
    HostOptions,
    TablePlacement,
    UvaRowStore,
    make_store,
    tier_class,
)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    ("T", "C", "E", "id_dtype", "cols", "row_begin"),
    [
        (11, 5, 64, torch.int32, (0, None), 0),
        (7, 24, 256, torch.int64, (8, 16), 1_000_003),  # a tensor-parallel rank's shard
        (5, 3, 96, torch.int64, (2, 3), 2**33),  # ids past int32
    ],
)
def test_tier_matches_reference(
    tier: str,
    T: int,
    C: int,
    E: int,
    id_dtype: torch.dtype,
    cols: tuple[int, int | None],
    row_begin: int,
    tmp_path: Path,
) -> None:
    num_rows = 300
    table = random_packed_table(num_rows, E, seed=T + C)
    col_begin, col_end = cols
    store = tier_store(
        tier,
        table,
        tmp_path,
        row_begin=row_begin,
        col_begin=col_begin,
        col_end=col_end,
        **(dict(chunk_rows=8, num_threads=3) if tier in ("host", "disk") else {}),
    )
    assert store.tier == tier and store.num_rows == num_rows and store.E == E
    assert store.row_bytes == E + E // 32 and store.nbytes == num_rows * store.row_bytes
    assert store.row_end == row_begin + num_rows and store.device.type == DEVICE.type

    g = torch.Generator().manual_seed(E)
    row_ids = torch.randint(row_begin, row_begin + 40, (T, C), generator=g)  # many duplicates
    row_ids[0, :] = row_begin + num_rows - 1  # the shard's last row
    row_ids[:, :col_begin] = -7  # other shards' columns hold anything
    if col_end is not None:
        row_ids[:, col_end:] = 2**40
    if id_dtype == torch.int32:
        row_ids = row_ids.clamp(-(2**31), 2**31 - 1)
    row_ids = row_ids.to(id_dtype).to(DEVICE)
    expected = lookup_rows_reference(row_ids.cpu(), table, E, col_begin, col_end, row_begin)

    out = torch.full((T, C, E), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = store.lookup(row_ids, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_same_bits(got, expected)
    assert_same_bits(store.lookup(row_ids.cpu()), expected)  # ids from the host too


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(("chunk_rows", "num_threads"), [(1, 1), (5, 2), (10_000, 4)])
def test_host_gather_chunking(tier: str, chunk_rows: int, num_threads: int, tmp_path: Path) -> None:
    """Chunks smaller than, equal to and larger than the unique rows all agree."""
    table = random_packed_table(2000, 32, seed=12)
    store = tier_store(tier, table, tmp_path, chunk_rows=chunk_rows, num_threads=num_threads)
    row_ids = torch.randint(0, 2000, (37, 29), generator=torch.Generator().manual_seed(13))
    assert_same_bits(store.lookup(row_ids.to(DEVICE)), lookup_rows_reference(row_ids, table, 32))


def test_host_gather_staging_is_reused_and_grown() -> None:
    table = random_packed_table(500, 32, seed=14)
    store = make_store(TablePlacement(HostOptions(num_threads=2, chunk_rows=64)), packed=table)
    for t_len in (3, 50, 20):  # small, larger (grows the staging), small again
        row_ids = torch.randint(0, 500, (t_len, 7), generator=torch.Generator().manual_seed(t_len))
        assert_same_bits(
            store.lookup(row_ids.to(DEVICE)), lookup_rows_reference(row_ids, table, 32)
        )


@pytest.mark.parametrize("tier", TIERS)
def test_store_without_owned_columns_and_empty_batch(tier: str, tmp_path: Path) -> None:
    table = random_packed_table(20, 32, seed=16)
    store = tier_store(tier, table, tmp_path, col_begin=3, col_end=3)
    got = store.lookup(torch.full((4, 5), -1, dtype=torch.int64, device=DEVICE))
    assert got.shape == (4, 5, 32) and bool((got.view(torch.int16) == 0).all())
    assert store.lookup(torch.empty((0, 5), dtype=torch.int32, device=DEVICE)).shape == (0, 5, 32)


# --------------------------------------------------------------------------
# Disk files.
# --------------------------------------------------------------------------


def test_disk_tier_reads_a_file_written_elsewhere(tmp_path: Path) -> None:
    table = random_packed_table(123, 96, seed=17)
    path = tmp_path / "layer1.rows"
    path.write_bytes(table.numpy().tobytes())
    store = DiskRowStore(path, None, 96, row_begin=1000, col_begin=1, col_end=4, device=DEVICE)
    assert store.num_rows == 123
    row_ids = torch.randint(1000, 1123, (9, 4), generator=torch.Generator().manual_seed(18))
    expected = lookup_rows_reference(row_ids, table, 96, 1, 4, 1000)
    assert_same_bits(store.lookup(row_ids.to(DEVICE)), expected)
    with pytest.raises(ValidationError, match="opened read-only"):
        store.write_rows(0, table[:1])
    with pytest.raises(CheckpointError, match=r"has 12177 bytes; expected 124 rows x 99 B = 12276"):
        DiskRowStore(path, 124, 96)
    with pytest.raises(CheckpointError, match="expected a multiple of the 264-byte rows"):
        DiskRowStore(path, None, 256)
    with pytest.raises(CheckpointError, match="is not a file"):
        DiskRowStore(tmp_path / "missing.rows", None, 96)


def test_disk_tier_writes_in_pieces(tmp_path: Path) -> None:
    table = random_packed_table(50, 32, seed=19)
    path = tmp_path / "new.rows"
    store = DiskRowStore(path, 50, 32, create=True)
    store.write_rows(0, table[:20])
    store.write_rows(20, table[20:])
    store.flush()
    assert path.read_bytes() == table.numpy().tobytes()


# --------------------------------------------------------------------------
# Checked mode, capacity and argument errors.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_checked_mode_names_column_and_id(tier: str, tmp_path: Path) -> None:
    table = random_packed_table(10, 32, seed=20)
    store = tier_store(tier, table, tmp_path, row_begin=100, col_begin=1, check_ids=True)
    row_ids = torch.full((3, 5), 104, dtype=torch.int64, device=DEVICE)
    row_ids[:, 0] = -5  # not owned
    row_ids[1, 3] = 110
    with pytest.raises(
        ValidationError, match=r"row_ids\[1, 3\] = 110 for hash column 3; expected .* \[100, 110\)"
    ):
        store.lookup(row_ids)


@pytest.mark.parametrize("dedup_min_rows", [0, 10**9], ids=["dedup", "plain"])
@pytest.mark.parametrize("tier", TIERS)
def test_ids_outside_the_shard_read_as_zeros_unchecked(
    tier: str, dedup_min_rows: int, tmp_path: Path
) -> None:
    """One rule on every tier: with check_ids off an id outside the shard reads as a row of
    zeros (and the other rows are the reference's); with check_ids on it is refused
    (test_checked_mode_names_column_and_id)."""
    table = random_packed_table(10, 32, seed=21)
    store = tier_store(tier, table, tmp_path, row_begin=100, check_ids=False)
    if hasattr(store, "dedup_min_rows"):
        store.dedup_min_rows = dedup_min_rows  # both paths of the host gather
    elif dedup_min_rows:
        pytest.skip("one path on this tier")
    g = torch.Generator().manual_seed(24)
    for bad in (99, 110, -1, -(2**62), 2**62):
        row_ids = torch.randint(100, 110, (3, 5), generator=g).to(DEVICE)
        row_ids[2, 1] = bad
        row_ids[0, 4] = bad
        found = store.lookup(row_ids).cpu()
        assert not found[2, 1].view(torch.int16).any() and not found[0, 4].view(torch.int16).any()
        inside = row_ids.cpu().clamp(100, 109) - 100
        expected = lookup_rows_reference(inside, table, 32)
        expected[2, 1] = 0
        expected[0, 4] = 0
        assert_same_bits(found, expected)


@pytest.mark.parametrize("dedup_min_rows", [0, 10**9], ids=["dedup", "plain"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_host_tiers_with_and_without_deduplication(
    tier: str, dedup_min_rows: int, tmp_path: Path
) -> None:
    """Both paths of the host gather equal the reference, on a shard with repeated ids."""
    table = random_packed_table(300, 64, seed=22)
    store = tier_store(tier, table, tmp_path, row_begin=5000, col_begin=2, col_end=6, chunk_rows=7)
    store.dedup_min_rows = dedup_min_rows
    g = torch.Generator().manual_seed(23)
    row_ids = torch.randint(5000, 5040, (19, 8), generator=g)  # many duplicates
    row_ids[:, :2] = -1  # other shards' columns
    row_ids[:, 6:] = 2**40
    for dtype in (torch.int32, torch.int64):
        ids = row_ids.clamp(-(2**31), 2**31 - 1).to(dtype) if dtype == torch.int32 else row_ids
        expected = lookup_rows_reference(ids, table, 64, 2, 6, 5000)
        assert_same_bits(store.lookup(ids.to(DEVICE)), expected)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_batches_gathered_as_they_come_are_dequantised_piece_by_piece(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without deduplication a large batch is gathered and dequantised in pieces of
    whole tokens (chunk_rows // owned columns), ids outside the shard among them, and
    equals the reference; with it, one dequantisation serves the whole batch."""
    from engramrt.lookup.tiers import host_gather

    calls: list[int] = []
    real = host_gather.lookup_rows

    def counted(row_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(row_ids.shape[0])
        return real(row_ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(host_gather, "lookup_rows", counted)
    table = random_packed_table(300, 64, seed=25)
    g = torch.Generator().manual_seed(26)
    row_ids = torch.randint(5000, 5300, (19, 8), generator=g)
    row_ids[:, :2] = -1  # other shards' columns
    row_ids[3, 4] = 4999  # unchecked ids outside the shard read as zeros
    row_ids[17, 2] = 2**40
    expected = lookup_rows_reference(row_ids.clamp(5000, 5299), table, 64, 2, 6, 5000)
    expected[3, 4] = 0
    expected[17, 2] = 0
    for dedup, pieces in ((False, [2] * 9 + [1]), (True, [19])):
        store = tier_store(
            tier, table, tmp_path, row_begin=5000, col_begin=2, col_end=6, chunk_rows=9,
            dedup=dedup, check_ids=False,
        )  # fmt: skip
        store.dedup_min_rows = 1  # past the threshold: deduplicated unless dedup=False
        calls.clear()
        assert_same_bits(store.lookup(row_ids.to(DEVICE)), expected)
        assert calls == pieces, dedup


def test_capacity_errors_report_the_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 2000)
    monkeypatch.setattr(memory, "disk_free_bytes", lambda path: 3000)
    rows = 10**9  # 264 GB at E=256: absurd for every probe above
    with pytest.raises(
        CapacityError,
        match=r"tier='host' \(1000000000 rows of 264 B\) needs 264000000000 bytes \(245.87 GiB\) but host memory has only 1000 bytes",
    ):
        HostGatherRowStore(rows, 256)
    with pytest.raises(
        CapacityError,
        match=r"needs 264000000000 bytes .* only 2000 bytes" if CUDA else r"only 1000 bytes",
    ):
        DeviceRowStore(rows, 256)
    with pytest.raises(
        CapacityError,
        match=r"tier='disk' \(1000000000 rows of 264 B\) file .* but its file system has only 3000 bytes",
    ):
        DiskRowStore(tmp_path / "huge.rows", rows, 256, create=True)
    assert not (tmp_path / "huge.rows").exists()  # checked before creating anything
    with pytest.raises(
        CapacityError, match=r"tier='auto' needs 264000000000 bytes .* no path was given"
    ):
        make_store(TablePlacement("auto"), num_rows=rows, E=256)
    if CUDA:
        with pytest.raises(CapacityError, match=r"tier='uva' .* only 1000 bytes"):
            UvaRowStore(rows, 256)


def test_auto_tier_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    table = random_packed_table(40, 32, seed=22)
    assert make_store(TablePlacement("auto"), packed=table).tier == "device"
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 100)
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 100)
    store = make_store(TablePlacement("auto"), packed=table, path=tmp_path / "auto.rows")
    assert store.tier == "disk"
    row_ids = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(23))
    assert_same_bits(store.lookup(row_ids.to(DEVICE)), lookup_rows_reference(row_ids, table, 32))


@pytest.mark.skipif(CUDA, reason="checks the error raised on machines without a GPU")
def test_uva_refuses_cpu_only_machine() -> None:
    with pytest.raises(CapacityError, match=r"tier='uva' needs a CUDA device .* got device cpu"):
        UvaRowStore(10, 32)


def test_store_argument_errors(tmp_path: Path) -> None:
    table = random_packed_table(10, 64, seed=24)
    with pytest.raises(
        ValidationError,
        match="tier = 'gpu'; expected 'auto' or one of device, disk, host, synthetic, uva",
    ):
        TablePlacement("gpu")
    with pytest.raises(ValidationError, match="E = 32 but packed rows hold E = 64 values"):
        make_store(TablePlacement("host"), packed=table, E=32)
    with pytest.raises(
        ValidationError, match="rows of 48 values; expected a positive multiple of 32"
    ):
        make_store(TablePlacement("host"), num_rows=4, E=48)
    with pytest.raises(ValidationError, match="path = None"):
        make_store(TablePlacement("disk"), packed=table)
    store = make_store(TablePlacement("host"), packed=table)
    with pytest.raises(
        ValidationError, match=r"rows \[8, 12\) to write; expected a range inside \[0, 10\)"
    ):
        store.write_rows(8, table[:4])
    with pytest.raises(
        ValidationError, match=r"packed is torch.uint8 \(4, 33\); expected uint8 \[n, 66\]"
    ):
        store.write_rows(0, table[:4, :33])
    with pytest.raises(ValidationError, match=r"row_ids has dtype torch\.float32"):
        store.lookup(torch.zeros((2, 2)))
    with pytest.raises(ValidationError, match=r"out is torch.float32"):
        store.lookup(
            torch.zeros((2, 2), dtype=torch.int64), out=torch.empty((2, 2, 64), device=DEVICE)
        )
    with pytest.raises(ValidationError, match=r"HostOptions.chunk_rows = 0; expected an int >= 1"):
        HostOptions(chunk_rows=0)


@pytest.mark.parametrize("tier", TIERS)
def test_gather_packed_returns_the_stored_bytes(tier: str, tmp_path: Path) -> None:
    table = random_packed_table(300, 32, seed=21)
    store = tier_store(tier, table, tmp_path, row_begin=1000)
    local = torch.tensor([299, 0, 17, 17, 150])
    got = store.gather_packed(local)
    assert got.device == store.device and got.dtype == torch.uint8
    assert torch.equal(got.cpu(), table[local])


# --------------------------------------------------------------------------
# GPU reads of host rows (host tier): small batches by the lookup kernel,
# a share of a large batch's unique rows beside the CPU's gather.
# --------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not CUDA, reason="the GPU reads host memory mapped for it")


@needs_cuda
@pytest.mark.parametrize("gpu_share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dedup_min_rows", [0, 10**9], ids=["split", "direct"])
def test_gpu_reads_match_reference(gpu_share: float, dedup_min_rows: int, tmp_path: Path) -> None:
    """Both GPU-read paths equal the reference on a shard, with duplicates, int32 and
    int64 ids; an odd unique count splits unevenly."""
    table = random_packed_table(301, 256, seed=40)
    store = tier_store(
        "host",
        table,
        tmp_path,
        row_begin=7000,
        col_begin=1,
        col_end=5,
        chunk_rows=16,
        gpu_share=gpu_share,
    )
    assert isinstance(store, HostGatherRowStore) and store.gpu_reads
    store.dedup_min_rows = dedup_min_rows
    g = torch.Generator().manual_seed(41)
    row_ids = torch.randint(7000, 7301, (53, 6), generator=g)
    row_ids[0, 1:5] = torch.tensor([7000, 7300, 7300, 7150])  # first, last, duplicate
    row_ids[:, 0] = -1
    row_ids[:, 5:] = 2**40
    for dtype in (torch.int32, torch.int64):
        ids = row_ids.clamp(-(2**31), 2**31 - 1).to(dtype)
        expected = lookup_rows_reference(ids, table, 256, 1, 5, 7000)
        assert_same_bits(store.lookup(ids.to(DEVICE)), expected)
    assert torch.equal(store.gather_packed(torch.tensor([300, 0, 5])).cpu(), table[[300, 0, 5]])


@needs_cuda
def test_gpu_reads_check_ids_with_check_ids(tmp_path: Path) -> None:
    table = random_packed_table(10, 32, seed=42)
    store = tier_store("host", table, tmp_path, row_begin=100, check_ids=True)
    assert isinstance(store, HostGatherRowStore) and store.gpu_reads
    row_ids = torch.full((3, 5), 104, dtype=torch.int64, device=DEVICE)
    row_ids[2, 1] = 110
    with pytest.raises(ValidationError, match=r"row_ids\[2, 1\] = 110 for hash column 1"):
        store.lookup(row_ids)


@needs_cuda
def test_gpu_reads_fall_back_or_fail_when_registration_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = random_packed_table(10, 32, seed=43)
    monkeypatch.setattr(memory, "cuda_host_register", lambda *args, **kwargs: 2)
    with pytest.warns(RuntimeWarning, match=r"cudaError 2 .*; the CPU gathers every row"):
        store = make_store(TablePlacement("host"), packed=table)
    assert isinstance(store, HostGatherRowStore) and not store.gpu_reads
    row_ids = torch.randint(0, 10, (4, 3), device=DEVICE)
    assert_same_bits(store.lookup(row_ids), lookup_rows_reference(row_ids.cpu(), table, 32))
    with pytest.raises(CapacityError, match=r"tier='host' could not page-lock .* cudaError 2"):
        make_store(TablePlacement(HostOptions(gpu_reads=True)), packed=table)


def test_gpu_reads_settings(tmp_path: Path) -> None:
    """Off by default where they cannot or should not run; bad settings are refused."""
    table = random_packed_table(10, 32, seed=44)
    disk = tier_store("disk", table, tmp_path)
    reference = make_store(TablePlacement(HostOptions(backend="reference")), packed=table)
    assert isinstance(disk, HostGatherRowStore) and not disk.gpu_reads  # pinning a file: never
    assert isinstance(reference, HostGatherRowStore) and not reference.gpu_reads
    host = make_store(TablePlacement("host"), packed=table)
    assert isinstance(host, HostGatherRowStore) and host.gpu_reads == CUDA
    with pytest.raises(ValidationError, match=r"gpu_share = 1.5; expected a fraction in \[0, 1\]"):
        HostOptions(gpu_share=1.5)
    if CUDA:
        with pytest.raises(ValidationError, match="gpu_reads=True with backend='reference'"):
            make_store(
                TablePlacement(HostOptions(gpu_reads=True, backend="reference")), packed=table
            )
    else:
        with pytest.raises(
            CapacityError, match=r"gpu_reads=True needs a CUDA device .* got device cpu"
        ):
            make_store(TablePlacement(HostOptions(gpu_reads=True)), packed=table)


@needs_cuda
@pytest.mark.parametrize("tier", ["uva", "host"])
def test_host_memory_reads_with_few_programs(tier: str) -> None:
    """The kernel's reads of host memory from a bounded grid give the same bytes."""
    table = random_packed_table(300, 256, seed=45)  # 16 rows per tile: 14 tiles, 2 programs
    options = tier_class(tier).options_type(kernel=LookupKernelConfig(max_programs=3))  # type: ignore[call-arg]
    store = make_store(TablePlacement(options), packed=table)
    row_ids = torch.randint(0, 300, (37, 6), device=DEVICE)
    expected = lookup_rows_reference(row_ids.cpu(), table, 256)
    assert_same_bits(store.lookup(row_ids), expected)
    store.kernel = store.kernel.replace(max_programs=None)  # read at every lookup
    assert_same_bits(store.lookup(row_ids), expected)


def test_kernel_settings_of_a_store_are_checked() -> None:
    table = random_packed_table(10, 32, seed=46)
    with pytest.raises(ValidationError, match=r"max_programs = 0; expected None or an int >= 1"):
        HostOptions(kernel=LookupKernelConfig(max_programs=0))
    store = make_store(TablePlacement("host"), packed=table)
    with pytest.raises(ValidationError, match=r"max_programs = 0; expected None or an int >= 1"):
        store.kernel = store.kernel.replace(max_programs=0)  # checked before it is set
    with pytest.raises(ValidationError, match=r"kernel = \{'max_programs': 3\}; expected a Lookup"):
        DeviceOptions(kernel={"max_programs": 3})  # type: ignore[arg-type]


def test_host_tier_keeps_its_bounded_grid_by_default() -> None:
    from engramrt.lookup.tiers.host_gather import HOST_READ_KERNEL

    table = random_packed_table(10, 32, seed=47)
    assert make_store(TablePlacement("host"), packed=table).kernel == HOST_READ_KERNEL
    assert HOST_READ_KERNEL.max_programs is not None
    assert make_store(TablePlacement("device"), packed=table).kernel == LookupKernelConfig()


@pytest.mark.parametrize("dedup", [True, False])
def test_an_empty_host_shard_reads_zeros(dedup: bool) -> None:
    """A shard of no rows: every unchecked id is outside it, on both gather paths."""
    options = HostOptions(check_ids=False, dedup=dedup, gpu_reads=False)
    store = make_store(TablePlacement(options, DEVICE), num_rows=0, E=32)
    store.dedup_min_rows = 1  # past the threshold: deduplicated unless dedup=False
    found = store.lookup(torch.tensor([[5, 7], [1, 2]], device=DEVICE))
    assert found.shape == (2, 2, 32) and not found.view(torch.int16).any()


@pytest.mark.parametrize("dedup_min_rows", [0, 10**9], ids=["dedup", "plain"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_host_tiers_take_row_ids_on_the_host(
    tier: str, dedup_min_rows: int, tmp_path: Path
) -> None:
    """Row ids given on the host (``host_ids``) read the reference's rows, ids outside the
    shard as zeros, whatever the deduplication setting; on a GPU without waiting for it."""
    table = random_packed_table(300, 64, seed=27)
    store = tier_store(
        tier, table, tmp_path, row_begin=5000, col_begin=2, col_end=6, chunk_rows=9,
        check_ids=False,
    )  # fmt: skip
    assert store.host_ids
    store.dedup_min_rows = dedup_min_rows
    g = torch.Generator().manual_seed(28)
    row_ids = torch.randint(5000, 5300, (19, 8), generator=g)
    row_ids[:, :2] = -1  # other shards' columns
    expected = lookup_rows_reference(row_ids, table, 64, 2, 6, 5000)
    mode = torch.cuda.get_sync_debug_mode() if CUDA else 0
    if CUDA:
        torch.cuda.set_sync_debug_mode("error")  # a host wait on the device raises
    try:
        found = store.lookup(row_ids)
    finally:
        if CUDA:
            torch.cuda.set_sync_debug_mode(mode)
    assert found.device == store.device
    assert_same_bits(found, expected)
    row_ids[3, 4] = 4999  # unchecked ids outside the shard read as zeros
    expected[3, 4] = 0
    assert_same_bits(store.lookup(row_ids), expected)
    if CUDA:  # negative control: ids on the device make the CPU's gather wait for them
        store.use_gpu_reads(False)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):
                store.lookup(row_ids.clamp(5000).to(DEVICE))
        finally:
            torch.cuda.set_sync_debug_mode(mode)
