"""Head sharding over every rank (TP x DP) with an all-to-all exchange of ids and rows.

When the tables should not be held once per TP group (a node's host memory
is too small for one copy per node, or the tables should sit in HBM: at
V4.1-Flash sizes a world of 8 GPUs holds 23.6 GiB each instead of 94.4 GiB
each under TP = 2), the hash columns are sharded over all ``W`` ranks of a
group exactly as SPEC §7 shards them over a TP group: rank ``r`` owns
columns ``owned_columns(C, W, r)``. Data-parallel
replicas now see *different* batches, so rows cannot be rebuilt by a
gather; instead, per step:

1. each rank splits its ``row_ids [T_r, C]`` by owner: block ``j`` is
   ``row_ids[:, cols_j]`` (``T_r * |cols_j|`` ids);
2. the split sizes are exchanged (``all_to_all_single`` of ``W`` counts),
   then the ids (``all_to_all_single`` with those splits);
3. each owner looks up what it received, ``[sum_i T_i, |cols_own|]`` ids, in
   one call of its store;
4. the rows go back along the reverse splits; rank ``r`` places block ``j``
   into columns ``cols_j`` of its ``[T_r, C, E]``.

Bytes per rank and step: ids ``8 * T_r * C`` out and in, rows
``2 * T_r * C * E`` back (less the own block). Every rank of the group must
take part in every step, with ``T_r = 0`` when it has no tokens. Step 2
reads the counts on the host (a synchronisation; not CUDA-graph capturable:
the exchange's :attr:`~engramrt.source.RowSource.host_sync` is set).

:func:`all_to_all_lookup_reference` performs the same routing in one
process over a list of stores, as the plain definition of the exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from engramrt.errors import ValidationError
from engramrt.exchange.base import RowExchange
from engramrt.layout import owned_columns
from engramrt.lookup.tiers.base import RowStore

__all__ = ["AllToAllExchange", "all_to_all_lookup_reference"]


def _owned_rows(store: RowStore, ids: torch.Tensor) -> torch.Tensor:
    """``ids [n, k]`` of the store's own columns -> ``[n, k, E]`` bf16 rows.

    The ids are placed at the store's column range of a ``[n, col_begin + k]``
    id matrix (the columns before it are never read).
    """
    query = ids.new_zeros((ids.shape[0], store.col_begin + ids.shape[1]))
    query[:, store.col_begin :] = ids
    return store.lookup(query)[:, store.col_begin :]


def all_to_all_lookup_reference(
    row_ids_per_rank: Sequence[torch.Tensor], stores: Sequence[RowStore], num_cols: int
) -> list[torch.Tensor]:
    """The all-to-all exchange simulated in one process.

    Args:
        row_ids_per_rank: ``W`` batches ``[T_r, C]`` (one per rank).
        stores: ``W`` shard stores, store ``j`` serving rank ``j``'s columns.
        num_cols: ``C``.

    Returns:
        ``W`` tensors ``[T_r, C, E]`` bf16 on the CPU: what each rank receives,
        equal bit for bit to looking its batch up in the unsharded table.
    """
    world = len(stores)
    if len(row_ids_per_rank) != world:
        raise ValidationError(
            f"{len(row_ids_per_rank)} batches for {world} stores; expected one batch per rank"
        )
    bounds = [owned_columns(num_cols, world, rank) for rank in range(world)]
    E = stores[0].E
    results = [
        torch.empty((ids.shape[0], num_cols, E), dtype=torch.bfloat16) for ids in row_ids_per_rank
    ]
    for owner, (c0, c1) in enumerate(bounds):
        received = torch.cat([ids[:, c0:c1] for ids in row_ids_per_rank])  # [sum T_i, |cols|]
        rows = _owned_rows(stores[owner], received.to(stores[owner].device)).cpu()
        start = 0
        for i, ids in enumerate(row_ids_per_rank):
            results[i][:, c0:c1] = rows[start : start + ids.shape[0]]
            start += ids.shape[0]
    return results


class AllToAllExchange(RowExchange):
    """Rows ``[T_r, C, E]`` of each rank's own batch, the columns sharded over the whole group.

    Args:
        store, num_cols, group: see :class:`~engramrt.exchange.RowExchange`;
            the group is every rank that shares the tables (TP x DP), and
            ``store`` serves this rank's columns of it (the same store a TP
            group of that size would use).
    """

    def __init__(self, store: RowStore, *, num_cols: int, group: Any = None) -> None:
        super().__init__(store, num_cols=num_cols, group=group)
        self.bounds = [owned_columns(num_cols, self.world, rank) for rank in range(self.world)]

    @property
    def host_sync(self) -> bool:  # type: ignore[override]  # a property of the base
        """True: the split sizes come to the host."""
        return True

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``row_ids [T_r, C]`` of this rank's batch -> ``[T_r, C, E]`` bf16 on the store's device.

        Every rank of the group calls it once per step; ``T_r`` may differ
        between ranks (and be 0).
        """
        num_tokens = self._check_row_ids(row_ids)
        device, E = self.device, self.E
        ids = row_ids.to(device=device, dtype=torch.int64)
        send_ids = torch.cat([ids[:, c0:c1].reshape(-1) for c0, c1 in self.bounds])
        send_counts = [num_tokens * (c1 - c0) for c0, c1 in self.bounds]
        counts = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv_counts_tensor = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts_tensor, counts, group=self.group)
        recv_counts = [int(n) for n in recv_counts_tensor.tolist()]  # host sync
        recv_ids = torch.empty(sum(recv_counts), dtype=torch.int64, device=device)
        dist.all_to_all_single(recv_ids, send_ids, recv_counts, send_counts, group=self.group)
        own = self.col_end - self.col_begin
        rows = _owned_rows(self.store, recv_ids.view(-1, own))  # [sum T_i, own, E]
        # Back along the reverse splits, one int32 row of E/2 words per (token, column).
        send_rows = rows.contiguous().view(torch.int32).view(-1, E // 2)
        recv_rows = torch.empty(
            (num_tokens * self.num_cols, E // 2), dtype=torch.int32, device=device
        )
        dist.all_to_all_single(recv_rows, send_rows, send_counts, recv_counts, group=self.group)
        if out is None:
            out = torch.empty((num_tokens, self.num_cols, E), dtype=torch.bfloat16, device=device)
        start = 0
        for (c0, c1), count in zip(self.bounds, send_counts, strict=True):
            block = recv_rows[start : start + count].view(torch.bfloat16)
            out[:, c0:c1] = block.view(num_tokens, c1 - c0, E)
            start += count
        return out
