"""Tensor-parallel rows on every rank: all-gather (or all-reduce) of column shards.

Under tensor parallelism (SPEC §7) rank ``r`` of a group of ``tp`` owns the
hash columns ``[r*part, min((r+1)*part, C))``, ``part = ceil(C/tp)``, and
holds only their rows. Every rank sees the same batch (the same
``row_ids [T, C]``); one step:

1. each rank looks up its columns from its shard store;
2. one collective over the group gives every rank all ``C`` columns.

Collectives (``collective=``), with ``B = T*C*E*2`` bytes of bf16 rows and
ring algorithms:

================  =====================================  ==========================
collective        each rank contributes                  sent / received per rank
================  =====================================  ==========================
``all_gather``    its column block ``[T, part, E]``      ``(tp-1)/tp B``
``all_reduce``    zero-filled ``[T, C, E]``              ``2 (tp-1)/tp B``
================  =====================================  ==========================

``all_gather`` (default) puts ``tp`` times fewer bytes into the collective
and the wire carries half of a ring all-reduce, with no arithmetic. The
gathered tensor is ``[tp, T, part, E]``; one copy transposes it into
``[T, C, E]``, dropping the ``tp*part - C`` padding columns of the last
rank(s). ``all_reduce`` sums int32 words of bf16 patterns (a word and a zero
word add exactly), so it gives the same bits with no transposing copy.
Under sequence parallelism, where each rank needs only its share of the
tokens, :class:`~engramrt.exchange.SequenceParallelExchange` moves ``1/tp``
of this all-gather's output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engramrt.exchange._collectives import all_gather_into, word_view
from engramrt.exchange.base import RowExchange

__all__ = ["ALL_GATHER_COLLECTIVES", "AllGatherExchange"]

ALL_GATHER_COLLECTIVES: tuple[str, ...] = ("all_gather", "all_reduce")


class AllGatherExchange(RowExchange):
    """Full rows ``[T, C, E]`` on every rank of a TP group, each rank serving its columns.

    Args:
        store, num_cols, group: see :class:`~engramrt.exchange.RowExchange`.
        collective: ``"all_gather"`` (default) or ``"all_reduce"`` (see the
            module doc); both give the same bits.

    Every rank must fetch the same ``row_ids`` (not checked: that would
    cost a collective per step).
    """

    collectives = ALL_GATHER_COLLECTIVES

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``row_ids [T, C]`` (the same on every rank) -> ``[T, C, E]`` bf16 on the store's device."""
        num_tokens = self._check_row_ids(row_ids)
        if self.world == 1 or num_tokens == 0:  # nothing to exchange (T is the same everywhere)
            return self.store.lookup(row_ids, out=out)
        if self.collective_op == "all_reduce":
            # Zeros outside this rank's columns; summing the words of all ranks is exact.
            rows = self.store.lookup(row_ids, out=out)  # [T, C, E]
            dist.all_reduce(word_view(rows), op=dist.ReduceOp.SUM, group=self.group)
            return rows
        part, E = self.cols_per_rank, self.E
        own = self.col_end - self.col_begin
        local = self.store.lookup(row_ids)  # [T, C, E], zeros outside [col_begin, col_end)
        block = local.new_zeros((num_tokens, part, E))  # [T, part, E]; padding columns stay 0
        block[:, :own] = local[:, self.col_begin : self.col_end]
        gathered = local.new_empty((self.world, num_tokens, part, E))  # [tp, T, part, E]
        all_gather_into(word_view(gathered), word_view(block), self.group)
        full = gathered.permute(1, 0, 2, 3).reshape(num_tokens, self.world * part, E)
        if out is None:
            return full[:, : self.num_cols].contiguous()  # drop padding columns
        return out.copy_(full[:, : self.num_cols])
