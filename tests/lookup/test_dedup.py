"""sorted_unique equals torch.unique, without sizing its result on the host."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engramrt.lookup.dedup import sorted_unique


def _check(ids: torch.Tensor) -> None:
    unique, inverse, count = sorted_unique(ids)
    expected, expected_inverse = torch.unique(ids, sorted=True, return_inverse=True)
    n = int(count)
    assert count.dtype == torch.int32 and count.shape == (1,)
    assert inverse.dtype == torch.int32
    assert unique.dtype == ids.dtype and unique.shape == ids.shape
    assert torch.equal(unique[:n], expected)
    assert torch.equal(inverse.long(), expected_inverse)
    assert torch.equal(unique[inverse.long()], ids)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=300),
    repeat=st.integers(1, 4),
    wide=st.booleans(),
)
def test_matches_torch_unique(values: list[int], repeat: int, wide: bool) -> None:
    ids = torch.tensor(values * repeat, dtype=torch.int64 if wide else torch.int32)
    _check(ids[torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(len(values)))])


@pytest.mark.parametrize("n", [1, 2, 1000])
def test_all_equal_and_all_distinct(n: int, device: torch.device) -> None:
    _check(torch.full((n,), 7, dtype=torch.int32, device=device))
    _check(torch.arange(n, 0, -1, dtype=torch.int64, device=device))


def test_wide_ids_keep_their_width(device: torch.device) -> None:
    ids = torch.tensor([2**40, 3, 2**40, -5], dtype=torch.int64, device=device)
    unique, inverse, count = sorted_unique(ids)
    assert unique[: int(count)].tolist() == [-5, 3, 2**40]
    assert inverse.tolist() == [2, 1, 2, 0]
