"""Updates interleaved with lookups never serve a half-replaced row.

An update installs rows in three phases (invalidate, write, publish; see
``engramrt.cache.store``). A lookup ordered between any two of them must
return the backing tier's bytes. The negative controls apply the phases in
a torn order (tag published before the data is written; data written while
the old tag still names the slot) and show that the same check fails.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.cache.helpers import skewed_ids
from tests.helpers import assert_same_bits, random_packed_table

from engramrt.cache import EMPTY_TAG, PHASES, CachedRowStore, CacheUpdate
from engramrt.lookup.tiers import RowStore, TablePlacement, make_store

E = 32
ROW_BYTES = E + E // 32
NUM_ROWS = 60


def build(
    num_sets: int, ways: int, device: torch.device, backend: str = "reference", seed: int = 0
) -> tuple[CachedRowStore, RowStore]:
    backing = make_store(
        TablePlacement("device", device=device), packed=random_packed_table(NUM_ROWS, E, seed)
    )
    return CachedRowStore(backing, num_sets * ways * ROW_BYTES, ways, backend=backend), backing


def check(cache: CachedRowStore, backing: RowStore, row_ids: torch.Tensor) -> None:
    assert_same_bits(cache.lookup(row_ids), backing.lookup(row_ids))


def ids_touched(cache: CachedRowStore, update: CacheUpdate) -> torch.Tensor:
    """The rows an update brings in and the rows it pushes out."""
    old = cache.policy.tags[update.plan.slots]
    both = torch.cat([update.plan.tags, old])
    return both[both != EMPTY_TAG]


def apply_and_check(
    cache: CachedRowStore,
    backing: RowStore,
    update: CacheUpdate,
    phases: Iterable[str],
    probe_ids: torch.Tensor,
) -> None:
    """Apply ``phases`` one at a time, looking up ``probe_ids`` after each."""
    row_ids = probe_ids.reshape(-1, 1)
    for phase in phases:
        cache.apply_update(update, (phase,))
        if row_ids.numel():
            check(cache, backing, row_ids)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_sets=st.integers(1, 3),
    ways=st.sampled_from([1, 2, 4]),
    batches=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5)), min_size=1, max_size=6),
)
def test_lookups_between_phases_match_backing(
    seed: int,
    num_sets: int,
    ways: int,
    batches: list[tuple[int, int]],
    device: torch.device,
) -> None:
    cache, backing = build(num_sets, ways, device, seed=seed % 7)
    g = torch.Generator().manual_seed(seed)
    for num_tokens, num_cols in batches:
        row_ids = skewed_ids((num_tokens, num_cols), 0, NUM_ROWS, g, power=2.0).to(device)
        check(cache, backing, row_ids)
        update = cache.plan_update()
        if update is None:
            continue
        touched = ids_touched(cache, update)
        extra = torch.randint(0, NUM_ROWS, (3,), generator=g).to(device)
        # The lookups between phases leave records too: the next update sees
        # misses that were installed meanwhile (stale) and must skip them.
        apply_and_check(cache, backing, update, PHASES, torch.cat([touched, extra]))
    resident = cache.policy.resident_ids()
    assert resident.unique().numel() == resident.numel()  # no row in two ways


def test_lookups_between_phases_with_the_kernel(device: torch.device) -> None:
    cache, backing = build(2, 4, device, backend="triton", seed=1)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        row_ids = skewed_ids((5, 3), 0, NUM_ROWS, g).to(device)
        check(cache, backing, row_ids)
        update = cache.plan_update()
        assert update is not None
        apply_and_check(cache, backing, update, PHASES, ids_touched(cache, update))
    assert cache.stats().hits[0] > 0


def prepared_eviction(device: torch.device) -> tuple[CachedRowStore, RowStore, CacheUpdate]:
    """One set of two ways holding rows 1 and 2 (2 hit more); row 3, seen often, evicts 1."""
    cache, backing = build(1, 2, device, seed=3)
    check(cache, backing, torch.tensor([[1, 2]], device=device))
    cache.update()
    check(cache, backing, torch.tensor([[2, 2, 3, 3, 3]], device=device))
    update = cache.plan_update()
    assert update is not None and update.plan.evicted.tolist() == [True]
    assert int(cache.policy.tags[update.plan.slots[0]]) == 1 and update.plan.tags.tolist() == [3]
    return cache, backing, update


def test_safe_order_around_an_eviction(device: torch.device) -> None:
    cache, backing, update = prepared_eviction(device)
    apply_and_check(cache, backing, update, PHASES, torch.tensor([1, 2, 3], device=device))
    assert cache.policy.resident_ids().tolist() == [2, 3]


def test_negative_control_tag_published_before_data(device: torch.device) -> None:
    """Torn: the new tag appears while the slot still holds row 1's bytes."""
    cache, backing, update = prepared_eviction(device)
    with pytest.raises(AssertionError, match="values differ"):
        apply_and_check(
            cache,
            backing,
            update,
            ("invalidate", "publish", "write"),
            torch.tensor([3], device=device),
        )


def test_negative_control_data_written_under_a_live_tag(device: torch.device) -> None:
    """Torn: row 3's bytes land in the slot while its tag still says row 1."""
    cache, backing, update = prepared_eviction(device)
    with pytest.raises(AssertionError, match="values differ"):
        apply_and_check(
            cache,
            backing,
            update,
            ("write", "invalidate", "publish"),
            torch.tensor([1], device=device),
        )


def test_negative_control_cold_fill(device: torch.device) -> None:
    """Torn on an empty cache: tags published over never-written (zero) slots."""
    cache, backing = build(1, 4, device, seed=4)
    check(cache, backing, torch.tensor([[5, 6, 7]], device=device))
    update = cache.plan_update()
    assert update is not None and int(update.plan.admitted.sum()) == 3
    with pytest.raises(AssertionError, match="values differ"):
        apply_and_check(cache, backing, update, ("publish",), torch.tensor([5], device=device))
    cache.apply_update(update, ("write",))  # completing the write repairs it
    check(cache, backing, torch.tensor([[5, 6, 7]], device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams need a GPU")
def test_side_stream_updates_on_gpu() -> None:
    """On a GPU: updates on a side stream, lookups on the compute stream, many rounds."""
    device = torch.device("cuda")
    cache, backing = build(4, 8, device, backend="triton", seed=5)
    side = torch.cuda.Stream(device)
    g = torch.Generator().manual_seed(6)
    for _ in range(50):
        row_ids = skewed_ids((64, 24), 0, NUM_ROWS, g).to(device)
        expected = backing.lookup(row_ids)
        assert_same_bits(cache.lookup(row_ids), expected)
        cache.update(stream=side)
    torch.cuda.synchronize()
    assert cache.stats().hit_rate > 0.3
