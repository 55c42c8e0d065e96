"""The set-associative LFU policy on tags alone: admission, eviction, aging, hashing."""

from __future__ import annotations

import pytest
import torch

from engramrt.cache import MISS, NOT_OWNED, SetAssociativeLfu, mix32, set_index
from engramrt.errors import CapacityError, ValidationError


def one_set(ways: int = 4, **kwargs: int) -> SetAssociativeLfu:
    return SetAssociativeLfu(1, ways, **kwargs)


def test_frequent_rows_survive_a_scan_of_one_time_rows() -> None:
    policy = one_set(4, decay_period=10_000)
    for _ in range(3):
        policy.access(torch.tensor([10, 11, 12, 13]))
    for start in range(100, 400, 5):  # 300 rows, each seen once
        seen = policy.access(torch.arange(start, start + 5))
        assert bool((seen.slots == MISS).all())
        assert seen.missed.tolist() == list(range(start, start + 5))
    assert policy.resident_ids().tolist() == [10, 11, 12, 13]


def test_rows_no_longer_used_age_out() -> None:
    """With the default period (10 x 4 slots), the same scan halves the old rows'
    counters to 0, and then rows seen once get in."""
    policy = one_set(4)
    for _ in range(3):
        policy.access(torch.tensor([10, 11, 12, 13]))
    for start in range(100, 400, 5):
        policy.access(torch.arange(start, start + 5))
    assert policy.resident_ids().tolist() != [10, 11, 12, 13]


def test_a_row_that_turns_hot_replaces_the_coldest() -> None:
    policy = one_set(2)
    policy.access(torch.tensor([1, 2, 2, 2]))  # 1: count 1, 2: count 3
    policy.access(torch.tensor([7]))  # estimate 1: ties 1's count, stays out
    assert policy.resident_ids().tolist() == [1, 2]
    policy.access(torch.tensor([7]))  # estimate 2 beats 1 (count 1)
    assert policy.resident_ids().tolist() == [2, 7]


def test_candidates_fill_ways_best_first_and_never_share_a_slot() -> None:
    g = torch.Generator().manual_seed(0)
    policy = SetAssociativeLfu(5, 4)
    for _ in range(30):
        ids = (torch.rand(200, generator=g) ** 3 * 500).long()
        policy.record(ids, policy.probe(ids))
        plan = policy.plan(torch.unique(ids[policy.probe(ids) == MISS]))
        admitted = plan.slots[plan.admitted]
        assert admitted.unique().numel() == admitted.numel()
        assert bool((admitted // 4 == set_index(plan.tags[plan.admitted], 5)).all())
        assert bool((plan.slots[~plan.admitted] == policy.scratch).all())
        policy.invalidate(plan)
        policy.publish(plan)
    resident = policy.resident_ids()
    assert resident.unique().numel() == resident.numel() == 20


def test_counters_and_sketch_halve_every_period() -> None:
    policy = one_set(2, decay_period=10)
    policy.access(torch.tensor([4, 4, 4, 4, 4, 4, 5, 5]))  # 8 accesses
    assert policy.estimate(torch.tensor([4, 5])).tolist() == [6, 2]
    policy.access(torch.tensor([4, 4]))  # reaches 10: halve first, then count
    assert policy.estimate(torch.tensor([4, 5])).tolist() == [3 + 2, 1]
    assert policy.accesses_since_decay == 0
    slot = int(policy.probe(torch.tensor([4])))
    assert int(policy.counts[slot]) == 6 // 2 + 2


def test_not_owned_accesses_are_not_counted() -> None:
    policy = one_set(2)
    seen = policy.access(torch.tensor([3, 3, 9]), owned=torch.tensor([True, False, False]))
    assert seen.missed.tolist() == [3]
    assert seen.slots.tolist() == [MISS, NOT_OWNED, NOT_OWNED]
    assert policy.estimate(torch.tensor([3, 9])).tolist() == [1, 0]
    assert policy.resident_ids().tolist() == [3]


def test_clone_is_independent() -> None:
    policy = one_set(2)
    policy.access(torch.tensor([1]))
    copy = policy.clone()
    copy.access(torch.tensor([2, 2]))
    assert policy.resident_ids().tolist() == [1] and copy.resident_ids().tolist() == [1, 2]


def test_mix32_spreads_ids_over_sets() -> None:
    ids = torch.cat([torch.arange(100_000), 2**40 + 7 * torch.arange(100_000)])
    mixed = mix32(ids)
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    counts = torch.bincount(set_index(ids, 61), minlength=61).double()
    assert float((counts / counts.mean() - 1).abs().max()) < 0.05


def test_geometry_errors() -> None:
    with pytest.raises(CapacityError, match="num_sets = 0; expected at least 1 set"):
        SetAssociativeLfu(0, 8)
    with pytest.raises(ValidationError, match="ways = 6"):
        SetAssociativeLfu(2, 6)
    with pytest.raises(ValidationError, match=r"sketch_depth = 9; expected an int in 1\.\.6"):
        SetAssociativeLfu(2, 8, sketch_depth=9)


def _admitted(plan) -> dict[int, tuple[int, int]]:
    """``{row id: (slot, initial count)}`` of a plan's admissions."""
    keep = plan.admitted
    return {
        int(t): (int(s), int(c))
        for t, s, c in zip(plan.tags[keep], plan.slots[keep], plan.counts[keep], strict=True)
    }


@pytest.mark.parametrize("seed", range(6))
def test_a_fixed_shape_batch_plans_what_its_distinct_ids_would(seed: int) -> None:
    """Placeholders (hits, repeats) ride along without changing a single admission, slot
    or counter; planning over them as real candidates (no ``valid``) would."""
    from engramrt.cache.policy import NO_CANDIDATE, fixed_candidates

    g = torch.Generator().manual_seed(seed)
    policy = SetAssociativeLfu(num_sets=4, ways=4, device=torch.device("cpu"))
    for _ in range(3):  # some residents with counters, then a skewed batch
        policy.access(torch.randint(0, 60, (40,), generator=g) ** 2 % 97)
    row_ids = torch.randint(0, 60, (200,), generator=g) ** 2 % 97  # many repeats
    slots = policy.probe(row_ids)
    policy.record(row_ids, slots)
    missed = slots == MISS
    expected = policy.plan(torch.unique(row_ids[missed]))
    candidates, valid = fixed_candidates(row_ids, missed)
    assert candidates.shape == row_ids.shape
    assert int(valid.sum()) == torch.unique(row_ids[missed]).numel()
    got = policy.plan(candidates, valid=valid)
    assert _admitted(got) == _admitted(expected) and _admitted(expected)
    assert not got.admitted[~valid[got.order]].any()
    # Negative control: with the repeats left valid, one id takes several ways.
    fresh = SetAssociativeLfu(num_sets=1, ways=4, device=torch.device("cpu"))
    ids = torch.tensor([5, 7, 5, 5])
    candidates, valid = fixed_candidates(ids, torch.ones(4, dtype=torch.bool))
    assert candidates.tolist() == [5, 5, 5, 7] and valid.tolist() == [True, False, False, True]
    assert int(fresh.plan(candidates, valid=valid).admitted.sum()) == 2
    assert int(fresh.plan(candidates, valid=candidates != NO_CANDIDATE).admitted.sum()) == 4


def test_fixed_shape_arguments_are_checked() -> None:
    from engramrt.cache.policy import fixed_candidates

    policy = SetAssociativeLfu(num_sets=2, ways=2, device=torch.device("cpu"))
    ids = torch.tensor([3, 4, 5])
    with pytest.raises(ValidationError, match=r"missed is torch.int64 \(3,\); expected bool"):
        fixed_candidates(ids, torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValidationError, match=r"missed is torch.bool \(2,\); expected bool of"):
        fixed_candidates(ids, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValidationError, match=r"valid is torch.bool \(2,\); expected 3 bools"):
        policy.plan(ids, valid=torch.ones(2, dtype=torch.bool))
    assert policy.plan(ids, valid=torch.ones(3, dtype=torch.bool)).admitted.all()  # control
