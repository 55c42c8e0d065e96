"""The tier registry behind make_store, options checked by the tier, and the two
check flags: validate (host metadata, never synchronises) and check_ids (ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers import DEVICE, assert_same_bits, random_packed_table

from engramrt.errors import ValidationError
from engramrt.lookup import lookup_rows, lookup_rows_reference
from engramrt.lookup.tiers import TIERS, RowStore, make_store, register_tier, tier_class
from engramrt.lookup.tiers import base as tiers_base


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, type[RowStore]]:
    """A copy of the registry that a test may add to."""
    registry = dict(TIERS)
    monkeypatch.setattr(tiers_base, "TIERS", registry)
    return registry


def define_reference_tier() -> type[RowStore]:
    class ReferenceRowStore(RowStore):
        """Rows in a CPU tensor, served by the reference lookup."""

        tier = "reference-test"

        def __init__(self, num_rows: int, E: int, *, label: str = "", **common: Any) -> None:
            super().__init__(num_rows, E, **common)
            self.label = label
            self.rows = torch.zeros((num_rows, self.row_bytes), dtype=torch.uint8)

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


def test_a_registered_tier_serves_through_make_store(
    scratch_registry: dict[str, type[RowStore]],
) -> None:
    cls = register_tier(define_reference_tier())
    assert scratch_registry["reference-test"] is cls and tier_class("reference-test") is cls
    table = random_packed_table(30, 64, seed=1)
    store = make_store(
        "reference-test", packed=table, device=DEVICE, row_begin=5, col_begin=1, label="x"
    )
    assert isinstance(store, cls) and store.label == "x"  # type: ignore[attr-defined]
    row_ids = torch.randint(5, 35, (7, 4), generator=torch.Generator().manual_seed(2))
    expected = lookup_rows_reference(row_ids, table, 64, 1, None, 5)
    assert_same_bits(store.lookup(row_ids.to(DEVICE)), expected)
    with pytest.raises(
        ValidationError,
        match=r"option\(s\) chunk_rows for tier='reference-test'; expected some of label, "
        r"device, row_begin, col_begin, col_end, validate, check_ids",
    ):
        make_store("reference-test", packed=table, chunk_rows=3)


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


def test_unknown_tiers_and_options_are_named() -> None:
    table = random_packed_table(10, 32, seed=3)
    with pytest.raises(
        ValidationError, match="tier = 'hbm'; expected 'auto' or one of device, disk, host, "
    ):
        make_store("hbm", packed=table)
    with pytest.raises(
        ValidationError,
        match=r"option\(s\) chunk_rows, gpu_share for tier='device'; expected some of backend, "
        r"kernel, device, row_begin, col_begin, col_end, validate, check_ids",
    ):
        make_store("device", packed=table, chunk_rows=4, gpu_share=0.5)
    assert set(TIERS) >= {"device", "uva", "host", "disk", "synthetic"}
    assert "host_rows" not in TIERS["disk"].options()  # the disk tier maps its own file


def test_validate_checks_metadata_and_check_ids_checks_content() -> None:
    """With validate on and check_ids off, ids of any content pass (read as zeros); the
    metadata is still refused. check_ids refuses the content."""
    table = random_packed_table(10, 32, seed=4)
    store = make_store("device", packed=table, row_begin=100, backend="triton")
    garbage = torch.tensor([[-(2**62), 2**62, 7]], device=DEVICE)  # no id of this shard
    assert not store.lookup(garbage).view(torch.int16).any()
    with pytest.raises(ValidationError, match=r"row_ids has dtype torch.float32; expected"):
        store.lookup(garbage.float())
    with pytest.raises(ValidationError, match=r"row_ids has shape \(3,\); expected \[T, C\]"):
        store.lookup(garbage[0])
    store.check_ids = True
    with pytest.raises(ValidationError, match=r"row_ids\[0, 0\] = -4611686018427387904 "):
        store.lookup(garbage)
    checked = make_store("device", packed=table, row_begin=100, check_ids=True)
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
    store = make_store("device", packed=table, device="cuda")
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
    from engramrt.lookup.tiers import HostGatherRowStore, MappedFileRows, PrivateHostRows

    table = random_packed_table(40, 64, seed=7)
    private = make_store("host", packed=table, device="cpu", gpu_reads=False)
    assert isinstance(private, HostGatherRowStore)
    assert isinstance(private.host_rows, PrivateHostRows)
    assert private.source.numel() == 40 * 66  # no rounding up

    path = tmp_path / "rows.bin"
    in_file = make_store(
        "host", packed=table, device="cpu", host_rows=MappedFileRows(path, create=True)
    )
    assert path.read_bytes() == table.numpy().tobytes()  # written through and flushed
    row_ids = torch.randint(0, 40, (5, 3), generator=torch.Generator().manual_seed(8))
    assert_same_bits(in_file.lookup(row_ids), lookup_rows_reference(row_ids, table, 64))

    read_only = make_store("host", num_rows=40, E=64, device="cpu", host_rows=MappedFileRows(path))
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
    assert (CachedRowStore.host_sync, CachedRowStore.has_update) == (True, True)
