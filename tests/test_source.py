"""The RowSource contract: every store is a source, flags say how it may run, and the
runtime's scheduling follows the flags alone."""

from __future__ import annotations

import pytest
import torch
from tests.layer.common import CONFIG, full_store, layer_table, random_row_ids, shard_store

from engramrt.cache import CachedRowStore
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import TablePlacement, make_store
from engramrt.runtime.runtime import worker_plan
from engramrt.source import PendingRows, RowSource

CPU = torch.device("cpu")


class _Flags(RowSource):
    """A source that only carries flags (for the scheduling rule)."""

    def __init__(self, host_sync: bool = False, collective: bool = False) -> None:
        self.host_sync, self.collective, self.E, self.device = host_sync, collective, 8, CPU

    def fetch(self, row_ids, out=None):  # pragma: no cover - never called
        raise AssertionError("not fetched")


def test_store_flags_say_how_each_tier_runs(tmp_path) -> None:
    table = layer_table()[:4096]
    device = make_store(TablePlacement("device", device=CPU), packed=table)
    host = make_store(TablePlacement("host", device=CPU), packed=table)
    disk = make_store(TablePlacement("disk", device=CPU), packed=table, path=tmp_path / "t.rows")
    cache = CachedRowStore(device, 64 * 1024)
    assert (device.host_sync, device.has_update, device.collective) == (False, False, False)
    assert (host.host_sync, host.has_update) == (True, False)
    assert (disk.host_sync, disk.has_update) == (True, False)
    assert (cache.host_sync, cache.has_update) == (True, True)
    for store in (device, host, disk, cache):
        assert isinstance(store, RowSource)


def test_start_without_a_stream_writes_the_rows_now() -> None:
    table = layer_table()
    store = full_store(table, CPU)
    row_ids = random_row_ids(9, seed=4)
    out = torch.full((9, CONFIG.n_cols, CONFIG.head_dim), float("nan"), dtype=torch.bfloat16)
    pending = store.start(row_ids, out)
    assert isinstance(pending, PendingRows) and pending.num_tokens == 9
    assert pending.event is None and pending.future is None
    rows = pending.wait()
    assert rows.data_ptr() == out.data_ptr()
    want = lookup_rows_reference(row_ids, table, CONFIG.head_dim)
    assert torch.equal(rows.view(torch.int16), want.view(torch.int16))


def test_served_columns_of_a_shard_and_of_a_whole_table() -> None:
    table = layer_table()
    assert full_store(table, CPU).served_columns(CONFIG.n_cols) == (0, CONFIG.n_cols)
    assert shard_store(table, 2, 1, CPU).served_columns(CONFIG.n_cols) == (6, 12)


@pytest.mark.parametrize(
    ("flags", "plan"),
    [
        ([(False, False), (False, False)], {}),  # both on the side stream
        ([(True, False), (False, False)], {0: 0}),  # a host tier gets its own worker
        ([(True, False), (True, False)], {0: 0, 1: 1}),
        ([(False, True), (False, True)], {}),  # collectives on the stream, in order
        ([(True, True), (False, True)], {0: -1, 1: -1}),  # one shared worker keeps the order
        ([(True, True), (True, False)], {0: -1, 1: 1}),
    ],
)
def test_worker_plan_follows_the_flags(flags, plan) -> None:
    sources = [_Flags(host_sync=h, collective=c) for h, c in flags]
    assert worker_plan(sources) == plan


def test_negative_control_collectives_on_their_own_workers_would_reorder() -> None:
    """What the shared worker prevents: per-layer workers for two collective sources
    would let each rank issue the two layers' collectives in either order."""
    sources = [_Flags(host_sync=True, collective=True), _Flags(host_sync=True, collective=True)]
    plan = worker_plan(sources)
    assert len(set(plan.values())) == 1  # one thread: one order on every rank
