"""Thin wrappers over ``torch.distributed`` shared by the exchanges.

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

from engramrt.errors import ShardingError

__all__ = [
    "all_gather_into",
    "group_rank_and_size",
    "reduce_scatter_into",
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


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """``reduce_scatter_tensor`` (sum) under its torch 2.13 name when there is one.

    torch 2.13 renamed it ``reduce_scatter_single`` (the old name warns); the
    H200 image has torch 2.11, which has only the old one.
    """
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group)
