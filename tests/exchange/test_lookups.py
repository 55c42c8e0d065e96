"""The TP all-gather and all-to-all exchanges in one process: the routing reference and a
world of one.

The multi-process runs are in tests/distributed/test_world.py; here the all-to-all routing
simulated over a list of shard stores equals the unsharded lookup for
worlds 1..4 (a different T per rank, 0 included), and the distributed
classes check their arguments before any collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests.distributed.common import (
    C6,
    C10,
    TINY,
    assert_same_bits,
    finite_packed_table,
    random_row_ids,
    reference_rows,
    shard_store,
)
from tests.helpers import switchable_gpu_reads

from engramrt.cache import CachedRowStore
from engramrt.errors import ShardingError, ValidationError
from engramrt.exchange import AllGatherExchange, AllToAllExchange, all_to_all_lookup_reference
from engramrt.layout import EngramLayout, owned_columns
from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store

CONFIGS = [TINY, C10]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("config", CONFIGS, ids=["tiny", "c10"])
def test_all_to_all_routing_equals_the_unsharded_lookup(config, world: int) -> None:
    stores = [shard_store(config, world, rank) for rank in range(world)]
    token_counts = [5, 0, 3, 8][:world]
    row_ids = [random_row_ids(config, n, seed=10 * world + r) for r, n in enumerate(token_counts)]
    results = all_to_all_lookup_reference(row_ids, stores, config.n_cols)
    for rank, (ids, rows) in enumerate(zip(row_ids, results, strict=True)):
        assert_same_bits(rows, reference_rows(config, ids), label=f"world {world} rank {rank}")


def test_all_to_all_routing_puts_each_owners_rows_in_its_columns() -> None:
    """Negative control: one owner serving other bytes changes exactly its columns."""
    layout = EngramLayout(TINY)
    stores = [shard_store(TINY, 2, rank) for rank in range(2)]
    shard = layout.column_shard(0, 2, 1)
    other = finite_packed_table(shard.num_rows, TINY.head_dim, seed=99)
    placement = TablePlacement(
        DeviceOptions(backend="reference"), device="cpu", tp=shard.tp, rank=shard.rank
    )
    stores[1] = make_store(placement, packed=other, shard=shard)
    row_ids = [random_row_ids(TINY, 4, seed=1), random_row_ids(TINY, 2, seed=2)]
    for ids, rows in zip(
        row_ids, all_to_all_lookup_reference(row_ids, stores, TINY.n_cols), strict=True
    ):
        expected = reference_rows(TINY, ids)
        own, theirs = slice(0, shard.col_begin), slice(shard.col_begin, shard.col_end)
        assert_same_bits(rows[:, own], expected[:, own], label="rank 0's columns")
        assert not torch.equal(rows[:, theirs], expected[:, theirs])
    with pytest.raises(ValidationError, match="3 batches for 2 stores"):
        all_to_all_lookup_reference([*row_ids, row_ids[0]], stores, TINY.n_cols)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
def test_owned_columns_cover_every_column_once(world: int) -> None:
    bounds = [owned_columns(TINY.n_cols, world, rank) for rank in range(world)]
    assert [c for c0, c1 in bounds for c in range(c0, c1)] == list(range(TINY.n_cols))
    assert all(c1 > c0 for c0, c1 in bounds)


def test_owned_columns_refuse_a_rank_without_columns() -> None:
    with pytest.raises(ShardingError, match=r"tp=4 leaves rank\(s\) \[3\] without a hash column"):
        owned_columns(C6.n_cols, 4, 0)


def test_lookups_need_initialised_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = shard_store(TINY, 1, 0)
    for cls in (AllGatherExchange, AllToAllExchange):
        with pytest.raises(ShardingError, match="not initialised"):
            cls(store, num_cols=TINY.n_cols)


def test_a_world_of_one_is_the_plain_lookup(world_of_one) -> None:
    row_ids = random_row_ids(C10, 5, seed=9)
    expected = reference_rows(C10, row_ids)
    for collective in ("all_gather", "all_reduce"):
        lookup = AllGatherExchange(
            shard_store(C10, 1, 0), num_cols=C10.n_cols, group=world_of_one, collective=collective
        )
        assert (lookup.tp, lookup.rank) == (1, 0)
        assert lookup.collective and not lookup.host_sync
        assert_same_bits(lookup.fetch(row_ids), expected, label=f"tp=1 {collective}")
    a2a = AllToAllExchange(shard_store(C10, 1, 0), num_cols=C10.n_cols, group=world_of_one)
    assert a2a.collective and a2a.host_sync  # the split sizes come to the host
    assert_same_bits(a2a.fetch(row_ids), expected, label="all-to-all world of one")
    assert a2a.fetch(row_ids[:0]).shape == (0, C10.n_cols, C10.head_dim)


def test_stores_of_other_shards_are_refused(world_of_one) -> None:
    C = TINY.n_cols
    with pytest.raises(ShardingError, match=r"serves hash columns \[0, 6\) but rank 0 of 1 owns"):
        AllGatherExchange(shard_store(TINY, 2, 0), num_cols=C, group=world_of_one)
    with pytest.raises(ShardingError, match=r"serves hash columns \[0, 6\) but rank 0 of 1 owns"):
        AllToAllExchange(shard_store(TINY, 2, 0), num_cols=C, group=world_of_one)
    with pytest.raises(ValidationError, match="collective='broadcast'"):
        AllGatherExchange(
            shard_store(TINY, 1, 0), num_cols=C, group=world_of_one, collective="broadcast"
        )
    with pytest.raises(ValidationError, match="num_cols=0"):
        AllGatherExchange(shard_store(TINY, 1, 0), num_cols=0, group=world_of_one)
    lookup = AllGatherExchange(shard_store(TINY, 1, 0), num_cols=C, group=world_of_one)
    with pytest.raises(ValidationError, match=r"expected \[T, C\] with C=12"):
        lookup.fetch(torch.zeros((3, 10), dtype=torch.int64))


def test_an_exchanges_flags_follow_its_cache(world_of_one) -> None:
    """A scheduler calls ``use_gpu_reads`` after the exchange is built: the exchange passes
    it to its cache and reports the cache's flags as they are now (a frozen cache waits on
    the host only while its misses take the miss path). The all-to-all waits either way."""
    backing = shard_store(C10, 1, 0)
    reads = switchable_gpu_reads(backing)
    row_ids = random_row_ids(C10, 5, seed=11)
    expected = reference_rows(C10, row_ids)
    cache = CachedRowStore(backing, 2**16, frozen=True)
    lookup = AllGatherExchange(cache, num_cols=C10.n_cols, group=world_of_one)
    assert not lookup.host_sync and not lookup.has_update
    assert lookup.use_gpu_reads(False) and not reads["on"]
    assert lookup.host_sync and cache.host_sync
    assert_same_bits(lookup.fetch(row_ids), expected, label="misses by the miss path")
    assert lookup.use_gpu_reads(True) and reads["on"] and not lookup.host_sync
    assert_same_bits(lookup.fetch(row_ids), expected, label="misses read by the probe")
    a2a = AllToAllExchange(cache, num_cols=C10.n_cols, group=world_of_one)
    assert a2a.host_sync and not cache.host_sync
    updating = AllGatherExchange(
        CachedRowStore(backing, 2**16), num_cols=C10.n_cols, group=world_of_one
    )
    assert updating.has_update and updating.host_sync
