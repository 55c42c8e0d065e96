"""Tensor-parallel head sharding (SPEC §7): the ranks' lookups, each from its
own contiguous row range, rebuild the unsharded lookup column by column."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers import DEVICE, random_packed_table
from tests.lookup.stores import store_of

from engramrt.lookup import lookup_rows, lookup_rows_reference

E = 32


def rank_columns(num_cols: int, tp: int, rank: int) -> tuple[int, int]:
    """SPEC §7: ``part = ceil(C / tp)``; rank r owns ``[r*part, min((r+1)*part, C))``."""
    part = math.ceil(num_cols / tp)
    return rank * part, min((rank + 1) * part, num_cols)


def shard_lookups(
    row_ids: torch.Tensor,
    table: torch.Tensor,
    offsets: list[int],
    tp: int,
    tier: str,
    row_shift: int = 0,
) -> list[torch.Tensor]:
    """Each rank's ``[T, C, E]`` lookup from only its columns' rows."""
    num_cols = row_ids.shape[1]
    outputs = []
    for rank in range(tp):
        col_begin, col_end = rank_columns(num_cols, tp, rank)
        row_begin, row_end = offsets[col_begin], offsets[col_end]
        shard = table[row_begin:row_end]
        if tier == "kernel":
            outputs.append(
                lookup_rows(
                    row_ids,
                    shard.to(DEVICE),
                    col_begin=col_begin,
                    col_end=col_end,
                    row_begin=row_begin + row_shift,
                    backend="triton",
                )
            )
        else:
            store = store_of(
                tier,
                shard,
                row_begin=row_begin + row_shift,
                col_begin=col_begin,
                col_end=col_end,
            )
            outputs.append(store.lookup(row_ids))
    return outputs


def reassemble(outputs: list[torch.Tensor], num_cols: int, tp: int) -> torch.Tensor:
    """What an all-gather of the owned columns rebuilds; non-owned columns must be +0."""
    pieces = []
    for rank, output in enumerate(outputs):
        col_begin, col_end = rank_columns(num_cols, tp, rank)
        bits = output.view(torch.int16)
        assert bool((bits[:, :col_begin] == 0).all()) and bool((bits[:, col_end:] == 0).all())
        pieces.append(output[:, col_begin:col_end])
    return torch.cat(pieces, dim=1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_tokens=st.integers(0, 9),
    bucket_sizes=st.lists(st.integers(1, 13), min_size=1, max_size=9),
    tp=st.integers(1, 9),
    tier=st.sampled_from(["kernel", "device", "host"]),
    seed=st.integers(0, 2**16),
)
def test_shards_rebuild_the_full_lookup(
    num_tokens: int, bucket_sizes: list[int], tp: int, tier: str, seed: int
) -> None:
    num_cols = len(bucket_sizes)
    if any(rank_columns(num_cols, tp, r)[0] >= rank_columns(num_cols, tp, r)[1] for r in range(tp)):
        return  # SPEC §7: a tp that leaves a rank without a column is refused
    offsets = [0]
    for size in bucket_sizes:
        offsets.append(offsets[-1] + size)
    table = random_packed_table(offsets[-1], E, seed)
    g = torch.Generator().manual_seed(seed)
    row_ids = torch.stack(
        [
            torch.randint(offsets[c], offsets[c + 1], (num_tokens,), generator=g)
            for c in range(num_cols)
        ],
        dim=1,
    ).to(torch.int32)
    full = lookup_rows_reference(row_ids, table, E)
    rebuilt = reassemble(shard_lookups(row_ids.to(DEVICE), table, offsets, tp, tier), num_cols, tp)
    assert torch.equal(rebuilt.view(torch.int16).cpu(), full.view(torch.int16))


def test_negative_control_wrong_row_begin_is_caught() -> None:
    """Shards that misplace their rows by one do not rebuild the lookup."""
    bucket_sizes = [5, 7, 3, 11]
    offsets = [0, 5, 12, 15, 26]
    table = random_packed_table(26, E, seed=1)
    row_ids = torch.tensor([[1, 6, 13, 16], [4, 11, 14, 25]], dtype=torch.int64)
    assert bool((row_ids > torch.tensor(offsets[:-1])).all())  # id - 1 stays inside its shard
    full = lookup_rows_reference(row_ids, table, E)
    good = reassemble(
        shard_lookups(row_ids.to(DEVICE), table, offsets, 2, "kernel"), len(bucket_sizes), 2
    )
    assert torch.equal(good.view(torch.int16).cpu(), full.view(torch.int16))
    shifted = reassemble(
        shard_lookups(row_ids.to(DEVICE), table, offsets, 2, "kernel", row_shift=1),
        len(bucket_sizes),
        2,
    )
    assert not torch.equal(shifted.view(torch.int16).cpu(), full.view(torch.int16))
