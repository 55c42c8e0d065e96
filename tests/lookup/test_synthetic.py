"""The synthetic tier: deterministic rows from ids, equal to the reference lookup of those rows."""

from __future__ import annotations

import torch

from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import SyntheticOptions, SyntheticRowStore, TablePlacement, make_store
from engramrt.lookup.tiers.synthetic import synthetic_packed_rows


def test_synthetic_rows_match_a_stored_copy(device) -> None:
    E, rows = 64, 5000
    table = synthetic_packed_rows(torch.arange(rows), E, seed=3)
    assert table.shape == (rows, E + 2) and table.dtype == torch.uint8
    assert len(torch.unique(table[:, :E])) > 200  # not degenerate
    assert int(table[:, E:].min()) >= 110 and int(table[:, E:].max()) <= 135
    stored = make_store(TablePlacement("device", device=device), packed=table)
    synthetic = SyntheticRowStore(rows, E, SyntheticOptions(seed=3), device=device)
    ids = torch.randint(0, rows, (9, 7), generator=torch.Generator().manual_seed(1)).to(device)
    want = lookup_rows_reference(ids.cpu(), table, E)
    for store in (stored, synthetic):
        assert torch.equal(store.lookup(ids).cpu().view(torch.int16), want.view(torch.int16))


def test_synthetic_shard_serves_its_columns_and_seed_matters(device) -> None:
    E = 32
    shard = SyntheticRowStore(100, E, device=device, row_begin=50, col_begin=1, col_end=3)
    whole = SyntheticRowStore(1000, E, SyntheticOptions(seed=0), device=device)
    other = SyntheticRowStore(1000, E, SyntheticOptions(seed=1), device=device)
    ids = torch.randint(50, 150, (4, 5), generator=torch.Generator().manual_seed(2)).to(device)
    got, full = shard.lookup(ids), whole.lookup(ids)
    assert torch.equal(got[:, 1:3].view(torch.int16), full[:, 1:3].view(torch.int16))
    assert bool((got[:, [0, 3, 4]].view(torch.int16) == 0).all())
    assert not torch.equal(full, other.lookup(ids))  # control: the seed selects the table
