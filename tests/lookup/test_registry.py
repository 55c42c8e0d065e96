"""The tier registry behind make_store, each tier beside its options class (frozen,
checked when made), the placement value, and the two check flags: validate (host
metadata, never synchronises) and check_ids (ids)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.helpers import DEVICE, assert_same_bits, random_packed_table

from engramrt.errors import ValidationError
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.lookup import lookup_rows, lookup_rows_reference
from engramrt.lookup.tiers import (
    TIERS,
    DeviceOptions,
    DiskOptions,
    HostGatherRowStore,
    HostOptions,
    PrivateHostRows,
    RowStore,
    SyntheticOptions,
    TablePlacement,
    TierOptions,
    UvaOptions,
    make_store,
    register_tier,
    tier_class,
)
from engramrt.lookup.tiers import base as tiers_base


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, type[RowStore]]:
    """A copy of the registry that a test may add to."""
    registry = dict(TIERS)
    monkeypatch.setattr(tiers_base, "TIERS", registry)
    return registry


@dataclass(frozen=True)
class ReferenceOptions(TierOptions):
    tier = "reference-test"
    label: str = ""

    def _check(self) -> None:
        if not isinstance(self.label, str):
            raise self.error("label", "a str")


def define_reference_tier() -> type[RowStore]:
    class ReferenceRowStore(RowStore):
        """Rows in a CPU tensor, served by the reference lookup."""

        tier = "reference-test"
        options_type = ReferenceOptions

        def _setup(self) -> None:
            assert isinstance(self.options, ReferenceOptions)
            self.label = self.options.label
            self.rows = torch.zeros((self.num_rows, self.row_bytes), dtype=torch.uint8)

        def _write(self, start: int, packed: torch.Tensor) -> None:
            self.rows[start : start + packed.shape[0]].copy_(packed)

        def _lookup(
            self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
        ) -> torch.Tensor:
            rows = lookup_rows_reference(
                row_ids.cpu(), self.rows, self.E, self.col_begin, col_end, self.row_begin
            ).to(self.device)
            return rows if out is None else out.copy_(rows)

    return ReferenceRowStore


def rows_from(row_begin: int, num_rows: int, col_begin: int = 0, col_end: int = 24) -> ColumnShard:
    """A shard of rows ``[row_begin, row_begin + num_rows)`` serving columns ``[col_begin, col_end)``."""
    return ColumnShard(0, 1, col_begin, col_end, row_begin, row_begin + num_rows)


def test_a_registered_tier_serves_through_make_store(
    scratch_registry: dict[str, type[RowStore]],
) -> None:
    cls = register_tier(define_reference_tier())
    assert scratch_registry["reference-test"] is cls and tier_class("reference-test") is cls
    assert cls.options_type.tier == "reference-test"  # the options say which tier
    table = random_packed_table(30, 64, seed=1)
    placement = TablePlacement(ReferenceOptions(label="x"), device=DEVICE)
    store = make_store(placement, packed=table, shard=rows_from(5, 30, col_begin=1, col_end=4))
    assert isinstance(store, cls) and store.label == "x"  # type: ignore[attr-defined]
    row_ids = torch.randint(5, 35, (7, 4), generator=torch.Generator().manual_seed(2))
    expected = lookup_rows_reference(row_ids, table, 64, 1, None, 5)
    assert_same_bits(store.lookup(row_ids.to(DEVICE)), expected)
    assert make_store(TablePlacement("reference-test"), packed=table).label == ""  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match=r"ReferenceOptions.label = 3; expected a str"):
        ReferenceOptions(label=3)  # type: ignore[arg-type]


def test_registering_a_taken_name_or_no_name_is_refused(
    scratch_registry: dict[str, type[RowStore]],
) -> None:
    register_tier(define_reference_tier())
    with pytest.raises(ValidationError, match="tier 'reference-test' of ReferenceRowStore is "):
        register_tier(define_reference_tier())

    class Nameless(RowStore):
        pass

    with pytest.raises(ValidationError, match=r"Nameless.tier = None; expected the tier's own"):
        register_tier(Nameless)  # type: ignore[type-abstract]

    class Unconfigured(RowStore):
        tier = "unconfigured-test"
        options_type = DeviceOptions  # another tier's options

    with pytest.raises(
        ValidationError,
        match=r"Unconfigured.options_type = .*DeviceOptions.*; expected its own TierOptions "
        r"subclass whose tier is 'unconfigured-test'",
    ):
        register_tier(Unconfigured)  # type: ignore[type-abstract]


def test_unknown_tiers_and_wrong_options_are_named() -> None:
    table = random_packed_table(10, 32, seed=3)
    with pytest.raises(
        ValidationError, match="tier = 'hbm'; expected 'auto' or one of device, disk, host, "
    ):
        TablePlacement("hbm")
    with pytest.raises(ValidationError, match=r"placement = 'device'; expected a TablePlacement"):
        make_store("device", packed=table)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chunk_rows"):
        DeviceOptions(chunk_rows=4)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"options = HostOptions\(.*\) for DeviceRowStore; "):
        tier_class("device")(10, 32, HostOptions())
    assert set(TIERS) >= {"device", "uva", "host", "disk", "synthetic"}
    assert {name: cls.options_type for name, cls in TIERS.items()} == {
        "device": DeviceOptions,
        "uva": UvaOptions,
        "host": HostOptions,
        "disk": DiskOptions,
        "synthetic": SyntheticOptions,
    }
    assert not TIERS["disk"].takes_host_rows  # the disk tier maps its own file
    with pytest.raises(
        ValidationError, match=r"host_rows = .* for tier='device'; expected a tier "
    ):
        tier_class("device")(10, 32, host_rows=PrivateHostRows())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: HostOptions(chunk_rows=0), r"HostOptions.chunk_rows = 0; expected an int >= 1"),
        (lambda: HostOptions(num_threads=0), r"HostOptions.num_threads = 0; expected an int >= 1 "),
        (lambda: HostOptions(gpu_reads=1), r"HostOptions.gpu_reads = 1; expected None, True or"),
        (lambda: DiskOptions(gpu_share=-0.5), r"DiskOptions.gpu_share = -0.5; expected a fraction"),
        (lambda: HostOptions(dedup=1), r"HostOptions.dedup = 1; expected True or False"),
        (lambda: DiskOptions(writable="yes"), r"DiskOptions.writable = 'yes'; expected True or"),
        (lambda: DeviceOptions(backend="cuda"), r"DeviceOptions.backend = 'cuda'; expected 'auto'"),
        (lambda: DeviceOptions(validate=None), r"DeviceOptions.validate = None; expected True or"),
        (lambda: UvaOptions(backend="reference"), r"UvaOptions.backend = 'reference'; expected 'a"),
        (lambda: SyntheticOptions(seed=-1), r"SyntheticOptions.seed = -1; expected an int >= 0"),
        (lambda: TablePlacement(tp=0), r"TablePlacement.tp = 0; expected an int >= 1"),
        (lambda: TablePlacement(tp=2, rank=2), r"TablePlacement.rank = 2; expected 0 <= rank <"),
        (lambda: TablePlacement(HostOptions), r"TablePlacement.tier = <class .*; expected 'auto'"),
        (
            lambda: TablePlacement("host", "tpu"),
            r"^TablePlacement\.device='tpu' is not a device; expected cpu, cuda or cuda:N$",
        ),
        (
            lambda: TablePlacement("host", ""),
            r"^TablePlacement\.device='' is not a device; expected cpu, cuda or cuda:N$",
        ),
        (
            lambda: TablePlacement("host", 5),
            r"^TablePlacement\.device=5 \(int\); expected a device: cpu, cuda or cuda:N$",
        ),
        (
            lambda: TablePlacement("host", "meta"),
            r"^TablePlacement\.device='meta': engramrt runs on cpu, cuda or cuda:N, not 'meta'$",
        ),
        (
            lambda: TablePlacement("host", torch.device("meta")),
            r"^TablePlacement\.device=device\(type='meta'\): engramrt runs on .*, not 'meta'$",
        ),
        (
            lambda: TablePlacement("disk", "cpu", disk_dir=5),
            r"^TablePlacement\.disk_dir = 5; expected None or a directory path",
        ),
        (
            lambda: TablePlacement("disk", "cpu", disk_dir=""),
            r"^TablePlacement\.disk_dir = ''; expected None or a directory path",
        ),
    ],
)
def test_options_and_placements_are_checked_when_made(make: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make()  # type: ignore[operator]


def test_a_cuda_device_this_machine_lacks_is_refused_when_made() -> None:
    """Not a raw AssertionError at the first lookup: the placement names the device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
            with pytest.raises(
                ValidationError, match=r"^TablePlacement\.device=.* but no CUDA device is visible"
            ):
                TablePlacement("host", device)
    else:
        assert TablePlacement("host", "cuda").compute_device.type == "cuda"
    with pytest.raises(
        ValidationError,
        match=rf"^TablePlacement\.device='cuda:{count + 7}' but (no CUDA device is visible|"
        rf"only {count} CUDA device\(s\) are visible)",
    ):
        TablePlacement("host", f"cuda:{count + 7}")


def test_options_and_placements_are_frozen_values() -> None:
    options = HostOptions(num_threads=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_threads = 3  # type: ignore[misc]
    assert options == HostOptions(num_threads=2) and hash(options) == hash(
        HostOptions(num_threads=2)
    )
    placement = TablePlacement(options, device="cpu", tp=2, rank=1, disk_dir="rows")
    assert placement.tier_name == "host" and placement.device == torch.device("cpu")
    assert placement.tier_options(10**12) is options  # given options are never re-resolved
    assert placement.disk_path(7) == Path("rows") / "engram-layer7-rank1-of-2.rows"


def test_auto_is_resolved_by_the_placement() -> None:
    placement = TablePlacement(device="cpu")
    assert placement.tier_options(1024) == DeviceOptions()  # fits in memory
    assert placement.tier_options(None, "file.rows") == DiskOptions()  # sized by the file
    assert TablePlacement("host").tier_options(1024) == HostOptions()


def test_a_shard_of_another_rank_is_refused() -> None:
    from engramrt.config import load_config

    layout = EngramLayout(load_config("tiny"))
    placement = TablePlacement("device", device="cpu", tp=2, rank=1)
    shard = placement.shard(layout, 0)
    store = make_store(placement, E=64, shard=shard)
    assert (store.row_begin, store.num_rows, store.col_begin) == (
        shard.row_begin,
        shard.num_rows,
        shard.col_begin,
    )
    with pytest.raises(ValidationError, match=r"shard is rank 0 of tp=2; expected the placement"):
        make_store(placement, E=64, shard=layout.column_shard(0, 2, 0))
    with pytest.raises(ValidationError, match=r"shard = None with a placement of rank 1 of tp=2"):
        make_store(placement, num_rows=4, E=64)


def test_validate_checks_metadata_and_check_ids_checks_content() -> None:
    """With validate on and check_ids off, ids of any content pass (read as zeros); the
    metadata is still refused. check_ids refuses the content."""
    table = random_packed_table(10, 32, seed=4)
    shard = rows_from(100, 10, col_end=3)
    placement = TablePlacement(DeviceOptions(backend="triton"))
    store = make_store(placement, packed=table, shard=shard)
    garbage = torch.tensor([[-(2**62), 2**62, 7]], device=DEVICE)  # no id of this shard
    assert not store.lookup(garbage).view(torch.int16).any()
    with pytest.raises(ValidationError, match=r"row_ids has dtype torch.float32; expected"):
        store.lookup(garbage.float())
    with pytest.raises(ValidationError, match=r"row_ids has shape \(3,\); expected \[T, C\]"):
        store.lookup(garbage[0])
    store.check_ids = True
    with pytest.raises(ValidationError, match=r"row_ids\[0, 0\] = -4611686018427387904 "):
        store.lookup(garbage)
    checked = make_store(TablePlacement(DeviceOptions(check_ids=True)), packed=table, shard=shard)
    with pytest.raises(ValidationError, match=r"expected a row of this shard, in \[100, 110\)"):
        checked.lookup(garbage)


def test_validate_off_skips_the_metadata_checks() -> None:
    table = random_packed_table(10, 32, seed=5).to(DEVICE)
    ids = torch.tensor([[1, 2]], device=DEVICE)
    out = torch.empty((1, 2, 32), dtype=torch.bfloat16, device=DEVICE)
    wrong_out = torch.empty((1, 2, 32), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValidationError, match=r"out is torch\.float32"):
        lookup_rows(ids, table, out=wrong_out)
    assert lookup_rows(ids, table, out=out, validate=False) is out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="synchronisation is a CUDA notion")
def test_validated_lookups_never_synchronise() -> None:
    table = random_packed_table(100, 256, seed=6)
    store = make_store(TablePlacement("device", device="cuda"), packed=table)
    ids = torch.randint(0, 100, (16, 24), device="cuda")
    out = torch.empty((16, 24, 256), dtype=torch.bfloat16, device="cuda")
    store.lookup(ids, out=out)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        store.lookup(ids, out=out)
        lookup_rows(ids, store.table, out=out)  # type: ignore[attr-defined]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_host_rows_are_injected(tmp_path: Path) -> None:
    """The host tier over its own allocation (exactly the rows' bytes), over a
    memory-mapped file, and refusing writes to rows it may not write."""
    from engramrt.lookup.tiers import MappedFileRows

    table = random_packed_table(40, 64, seed=7)
    private = make_store(TablePlacement(HostOptions(gpu_reads=False), device="cpu"), packed=table)
    assert isinstance(private, HostGatherRowStore)
    assert isinstance(private.host_rows, PrivateHostRows)
    assert private.source.numel() == 40 * 66  # no rounding up

    path = tmp_path / "rows.bin"
    in_file = HostGatherRowStore(40, 64, host_rows=MappedFileRows(path, create=True), device="cpu")
    in_file.write_rows(0, table)
    in_file.flush()
    assert path.read_bytes() == table.numpy().tobytes()  # written through and flushed
    row_ids = torch.randint(0, 40, (5, 3), generator=torch.Generator().manual_seed(8))
    assert_same_bits(in_file.lookup(row_ids), lookup_rows_reference(row_ids, table, 64))

    read_only = HostGatherRowStore(40, 64, host_rows=MappedFileRows(path), device="cpu")
    assert torch.equal(read_only.source, table)  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match=r"opened read-only; expected writable=True"):
        read_only.write_rows(0, table[:1])


def test_capability_flags_of_every_tier() -> None:
    """What a scheduler reads instead of the class: which tiers make the host wait."""
    from engramrt.cache import CachedRowStore

    flags = {name: (cls.host_sync, cls.has_update, cls.collective) for name, cls in TIERS.items()}
    assert flags == {
        "device": (False, False, False),
        "uva": (False, False, False),
        "synthetic": (False, False, False),
        "host": (True, False, False),
        "disk": (True, False, False),
    }
    backing = TIERS["device"](4, 32, device="cpu")
    cache = CachedRowStore(backing, 2**16, backend="reference")
    assert (cache.host_sync, cache.has_update) == (True, True)
