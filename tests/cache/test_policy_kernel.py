"""The policy's Triton kernels count and plan exactly as its torch reference.

Runs through Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``), on the GPU with ``ENGRAMRT_TEST_DEVICE=cuda``. Each case
builds one random policy state (tags with empty ways, counters, a sketch),
copies it into a reference policy and a kernel policy, and compares every
tensor they produce or change.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engramrt.cache import EMPTY_TAG, MISS, NOT_OWNED, SetAssociativeLfu, set_index
from engramrt.cache.policy import NO_CANDIDATE, AdmissionPlan, fixed_candidates


def twin_policies(
    num_sets: int, ways: int, depth: int, width: int, seed: int, device: torch.device
) -> tuple[SetAssociativeLfu, SetAssociativeLfu]:
    """(reference, kernels) policies in one random state."""
    g = torch.Generator().manual_seed(seed)
    slots = num_sets * ways
    reference = SetAssociativeLfu(
        num_sets, ways, device, sketch_width=width, sketch_depth=depth, backend="reference"
    )
    tags = torch.randint(0, 4 * slots + 8, (slots + 1,), generator=g)
    tags[torch.rand(slots + 1, generator=g) < 0.3] = EMPTY_TAG
    reference.tags.copy_(tags.to(device))
    reference.counts.copy_(torch.randint(0, 6, (slots + 1,), generator=g, dtype=torch.int32))
    reference.sketch.copy_(torch.randint(0, 8, (depth, width), generator=g, dtype=torch.int32))
    kernels = SetAssociativeLfu(
        num_sets, ways, device, sketch_width=width, sketch_depth=depth, backend="triton"
    )
    kernels.tags.copy_(reference.tags)
    kernels.adopt_counters(reference)
    return reference, kernels


def assert_same_plan(got: AdmissionPlan, want: AdmissionPlan) -> None:
    for field in ("slots", "tags", "counts", "order", "admitted", "evicted"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a.cpu(), b.cpu()), field


SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
GEOMETRY = st.tuples(
    st.integers(1, 9),  # sets
    st.sampled_from([1, 2, 4, 8, 16]),  # ways
    st.integers(1, 6),  # sketch depth
    st.sampled_from([16, 64, 1024]),  # sketch width
)


@SETTINGS
@given(
    geometry=GEOMETRY,
    seed=st.integers(0, 2**16),
    count=st.integers(1, 70),
    placeholders=st.booleans(),
    recheck=st.booleans(),
)
def test_plan_matches_reference(geometry, seed, count, placeholders, recheck, device) -> None:
    num_sets, ways, depth, width = geometry
    reference, kernels = twin_policies(num_sets, ways, depth, width, seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    # Candidates drawn near the resident ids (some resident already, some sets crowded).
    ids = torch.randint(0, 4 * num_sets * ways + 8, (count,), generator=g)
    if placeholders:
        missed = torch.rand(count, generator=g) < 0.6
        candidates, valid = fixed_candidates(ids.to(device), missed.to(device))
    else:
        candidates, valid = torch.unique(ids).to(device), None
    want = reference.plan(candidates, recheck=recheck, valid=valid)
    got = kernels.plan(candidates, recheck=recheck, valid=valid)
    assert_same_plan(got, want)


@SETTINGS
@given(
    geometry=GEOMETRY,
    seed=st.integers(0, 2**16),
    count=st.integers(0, 90),
    shard=st.booleans(),
)
def test_batch_plan_matches_reference(geometry, seed, count, shard, device) -> None:
    """plan_batch: repeated ids (the first missed position is the candidate), hits, columns
    not owned, ids outside the shard's rows; the lists' plan equals the sorted one."""
    num_sets, ways, depth, width = geometry
    reference, kernels = twin_policies(num_sets, ways, depth, width, seed, device)
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, 4 * num_sets * ways + 8, (count,), generator=g)
    slots = torch.randint(-2, num_sets * ways, (count,), generator=g)
    slots[torch.rand(count, generator=g) < 0.5] = MISS
    ids, slots = ids.to(device), slots.to(device)
    rows = (3, 4 * num_sets * ways) if shard else (0, None)
    for _ in range(2):  # a second batch: list heads left by the first must not leak
        want = reference.plan_batch(ids, slots, *rows)
        got = kernels.plan_batch(ids, slots, *rows)
        assert_same_plan(got, want)
        ids = ids.flip(0)


@SETTINGS
@given(
    geometry=GEOMETRY,
    seed=st.integers(0, 2**16),
    count=st.integers(1, 300),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_record_matches_reference(geometry, seed, count, id_dtype, device) -> None:
    """Repeated ids (atomics on one counter), misses (counted on the scratch slot), columns
    not owned (not counted at all) and ids past 2**32."""
    num_sets, ways, depth, width = geometry
    reference, kernels = twin_policies(num_sets, ways, depth, width, seed, device)
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(0, 40, (count,), generator=g)
    if id_dtype == torch.int64:
        ids = ids + (torch.rand(count, generator=g) < 0.2).long() * 2**33
    slots = torch.randint(-2, num_sets * ways, (count,), generator=g)
    ids, slots = ids.to(id_dtype).to(device), slots.to(device)
    reference.record(ids, slots)
    kernels.record(ids, slots)
    assert torch.equal(kernels.sketch.cpu(), reference.sketch.cpu())
    assert torch.equal(kernels.counts.cpu(), reference.counts.cpu())
    assert kernels.accesses_since_decay == reference.accesses_since_decay


def test_a_stream_of_accesses_leaves_the_same_state(device) -> None:
    """access() (probe, record, plan, install) over a skewed stream, with decays: the two
    backends end with the same tags, counters and sketch."""
    reference = SetAssociativeLfu(6, 4, device, decay_period=300, backend="reference")
    kernels = SetAssociativeLfu(6, 4, device, decay_period=300, backend="triton")
    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        ids = (torch.rand(64, generator=g) ** 3 * 200).long().to(device)
        seen = [policy.access(ids) for policy in (reference, kernels)]
        assert torch.equal(seen[0].slots.cpu(), seen[1].slots.cpu())
    assert torch.equal(kernels.tags.cpu(), reference.tags.cpu())
    assert torch.equal(kernels.counts.cpu(), reference.counts.cpu())
    assert torch.equal(kernels.sketch.cpu(), reference.sketch.cpu())
    assert reference.resident_ids().numel() > 0


def test_negative_control_a_counter_changes_the_plan(device) -> None:
    """A candidate whose estimate beats the weakest way by one is admitted; with that way's
    counter one higher, both backends reject it (the comparison above can fail)."""
    plans = {}
    for bump in (0, 1):
        for backend in ("reference", "triton"):
            policy = SetAssociativeLfu(1, 2, device, backend=backend)
            policy.tags[:2] = torch.tensor([3, 4], device=device)
            policy.counts[:2] = torch.tensor([5, 2 + bump], dtype=torch.int32, device=device)
            policy.record(
                torch.tensor([9, 9, 9], device=device), torch.full((3,), MISS, device=device)
            )
            plans[bump, backend] = policy.plan(torch.tensor([9], device=device))
    for backend in ("reference", "triton"):
        assert plans[0, backend].admitted.tolist() == [True]
        assert plans[0, backend].slots.tolist() == [1]
        assert plans[1, backend].admitted.tolist() == [False]
    assert not torch.equal(plans[0, "triton"].slots.cpu(), plans[1, "triton"].slots.cpu())


def test_placeholders_and_resident_candidates_are_never_admitted(device) -> None:
    policy = SetAssociativeLfu(2, 2, device, backend="triton")
    policy.tags[:4] = torch.tensor([EMPTY_TAG, 11, EMPTY_TAG, EMPTY_TAG], device=device)
    seen = torch.tensor([12, 12], device=device)
    policy.record(seen, torch.full((2,), MISS, device=device))  # 12 ranks first in its set
    ids = torch.tensor([11, 12, 12, 13], device=device)
    candidates, valid = fixed_candidates(
        ids, torch.tensor([True, True, True, False], device=device)
    )
    plan = policy.plan(candidates, valid=valid)
    admitted = set(plan.tags[plan.admitted].tolist())
    assert admitted == {12}  # 11 resident, 12 once, 13 not missed, the rest placeholders
    assert NO_CANDIDATE in candidates.tolist()
    assert bool((plan.slots[~plan.admitted] == policy.scratch).all())


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_not_owned_columns_are_not_counted(backend, device) -> None:
    policy = SetAssociativeLfu(1, 2, device, backend=backend)
    policy.record(torch.tensor([5, 5], device=device), torch.full((2,), NOT_OWNED, device=device))
    assert int(policy.sketch.sum()) == 0 and int(policy.counts.sum()) == 0


def test_the_cache_runs_its_policy_on_the_chosen_backend(device) -> None:
    """CachedRowStore's policy follows its backend unless policy_backend says otherwise;
    both give the same hits and the same resident rows over one stream of lookups."""
    from engramrt.cache import CachedRowStore
    from engramrt.lookup.synthetic import random_packed_rows
    from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store

    store = make_store(TablePlacement(DeviceOptions(), device), num_rows=600, E=64)
    store.write_rows(0, random_packed_rows(600, 64, device, torch.Generator(device).manual_seed(2)))
    caches = [
        CachedRowStore(store, 32 * store.row_bytes, ways=4, backend="triton"),
        CachedRowStore(
            store, 32 * store.row_bytes, ways=4, backend="triton", policy_backend="reference"
        ),
    ]
    assert [c.policy.backend for c in caches] == ["triton", "reference"]
    g = torch.Generator().manual_seed(3)
    for _ in range(12):
        ids = (torch.rand(16, 3, generator=g) ** 4 * 600).long().to(device)
        rows = [c.lookup(ids) for c in caches]
        assert torch.equal(rows[0].view(torch.int16), rows[1].view(torch.int16))
        for c in caches:
            c.update()
    assert caches[0].updates_in_place and not caches[1].updates_in_place
    assert caches[0].stats() == caches[1].stats()
    real = caches[0].num_slots  # the scratch slot aside
    for name in ("tags", "counts"):
        a, b = getattr(caches[0].policy, name), getattr(caches[1].policy, name)
        assert torch.equal(a[:real].cpu(), b[:real].cpu()), name
    assert torch.equal(caches[0].cache_rows[:real].cpu(), caches[1].cache_rows[:real].cpu())
    assert caches[0].stats().hits and sum(caches[0].stats().hits) > 0
    assert torch.equal(caches[0].policy.resident_ids().cpu(), caches[1].policy.resident_ids().cpu())


def test_list_heads_are_cleared_when_the_epochs_run_out(device, monkeypatch) -> None:
    """plan_batch tags its per-set list heads with an epoch instead of clearing them; when
    the epochs run out the heads are cleared and counting starts again. Built so that a
    head left from before the wrap would be read as live: batch 1 fills set B's list,
    batch 2 touches set A only, and batch 3 (the first epoch again) puts X alone in set B,
    where a stale head would rank it behind a frequent id of set C (and reject it)."""
    from engramrt.cache import policy as policy_module

    monkeypatch.setattr(policy_module, "EPOCH_LIMIT", 3)
    num_sets, n = 4, 16
    by_set: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for candidate in range(10_000):
        home = int(set_index(torch.tensor([candidate]), num_sets))
        if home in by_set and len(by_set[home]) < n:
            by_set[home].append(candidate)
    set_a, set_b, set_c = (torch.tensor(by_set[k]) for k in range(3))
    policies = [SetAssociativeLfu(num_sets, 1, device, backend=b) for b in ("reference", "triton")]
    frequent = set_c[1:].to(device)  # counted 3 times: they outrank anything seen once
    for policy in policies:
        for _ in range(3):
            policy.record(frequent, torch.full_like(frequent, MISS))
    missed = torch.full((n,), MISS, device=device)
    batches = [set_b, set_a, torch.cat([set_b[:1], set_c[1:]])]
    plans = [[p.plan_batch(b.to(device), missed) for b in batches] for p in policies]
    assert policies[1].batch_epoch == 1  # the third batch ran in the first epoch again
    for want, got in zip(*plans, strict=True):
        assert_same_plan(got, want)
    assert bool(plans[1][2].admitted[0])  # X, alone in set B, takes its empty way


def test_bad_backends_and_batches_are_named(device) -> None:
    from engramrt.cache import CachedRowStore
    from engramrt.errors import EngramError, ValidationError
    from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store

    with pytest.raises(EngramError, match="backend='numpy' is not one of"):
        SetAssociativeLfu(2, 2, device, backend="numpy")
    store = make_store(TablePlacement(DeviceOptions(), device), num_rows=64, E=64)
    with pytest.raises(ValidationError, match="policy_backend = 'numpy'; expected None"):
        CachedRowStore(store, 8 * store.row_bytes, ways=2, policy_backend="numpy")
    policy = SetAssociativeLfu(2, 2, device)
    ids = torch.arange(6, device=device)
    with pytest.raises(ValidationError, match=r"slots has shape \(5,\); expected one per row id"):
        policy.plan_batch(ids, torch.full((5,), MISS, device=device))


def test_one_compiled_kernel_serves_every_batch_size(device, monkeypatch) -> None:
    """No kernel's constexprs (its compile-time values) depend on the number of ids: each
    new value would compile a kernel in the middle of serving, once per size met. Every
    launch's constexprs are recorded while the three steps run at sizes of 1 to 10 bits."""
    from engramrt._launch import CachedLauncher

    seen: dict[str, set[tuple]] = {}
    launch = CachedLauncher.__call__

    def recording(self, grid, *args, **constexprs):
        seen.setdefault(self.kernel.__name__, set()).add(tuple(sorted(constexprs.items())))
        return launch(self, grid, *args, **constexprs)

    monkeypatch.setattr(CachedLauncher, "__call__", recording)
    policy = SetAssociativeLfu(64, 4, device, backend="triton")
    for count in (1, 3, 17, 130, 700):
        ids = torch.arange(count, device=device) * 7
        slots = torch.full((count,), MISS, device=device)
        policy.record(ids, slots)
        policy.plan(ids)
        policy.plan_batch(ids, slots)
    assert {"_record_kernel", "_choose_victims_kernel", "_batch_victims_kernel"} <= set(seen)
    assert {name: len(values) for name, values in seen.items() if len(values) > 1} == {}
