"""Thin wrappers over ``torch.distributed`` shared by the lookups of this package.

Collectives here move *bit patterns*: bf16 rows travel as int32 words (two
values per word; a row of E >= 32 values never shares a word with another
rank's row), which gloo and NCCL both support, and int32 addition of a word
and an all-zero word is exact for every pattern (a bf16 sum would turn
-0.0 + +0.0 into +0.0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engramrt.errors import ShardingError, ValidationError
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.lookup.tiers.base import RowStore

__all__ = [
    "all_gather_into",
    "check_store_serves",
    "group_rank_and_size",
    "word_view",
]


def group_rank_and_size(group: Any, what: str) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (None: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ShardingError(
            f"{what} needs torch.distributed, which is not initialised; call "
            f"torch.distributed.init_process_group first"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ShardingError(f"{what}: this process is not a member of the group it was given")
    return rank, dist.get_world_size(group)


def word_view(rows: torch.Tensor) -> torch.Tensor:
    """Contiguous bf16 ``rows [..., E]`` as a flat int32 tensor of the same bytes."""
    return rows.view(torch.int32).view(-1)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """``all_gather_into_tensor`` under its torch 2.13 name when there is one.

    torch 2.13 renamed it ``all_gather_single`` (the old name warns); the
    H200 image has torch 2.11, which has only the old one.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def check_store_serves(
    store: RowStore, shard: ColumnShard, layout: EngramLayout, what: str
) -> None:
    """Refuse a store that does not hold ``shard``'s rows and serve its columns.

    The store must hold every row of the shard (a tp = 1 store may hold the
    checkpoint's whole table, more rows than the primes need) and serve
    exactly the shard's hash columns (SPEC §7).
    """
    E = layout.config.head_dim
    if store.E != E:
        raise ValidationError(f"{what}: store has E={store.E}; the config has head_dim E={E}")
    if store.row_begin > shard.row_begin or store.row_end < shard.row_end:
        raise ShardingError(
            f"{what}: store holds rows [{store.row_begin}, {store.row_end}) but rank {shard.rank} "
            f"of {shard.tp} needs rows [{shard.row_begin}, {shard.row_end}) (hash columns "
            f"[{shard.col_begin}, {shard.col_end}))"
        )
    store_end = layout.n_cols if store.col_end is None else store.col_end
    if (store.col_begin, store_end) != (shard.col_begin, shard.col_end):
        raise ShardingError(
            f"{what}: store serves hash columns [{store.col_begin}, {store_end}) but rank "
            f"{shard.rank} of {shard.tp} owns [{shard.col_begin}, {shard.col_end}) of "
            f"C={layout.n_cols} (SPEC §7: part = ceil(C/{shard.tp})); build the store with "
            f"col_begin={shard.col_begin}, col_end={shard.col_end}"
        )
