"""Tensor-parallel lookup: each rank serves its hash columns, the group rebuilds ``[T, C, E]``.

Under head sharding (SPEC §7) rank ``r`` of a TP group of ``tp`` ranks owns
the hash columns ``[r*part, min((r+1)*part, C))`` with ``part = ceil(C/tp)``
and holds only their rows. Every rank sees the same batch (the same
``row_ids [T, C]``); one step:

1. each rank looks up its columns from its shard store;
2. one collective over the TP group gives every rank all ``C`` columns.

Collectives (``collective=``), with ``B = T*C*E*2`` bytes of bf16 rows and
ring algorithms:

================  =====================================  ==========================
collective        each rank contributes                  sent / received per rank
================  =====================================  ==========================
``all_gather``    its column block ``[T, part, E]``      ``(tp-1)/tp B``
``all_reduce``    zero-filled ``[T, C, E]``              ``2 (tp-1)/tp B``
================  =====================================  ==========================

``all_gather`` (default) is the choice without measuring: each rank puts
``tp`` times fewer bytes into the collective and the wire carries half of
a ring all-reduce, with no arithmetic at all. The gathered tensor is
``[tp, T, part, E]``; one copy transposes it into ``[T, C, E]``, dropping
the ``tp*part - C`` padding columns of the last rank(s). ``all_reduce``
sums int32 words of bf16 patterns (a word and a zero word add exactly), so
it gives the same bits; it needs no transposing copy and may win at decode
sizes where both are latency-bound (B = 3 MB at T = 256 for V4.1-Flash).

Same code over gloo (CPU tensors) and NCCL (CUDA tensors): tensors live on
the store's device. Under sequence parallelism, where each rank needs only
its share of the tokens, use :class:`engramrt.layer.parallel.SequenceParallelRows`
instead (a reduce-scatter moves ``1/tp`` of this all-gather's output).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engramrt.distributed._collectives import (
    all_gather_into,
    check_store_serves,
    group_rank_and_size,
    word_view,
)
from engramrt.errors import ValidationError
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers.base import RowStore

__all__ = ["TP_COLLECTIVES", "TPLookup"]

TP_COLLECTIVES: tuple[str, ...] = ("all_gather", "all_reduce")


class TPLookup:
    """Full rows ``[T, C, E]`` on every rank of a TP group, each rank serving its columns.

    Args:
        store: this rank's shard of the layer's table: rows
            ``[shard.row_begin, shard.row_end)`` (or more), serving hash
            columns ``[shard.col_begin, shard.col_end)`` with
            ``shard = layout.column_shard(layer_index, tp, rank)``.
        layout: the config's layout.
        layer_index: position of the layer in ``config.layer_ids``.
        group: the TP process group (None: the default group); gloo for
            CPU stores, NCCL for CUDA stores.
        collective: ``"all_gather"`` (default) or ``"all_reduce"`` (see the
            module doc); both give the same bits.

    Raises:
        ShardingError: torch.distributed is not initialised, the process is
            not in ``group``, the group's size leaves some rank without a
            hash column (``layout.cols_per_rank`` says which), or the store
            serves other rows or columns.

    Attributes:
        tp, rank: the group's size and this process's rank in it.
        shard: the :class:`~engramrt.layout.ColumnShard` this rank serves.
        cols_per_rank: ``part = ceil(C / tp)``.
    """

    def __init__(
        self,
        store: RowStore,
        layout: EngramLayout,
        layer_index: int,
        group: Any = None,
        *,
        collective: str = "all_gather",
    ) -> None:
        if collective not in TP_COLLECTIVES:
            raise ValidationError(
                f"collective={collective!r}; expected one of {', '.join(TP_COLLECTIVES)}"
            )
        self.rank, self.tp = group_rank_and_size(group, "TPLookup")
        # Refuses a tp that leaves a rank without a column, with the reason.
        self.shard = layout.column_shard(layer_index, self.tp, self.rank)
        self.cols_per_rank = layout.cols_per_rank(self.tp)
        check_store_serves(store, self.shard, layout, "TPLookup")
        self.store = store
        self.layout = layout
        self.layer_index = layer_index
        self.group = group
        self.collective = collective
        self.num_cols = layout.n_cols
        self.E = store.E

    @property
    def device(self) -> torch.device:
        return self.store.device

    def __call__(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``row_ids [T, C]`` (the same on every rank) -> ``[T, C, E]`` bf16 on the store's device.

        Every rank of the group must call this with the same ``row_ids``
        (not checked: that would cost a collective per step). ``out``, when
        given, is a contiguous bf16 ``[T, C, E]`` tensor on the store's device.
        """
        if row_ids.dim() != 2 or row_ids.shape[1] != self.num_cols:
            raise ValidationError(
                f"row_ids has shape {tuple(row_ids.shape)}; expected [T, C] with "
                f"C={self.num_cols} hash columns"
            )
        num_tokens = row_ids.shape[0]
        if self.tp == 1 or num_tokens == 0:  # nothing to exchange (T is the same on every rank)
            return self.store.lookup(row_ids, out=out)
        if self.collective == "all_reduce":
            # Zeros outside this rank's columns; summing the words of all ranks is exact.
            rows = self.store.lookup(row_ids, out=out)  # [T, C, E]
            dist.all_reduce(word_view(rows), op=dist.ReduceOp.SUM, group=self.group)
            return rows
        part, E = self.cols_per_rank, self.E
        own = self.shard.num_cols
        local = self.store.lookup(row_ids)  # [T, C, E], zeros outside [col_begin, col_end)
        block = local.new_zeros((num_tokens, part, E))  # [T, part, E]; padding columns stay 0
        block[:, :own] = local[:, self.shard.col_begin : self.shard.col_end]
        gathered = local.new_empty((self.tp, num_tokens, part, E))  # [tp, T, part, E]
        all_gather_into(word_view(gathered), word_view(block), self.group)
        full = gathered.permute(1, 0, 2, 3).reshape(num_tokens, self.tp * part, E)
        if out is None:
            return full[:, : self.num_cols].contiguous()  # drop padding columns
        return out.copy_(full[:, : self.num_cols])

    def __repr__(self) -> str:
        return (
            f"TPLookup(rank={self.rank}, tp={self.tp}, cols=[{self.shard.col_begin}, "
            f"{self.shard.col_end}), collective={self.collective!r}, store={self.store!r})"
        )
