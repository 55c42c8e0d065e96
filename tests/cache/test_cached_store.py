"""CachedRowStore: bit for bit the backing tier's lookup, whatever is cached;
statistics, warm-up, write-through, capacity rounding and clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.cache.helpers import skewed_ids
from tests.helpers import (
    TIERS,
    assert_same_bits,
    random_packed_table,
    switchable_gpu_reads,
    tier_store,
)
from tests.lookup.stores import store_of

from engramrt.cache import CachedRowStore, CacheStats, SetAssociativeLfu
from engramrt.errors import CapacityError, EngramError, ValidationError
from engramrt.lookup.tiers import HostOptions, TablePlacement, make_store


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    ("E", "C", "id_dtype", "shard", "backend"),
    [
        (64, 6, torch.int64, None, "triton"),
        (96, 5, torch.int32, (3, 1, 4), "reference"),  # rows from 3, columns [1, 4)
        (256, 24, torch.int64, (2**33, 0, None), "triton"),  # V4.1 row width; ids past 2**32
    ],
)
def test_matches_backing_over_a_skewed_stream(
    tier: str,
    E: int,
    C: int,
    id_dtype: torch.dtype,
    shard: tuple[int, int, int | None] | None,
    backend: str,
    tmp_path: Path,
    device: torch.device,
) -> None:
    """Lookups with updates in between: every output equals the backing's, and the cache
    does serve hits (and evicts) along the way."""
    num_rows = 400
    row_begin, col_begin, col_end = shard or (0, 0, None)
    table = random_packed_table(num_rows, E, seed=E + C)
    backing = tier_store(
        tier,
        table,
        tmp_path,
        device=device,
        row_begin=row_begin,
        col_begin=col_begin,
        col_end=col_end,
    )
    row_bytes = E + E // 32
    cache = CachedRowStore(backing, 6 * 4 * row_bytes + 17, ways=4, n_heads=2, backend=backend)
    assert cache.num_slots == 24 and cache.col_begin == col_begin and cache.row_begin == row_begin

    g = torch.Generator().manual_seed(C)
    for step, num_tokens in enumerate([5, 1, 8, 0, 7, 9, 3, 6, 8, 4]):
        row_ids = skewed_ids((num_tokens, C), row_begin, row_begin + num_rows, g)
        row_ids[:, :col_begin] = -3  # other shards' columns hold anything
        if col_end is not None:
            row_ids[:, col_end:] = 2**45
        if id_dtype == torch.int32:
            row_ids = row_ids.clamp(max=2**31 - 1)
        row_ids = row_ids.to(id_dtype).to(device)
        expected = backing.lookup(row_ids)
        if step % 2:
            out = torch.full((num_tokens, C, E), float("nan"), dtype=torch.bfloat16, device=device)
            got = cache.lookup(row_ids, out=out)
            assert got.data_ptr() == out.data_ptr()
        else:
            got = cache.lookup(row_ids.cpu())  # ids from the host too
        assert_same_bits(got, expected)
        cache.update()
    stats = cache.stats()
    assert stats.hit_rate > 0.2 and stats.admitted > 0
    if cache.probe_reads_misses:  # every missed lookup, then the admitted rows again
        assert stats.rows_fetched == sum(stats.misses) + stats.admitted
    else:  # distinct misses per lookup
        assert stats.rows_fetched <= sum(stats.misses)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_hand_made_stream_statistics(backend: str, device: torch.device) -> None:
    """One set of 4 ways, so where every row goes is known; counts worked out by hand.
    With the kernel over a device-tier backing the probe reads misses itself; the
    reference keeps the miss path: the same hits, misses and admissions either way."""
    E = 32
    table = random_packed_table(50, E, seed=3)
    backing = make_store(TablePlacement("device", device=device), packed=table)
    cache = CachedRowStore(backing, 4 * 33, ways=4, n_heads=2, layer_id=14, backend=backend)
    assert (cache.num_sets, cache.num_slots, cache.capacity_bytes) == (1, 4, 132)
    assert cache.probe_reads_misses == (backend == "triton")

    def look(rows: list[list[int]]) -> None:
        row_ids = torch.tensor(rows, device=device)
        assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
        cache.update()

    # Columns 0, 1 are order 2; columns 2, 3 are order 3 (n_heads = 2).
    # Cold: 8 misses. Estimates 1, 2, 3: 2 each; 4, 5: 1 each. The four empty
    # ways take the four best candidates (1, 2, 3, then 4 before 5 by id).
    look([[1, 2, 3, 4], [1, 2, 3, 5]])
    assert cache.policy.resident_ids().tolist() == [1, 2, 3, 4]
    # Hits: column 0: 1, 1; column 1: 2; column 2: 3. Misses: 9 (x3) and 5.
    # Then counters 1: 2+2, 2: 2+1, 3: 2+1, 4: 1; estimates 9: 3, 5: 2.
    # 9 beats the weakest way (4, count 1); 5 meets the next (count 3) and loses.
    look([[1, 2, 3, 5], [1, 9, 9, 9]])
    assert cache.policy.resident_ids().tolist() == [1, 2, 3, 9]
    stats = cache.stats()
    assert stats.hits == (2, 1, 1, 0)
    assert stats.misses == (2 + 0, 2 + 1, 2 + 1, 2 + 2)
    assert stats.lookups == 16 and stats.hit_rate == 4 / 16
    assert stats.bytes_saved == 4 * 33
    if cache.probe_reads_misses:  # 12 missed lookups, then the 5 admitted rows
        assert stats.rows_fetched == 12 + 5
    else:  # unique misses per lookup: {1, 2, 3, 4, 5}, {5, 9}
        assert stats.rows_fetched == 5 + 2
    assert (stats.admitted, stats.evicted) == (5, 1)
    by_order = stats.by_order()
    assert by_order[2] == {"hits": 3, "misses": 5, "hit_rate": 3 / 8, "bytes_saved": 3 * 33}
    assert by_order[3] == {"hits": 1, "misses": 7, "hit_rate": 1 / 8, "bytes_saved": 33}
    d = stats.as_dict()
    assert d["layer_id"] == 14 and d["by_order"]["2"]["hits"] == 3 and d["hits"] == 4
    cache.reset_stats()
    assert cache.stats().lookups == 0 and cache.stats().hit_rate == 0.0
    # Counting happens off the lookup's path; a lookup not yet consumed by an
    # update, one forgotten past max_pending, and one before a reset.
    cache.lookup(torch.tensor([[1, 2, 3, 9]], device=device))
    assert cache.stats().hits == (1, 1, 1, 1)  # pending, counted once
    assert cache.stats().hits == (1, 1, 1, 1)
    for _ in range(cache.max_pending + 2):
        cache.lookup(torch.tensor([[1, 7, 7, 7]], device=device))
    stats = cache.stats()
    assert stats.hits == (1 + cache.max_pending + 2, 1, 1, 1)
    assert stats.misses == (0, cache.max_pending + 2, cache.max_pending + 2, cache.max_pending + 2)
    cache.reset_stats()
    cache.update()  # consumes lookups made before the reset: not counted
    assert cache.stats().lookups == 0


@pytest.mark.parametrize("tier", ["device", "host"])
def test_warm_up_then_serve(tier: str, tmp_path: Path, device: torch.device) -> None:
    E = 64
    table = random_packed_table(300, E, seed=5)
    backing = tier_store(tier, table, tmp_path, device=device)
    cache = CachedRowStore(backing, 16 * 8 * 66, ways=8)
    g = torch.Generator().manual_seed(6)
    corpus = [skewed_ids((16, 4), 0, 300, g, power=4.0) for _ in range(12)]
    installed = cache.warm_up(corpus)
    assert installed > 0 and cache.stats().lookups == 0  # warm-up is not counted
    # State equals a simulation of the same stream on tags alone.
    sim = SetAssociativeLfu(cache.num_sets, cache.ways)
    for batch in corpus:
        sim.access(batch)
    assert torch.equal(cache.policy.tags.cpu(), sim.tags)
    row_ids = skewed_ids((20, 4), 0, 300, g, power=4.0).to(device)
    assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
    assert cache.stats().hit_rate > 0.5
    with pytest.raises(ValidationError, match=r"warm_up batch has shape \(5,\)"):
        cache.warm_up([torch.zeros(5, dtype=torch.int64)])
    with pytest.raises(ValidationError, match=r"row_ids\[0, 1\] = 300"):
        cache.warm_up([torch.tensor([[0, 300]])])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_frozen_cache_serves_its_warm_up_and_admits_nothing(
    backend: str, device: torch.device
) -> None:
    """A static set of hot rows: filled by warm_up, it serves bit for bit the backing's
    rows, counts hits and misses, and no lookup or update changes what it holds. The
    same stream through an unfrozen cache admits its misses (the control)."""
    table = random_packed_table(300, 64, seed=21)
    backing = make_store(TablePlacement("device", device=device), packed=table)
    g = torch.Generator().manual_seed(22)
    corpus = [skewed_ids((16, 4), 0, 300, g, power=4.0) for _ in range(12)]
    stream = [skewed_ids((20, 4), 0, 300, g, power=1.0).to(device) for _ in range(6)]
    caches = {
        frozen: CachedRowStore(backing, 16 * 8 * 66, ways=8, backend=backend, frozen=frozen)
        for frozen in (True, False)
    }
    for cache in caches.values():
        assert cache.warm_up(corpus) > 0
    frozen = caches[True]
    tags, rows = frozen.policy.tags.clone(), frozen.cache_rows.clone()
    for row_ids in stream:
        for cache in caches.values():
            assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
            cache.update()
    assert torch.equal(frozen.policy.tags, tags) and torch.equal(frozen.cache_rows, rows)
    assert not torch.equal(caches[False].policy.tags, tags)  # the control admitted rows
    counted = frozen.stats()
    assert counted.lookups == sum(ids.numel() for ids in stream)
    assert 0 < sum(counted.hits) < counted.lookups and counted.admitted == 0
    # Flags a scheduler reads: no update; a host wait only where misses take the miss path.
    assert (frozen.has_update, caches[False].has_update) == (False, True)
    assert frozen.host_sync is not frozen.probe_reads_misses
    assert caches[False].host_sync


def test_use_gpu_reads_switches_how_misses_are_read(device: torch.device) -> None:
    """A runtime's ``gpu_reads`` reaches the backing through the cache: off, the misses take
    the miss path (no GPU read of host memory), on, the probe reads them again; the rows
    are the backing's either way, and the lookups made before a switch are counted, not
    planned from. A backing with one way, or ``read_misses=True``, keeps its way."""
    table = random_packed_table(40, 32, seed=24)
    backing = make_store(TablePlacement("device", device=device), packed=table)
    assert not CachedRowStore(backing, 2**16, backend="triton").use_gpu_reads(False)
    reads = switchable_gpu_reads(backing)
    row_ids = torch.tensor([[0, 3, 7, 9], [3, 3, 1, 39]], device=device)
    for frozen in (False, True):
        cache = CachedRowStore(backing, 2**16, backend="triton", frozen=frozen)
        assert cache.probe_reads_misses and cache.host_sync is not frozen
        assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
        assert cache.use_gpu_reads(False) and not reads["on"]
        assert not cache.probe_reads_misses and cache.host_sync
        assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
        cache.update()  # plans from the lookup made after the switch only
        assert cache.stats().lookups == 2 * row_ids.numel()
        assert cache.use_gpu_reads(True) and reads["on"] and cache.probe_reads_misses
        assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
    required = CachedRowStore(backing, 2**16, backend="triton", read_misses=True)
    assert not required.use_gpu_reads(False) and reads["on"] and required.probe_reads_misses


def test_frozen_must_be_a_bool(device: torch.device) -> None:
    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 32, seed=23)
    )
    with pytest.raises(ValidationError, match=r"frozen = 'yes'; expected a bool"):
        CachedRowStore(backing, 2**16, frozen="yes")  # type: ignore[arg-type]


def test_write_rows_reaches_backing_and_drops_cached_copies(device: torch.device) -> None:
    E = 32
    table = random_packed_table(40, E, seed=7)
    backing = make_store(TablePlacement("host", device=device), packed=table)
    cache = CachedRowStore(backing, 2 * 8 * 33, ways=8)
    row_ids = torch.arange(40, device=device).view(10, 4)
    cache.lookup(row_ids)
    cache.update()
    assert len(cache.policy.resident_ids()) > 0
    fresh = random_packed_table(10, E, seed=8)
    cache.write_rows(5, fresh)  # rows 5..14
    assert not set(cache.policy.resident_ids().tolist()) & set(range(5, 15))
    expected = backing.lookup(row_ids)
    assert_same_bits(cache.lookup(row_ids), expected)
    new_table = table.clone()
    new_table[5:15] = fresh
    assert_same_bits(
        expected,
        make_store(TablePlacement("device", device=device), packed=new_table).lookup(row_ids),
    )


def test_no_owned_columns_and_empty_batches(device: torch.device) -> None:
    table = random_packed_table(20, 32, seed=9)
    backing = store_of("device", table, device=device, col_begin=3, col_end=3)
    cache = CachedRowStore(backing, 8 * 33)
    got = cache.lookup(torch.full((4, 5), -1, dtype=torch.int64, device=device))
    assert got.shape == (4, 5, 32) and bool((got.view(torch.int16) == 0).all())
    assert cache.lookup(torch.empty((0, 5), dtype=torch.int32, device=device)).shape == (0, 5, 32)
    cache.update()
    assert cache.stats().lookups == 0


# --------------------------------------------------------------------------
# Capacity and argument errors.
# --------------------------------------------------------------------------


def test_capacity_rounds_down_to_whole_sets(device: torch.device) -> None:
    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 256, seed=10)
    )
    cache = CachedRowStore(backing, 3 * 8 * 264 + 263, ways=8)
    assert (cache.num_sets, cache.num_slots, cache.capacity_bytes) == (3, 24, 24 * 264)
    assert CachedRowStore(backing, 5 * 264, ways=1).num_slots == 5
    assert CachedRowStore(backing, 2**20, ways=16).num_sets == 2**20 // 264 // 16
    with pytest.raises(
        CapacityError,
        match=r"capacity_bytes = 2000 holds 7 rows of 264 B; expected at least one set of "
        r"ways = 8 rows \(2112 bytes\)",
    ):
        CachedRowStore(backing, 2000, ways=8)
    with pytest.raises(CapacityError, match="capacity_bytes = -5 holds 0 rows"):
        CachedRowStore(backing, -5)


def test_capacity_is_checked_against_memory(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    from engramrt import memory

    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 32, seed=11)
    )
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    monkeypatch.setattr(memory, "device_free_bytes", lambda _device: 1000)
    with pytest.raises(CapacityError, match=r"CachedRowStore \(64 slots = 8 sets x 8 ways"):
        CachedRowStore(backing, 64 * 33)


@pytest.mark.parametrize(
    ("kwargs", "needed"),
    [
        # (2**62 // 33 // 8 * 8 + 1) slots x (33 + 12) B + a 4 x 2**24 sketch of int32
        ({"capacity_bytes": 2**62}, (2**62 // 33 // 8 * 8 + 1) * 45 + 16 * 2**24),
        # 2**16 // 33 // 8 * 8 = 1984 slots (+1 scratch) x 45 B + a 4 x 2**40 sketch
        ({"sketch_width": 2**40}, 1985 * 45 + 16 * 2**40),
    ],
)
def test_sizes_beyond_memory_are_refused_before_any_allocation(
    kwargs: dict[str, object], needed: int, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory check comes before the policy's tags, counters and sketch exist (was:
    a raw allocator error from torch, the check after it)."""
    from engramrt.cache import store as store_module

    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 32, seed=12)
    )
    assert backing.row_bytes == 33  # 32 fp8 values and one scale byte

    def no_policy(*args: object, **kw: object) -> None:
        raise AssertionError("the policy was built before the memory check")

    monkeypatch.setattr(store_module, "SetAssociativeLfu", no_policy)
    args: dict[str, object] = {"capacity_bytes": 2**16, **kwargs}
    with pytest.raises(CapacityError) as info:
        CachedRowStore(backing, **args)  # type: ignore[arg-type]
    assert str(info.value).startswith("CachedRowStore (")
    assert f"needs {needed} bytes" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ways": 3}, r"ways = 3; expected a power of two in 1\.\.64"),
        ({"ways": 128}, r"ways = 128; expected a power of two in 1\.\.64"),
        ({"ways": 0}, r"ways = 0; expected a power of two"),
        ({"capacity_bytes": 1.5e6}, r"capacity_bytes = 1500000\.0; expected an int"),
        ({"n_heads": 0}, r"n_heads = 0; expected a positive int"),
        ({"sketch_width": 1000}, r"sketch_width = 1000; expected a power of two"),
        ({"sketch_width": 1024.0}, r"sketch_width = 1024\.0; expected a power of two \(int\)"),
        ({"sketch_width": True}, r"sketch_width = True; expected a power of two \(int\)"),
        ({"sketch_depth": 2.5}, r"sketch_depth = 2\.5; expected an int in 1\.\.6"),
        ({"sketch_depth": True}, r"sketch_depth = True; expected an int in 1\.\.6"),
        ({"sketch_depth": 0}, r"sketch_depth = 0; expected an int in 1\.\.6"),
        ({"decay_period": 0}, r"decay_period = 0; expected 1\.\.536870912 accesses"),
        ({"max_pending": 0}, r"max_pending = 0; expected >= 1"),
    ],
)
def test_bad_arguments_name_parameter_and_value(
    kwargs: dict[str, object], message: str, device: torch.device
) -> None:
    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 32, seed=12)
    )
    args: dict[str, object] = {"capacity_bytes": 2**16, **kwargs}
    with pytest.raises(ValidationError, match=message):
        CachedRowStore(backing, **args)  # type: ignore[arg-type]


def test_wrong_backing_and_wrong_shapes(device: torch.device) -> None:
    with pytest.raises(ValidationError, match="backing is Tensor; expected a RowStore"):
        CachedRowStore(torch.zeros(3), 2**16)  # type: ignore[arg-type]
    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 32, seed=13)
    )
    cache = CachedRowStore(backing, 2**16)
    with pytest.raises(ValidationError, match="backing is a CachedRowStore"):
        CachedRowStore(cache, 2**16)
    with pytest.raises(EngramError, match="backend='cuda-magic' is not one of"):
        CachedRowStore(backing, 2**16, backend="cuda-magic")
    with pytest.raises(ValidationError, match=r"row_ids has shape \(5,\); expected \[T, C\]"):
        cache.lookup(torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(ValidationError, match=r"row_ids has dtype torch\.float32"):
        cache.lookup(torch.zeros((2, 3), device=device))
    with pytest.raises(ValidationError, match=r"out is torch.bfloat16 \(2, 3, 64\)"):
        cache.lookup(
            torch.zeros((2, 3), dtype=torch.int64, device=device),
            out=torch.empty((2, 3, 64), dtype=torch.bfloat16, device=device),
        )
    with pytest.raises(ValidationError, match="phase = 'commit'"):
        cache.lookup(torch.zeros((1, 1), dtype=torch.int64, device=device))
        update = cache.plan_update()
        assert update is not None
        cache.apply_update(update, ("commit",))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_of_range_ids_are_caught_on_the_miss_path(backend: str, device: torch.device) -> None:
    backing = store_of(
        HostOptions(gpu_reads=False),  # the CPU gathers: misses go through the miss path
        random_packed_table(10, 32, seed=14),
        device=device,
        row_begin=100,
    )
    cache = CachedRowStore(backing, 2**16, backend=backend)
    assert not cache.probe_reads_misses
    row_ids = torch.full((3, 4), 104, dtype=torch.int64, device=device)
    row_ids[2, 1] = 110
    with pytest.raises(ValidationError, match=r"row_ids\[2, 1\] = 110 .* in \[100, 110\)"):
        cache.lookup(row_ids)
    row_ids[2, 1] = -1  # the empty-slot tag: still a miss, so still caught
    with pytest.raises(ValidationError, match=r"row_ids\[2, 1\] = -1 "):
        cache.lookup(row_ids)


def test_a_probe_that_reads_misses_checks_ids_with_check_ids(device: torch.device) -> None:
    backing = store_of("device", random_packed_table(10, 32, seed=14), device=device, row_begin=100)
    cache = CachedRowStore(backing, 2**16, backend="triton", check_ids=True)
    assert cache.probe_reads_misses
    row_ids = torch.full((3, 4), 104, dtype=torch.int64, device=device)
    row_ids[2, 1] = 110
    with pytest.raises(ValidationError, match=r"row_ids\[2, 1\] = 110 .* in \[100, 110\)"):
        cache.lookup(row_ids)


def test_read_misses_setting(tmp_path: Path, device: torch.device) -> None:
    """Off on request; required only where the backing's rows are device-readable."""
    table = random_packed_table(10, 32, seed=16)
    device_backing = make_store(TablePlacement("device", device=device), packed=table)
    assert CachedRowStore(device_backing, 2**16, backend="triton").probe_reads_misses
    assert not CachedRowStore(device_backing, 2**16, read_misses=False).probe_reads_misses
    assert not CachedRowStore(device_backing, 2**16, backend="reference").probe_reads_misses
    disk = tier_store("disk", table, tmp_path, device=device)
    assert not CachedRowStore(disk, 2**16).probe_reads_misses
    with pytest.raises(ValidationError, match=r"read_misses=True with backing tier='disk'"):
        CachedRowStore(disk, 2**16, read_misses=True)


def test_stats_count_what_the_test_looked_up(device: torch.device) -> None:
    """Counts checked against the lookups made here: a cold cache misses every one, and
    every later lookup is a hit or a miss of its column (was: an isinstance check only)."""
    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(10, 32, seed=15)
    )
    cache = CachedRowStore(backing, 2**16, n_heads=2)
    fresh = cache.stats()
    assert isinstance(fresh, CacheStats) and fresh.lookups == 0
    row_ids = torch.tensor([[0, 3, 7, 9], [3, 3, 1, 0], [9, 8, 7, 6]], device=device)
    assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
    cold = cache.stats()
    assert cold.hits == (0, 0, 0, 0) and cold.misses == (3, 3, 3, 3)
    cache.update()
    assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
    warm = cache.stats()
    assert tuple(h + m for h, m in zip(warm.hits, warm.misses, strict=True)) == (6, 6, 6, 6)
    assert warm.lookups == 24 and sum(warm.hits) > 0  # 2**16 bytes hold all 10 rows


def test_import_does_not_pull_in_triton() -> None:
    code = "import sys, engramrt.cache\nprint('triton' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_update_every_waits_for_that_many_lookups(backend: str, device: torch.device) -> None:
    """With update_every=3 two updates do nothing; the third installs the misses of all
    three lookups, as one update per lookup would have (one set of four ways, four rows);
    lookups stay the backing's bytes throughout."""
    table = random_packed_table(50, 32, seed=5)
    backing = make_store(TablePlacement("device", device=device), packed=table)
    batches = [[[1, 2]], [[3, 1]], [[4, 2]]]
    caches = {every: CachedRowStore(backing, 4 * 33, ways=4, backend=backend) for every in (1, 3)}
    caches[3].update_every = 3
    for bad in (0, 5, 2.0, True):  # in [1, max_pending = 4]
        with pytest.raises(ValidationError, match=rf"update_every = {bad!r}; expected an int in"):
            caches[3].update_every = bad  # type: ignore[assignment]
    assert caches[3].update_every == 3 and caches[1].update_every == 1
    for index, rows in enumerate(batches):
        row_ids = torch.tensor(rows, device=device)
        for every, cache in caches.items():
            assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))
            cache.update()
            resident = cache.policy.resident_ids().tolist()
            if every == 3 and index < 2:
                assert resident == [], (index, resident)  # nothing installed yet
    for cache in caches.values():
        assert cache.policy.resident_ids().tolist() == [1, 2, 3, 4]
        assert cache.stats().admitted == 4
