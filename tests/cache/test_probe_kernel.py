"""The Triton probe + gather kernel agrees with its torch reference, bit for bit.

Runs through Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``), on the GPU with ``ENGRAMRT_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers import assert_same_bits, random_packed_table

from engramrt.cache import MISS, NOT_OWNED, SetAssociativeLfu, probe_gather_reference, set_index
from engramrt.cache.kernel import probe_gather_triton
from engramrt.lookup import LookupKernelConfig, lookup_rows_reference


def filled_index(
    num_sets: int, ways: int, resident: torch.Tensor, E: int, device: torch.device
) -> tuple[SetAssociativeLfu, torch.Tensor]:
    """An index holding ``resident`` ids (as many as fit) and random packed rows in every slot."""
    policy = SetAssociativeLfu(num_sets, ways, device)
    policy.access(resident)
    rows = random_packed_table(policy.num_slots + 1, E, seed=num_sets * 31 + ways).to(device)
    return policy, rows


@pytest.mark.parametrize(
    ("T", "C", "E", "num_sets", "ways", "id_dtype", "cols", "base"),
    [
        (9, 5, 64, 3, 4, torch.int64, (0, 5), 0),
        (13, 24, 256, 7, 8, torch.int32, (0, 24), 1000),  # V4.1 columns and row width
        (6, 7, 96, 5, 2, torch.int64, (2, 5), 2**40),  # NB=3 padded to 4; ids past 2**32; a shard
        (4, 3, 32, 1, 1, torch.int64, (1, 3), 7),  # one set of one way
        (5, 2, 64, 2, 64, torch.int32, (0, 2), 0),  # 64 ways
    ],
)
@pytest.mark.parametrize("read_misses", [False, True], ids=["misses-left", "misses-read"])
def test_kernel_matches_reference(
    read_misses: bool,
    T: int,
    C: int,
    E: int,
    num_sets: int,
    ways: int,
    id_dtype: torch.dtype,
    cols: tuple[int, int],
    base: int,
    device: torch.device,
) -> None:
    g = torch.Generator().manual_seed(T * C + E)
    universe = base + torch.randperm(4 * num_sets * ways + 8, generator=g)[: 2 * num_sets * ways]
    policy, rows = filled_index(num_sets, ways, universe[: num_sets * ways], E, device)
    picks = torch.randint(0, universe.shape[0], (C, T), generator=g)
    row_ids = universe[picks].t()  # [T, C], non-contiguous: strides (1, T)
    col_begin, col_end = cols
    row_ids[:, :col_begin] = -5  # not owned: anything
    if id_dtype == torch.int32:
        row_ids = row_ids.clamp(max=2**31 - 1)
    row_ids = row_ids.to(id_dtype).to(device)

    # Misses read the backing tier's rows when given: a table of every id of
    # the universe (global row base + i), other bytes than the cache's slots.
    backing = random_packed_table(4 * num_sets * ways + 8, E, seed=E + 1).to(device)
    read = {"backing": backing, "backing_row_begin": base} if read_misses else {}
    poison = torch.full((T, C, E), float("nan"), dtype=torch.bfloat16, device=device)
    out_ref, out_kernel = poison.clone(), poison.clone()
    slots_ref = probe_gather_reference(
        row_ids,
        policy.tags,
        rows,
        out_ref,
        num_sets=num_sets,
        ways=ways,
        col_begin=col_begin,
        col_end=col_end,
        **read,
    )
    slots_kernel = torch.full((T, C), -99, dtype=torch.int64, device=device)
    probe_gather_triton(
        row_ids,
        policy.tags,
        rows,
        out_kernel,
        slots_kernel,
        num_sets=num_sets,
        ways=ways,
        col_begin=col_begin,
        col_end=col_end,
        kernel=LookupKernelConfig(rows_per_program=4),
        **read,
    )
    assert torch.equal(slots_kernel.cpu(), slots_ref.cpu())
    assert_same_bits(out_kernel, out_ref)  # misses stay NaN-poisoned in both, or are read
    miss = (slots_ref == MISS).cpu()
    if read_misses:  # a miss holds the backing's row, dequantised as every tier does
        local = torch.where(miss, row_ids.cpu().to(torch.int64) - base, 0)
        expected = lookup_rows_reference(local, backing.cpu(), E)
        assert_same_bits(out_ref.cpu()[miss], expected[miss])
    else:
        assert bool(out_ref.cpu()[miss].isnan().all())

    # The probe found exactly the resident ids, each in its own set.
    owned = torch.zeros(C, dtype=torch.bool)
    owned[col_begin:col_end] = True
    slots = slots_ref.cpu()
    assert bool((slots[:, ~owned] == NOT_OWNED).all())
    ids = row_ids.cpu().to(torch.int64)
    resident = set(policy.resident_ids().tolist())
    for t in range(T):
        for c in range(col_begin, col_end):
            rid = int(ids[t, c])
            if rid in resident:
                slot = int(slots[t, c])
                assert slot // ways == int(set_index(torch.tensor([rid]), num_sets))
                assert int(policy.tags[slot]) == rid
            else:
                assert int(slots[t, c]) == MISS
    hits = slots >= 0
    assert bool(hits.any()) and bool((slots[:, owned] == MISS).any())  # both kinds occur


def test_kernel_empty_batch(device: torch.device) -> None:
    """An empty batch writes nothing: poisoned buffers around the empty outputs, the index and
    the rows stay as they were; the control (one token) shows the same check sees a write."""
    policy, rows = filled_index(2, 4, torch.arange(8), 64, device)
    tags, packed = policy.tags.clone(), rows.clone()
    out_buffer = torch.full((2, 24, 64), float("nan"), dtype=torch.bfloat16, device=device)
    slots_buffer = torch.full((2, 24), -7, dtype=torch.int64, device=device)
    for tokens in (0, 1):
        out_buffer.fill_(float("nan"))
        slots_buffer.fill_(-7)
        row_ids = torch.arange(tokens * 24, dtype=torch.int32, device=device).reshape(tokens, 24)
        probe_gather_triton(
            row_ids,
            policy.tags,
            rows,
            out_buffer[:tokens],
            slots_buffer[:tokens],
            num_sets=2,
            ways=4,
            col_begin=0,
            col_end=24,
        )
        untouched = bool(out_buffer.isnan().all()) and bool((slots_buffer == -7).all())
        assert untouched == (tokens == 0)  # tokens=1: the check does see a write
        assert bool(out_buffer[1:].isnan().all()) and bool((slots_buffer[1:] == -7).all())
        assert torch.equal(policy.tags, tags) and torch.equal(rows, packed)
