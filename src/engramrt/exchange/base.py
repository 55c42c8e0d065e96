"""``RowExchange``: what every exchange shares.

An exchange holds this rank's shard store (a :class:`RowStore` built for
the hash columns :func:`engramrt.layout.owned_columns` gives this rank, or a
cache in front of one) and a process group; it checks once, at
construction, that the store serves exactly those columns. Its capability
flags are the store's, read when asked (a cache's follow
:meth:`~engramrt.source.RowSource.use_gpu_reads`, which the exchange passes on),
plus :attr:`~engramrt.source.RowSource.collective`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engramrt.errors import ShardingError, ValidationError, check_choice
from engramrt.exchange._collectives import group_rank_and_size
from engramrt.layout import owned_columns
from engramrt.lookup.tiers.base import RowStore
from engramrt.source import RowSource

__all__ = ["RowExchange"]


class RowExchange(RowSource):
    """Base of the exchanges: a shard store, a group, and this rank's columns.

    Args:
        store: this rank's shard of the layer's table, serving hash columns
            ``owned_columns(num_cols, world, rank)``.
        num_cols: ``C``, the hash columns of the layer.
        group: the process group (None: the default group).
        collective: one of the class's :attr:`collectives` (default the first);
            None for a class without a choice.

    Attributes:
        rank, world: this process's rank in ``group`` and the group's size.
        col_begin, col_end: the hash columns this rank owns.
        cols_per_rank: ``ceil(C / world)``.

    Raises:
        ShardingError: torch.distributed is not initialised, this process
            is not in ``group``, ``world`` leaves a rank without a column, or
            the store serves other columns.
    """

    collective = True
    collectives: ClassVar[tuple[str, ...]] = ()
    """The collectives an exchange of this class may run (its ``collective`` argument
    picks one, the first by default); empty: it has one way."""

    def __init__(
        self, store: RowStore, *, num_cols: int, group: Any = None, collective: str | None = None
    ) -> None:
        if self.collectives:
            collective = self.collectives[0] if collective is None else collective
            check_choice("collective", collective, self.collectives)
        elif collective is not None:
            raise ValidationError(
                f"collective={collective!r}; {type(self).__name__} has no choice of collective"
            )
        self.collective_op = collective
        if not isinstance(store, RowStore):
            raise ValidationError(
                f"store is a {type(store).__name__}; expected a RowStore (see make_store)"
            )
        if isinstance(num_cols, bool) or not isinstance(num_cols, int) or num_cols < 1:
            raise ValidationError(f"num_cols={num_cols!r}; expected a positive int (C)")
        what = type(self).__name__
        self.rank, self.world = group_rank_and_size(group, what)
        self.col_begin, self.col_end = owned_columns(num_cols, self.world, self.rank)
        self.cols_per_rank = -(-num_cols // self.world)
        store_end = num_cols if store.col_end is None else store.col_end
        if (store.col_begin, store_end) != (self.col_begin, self.col_end):
            raise ShardingError(
                f"{what}: store serves hash columns [{store.col_begin}, {store_end}) but rank "
                f"{self.rank} of {self.world} owns [{self.col_begin}, {self.col_end}) of "
                f"C={num_cols} (SPEC §7: part = ceil(C/{self.world})); build the store with "
                f"col_begin={self.col_begin}, col_end={self.col_end} "
                f"(engramrt.layout.EngramLayout.column_shard)"
            )
        self.store = store
        self.group = group
        self.num_cols = num_cols
        self.E = store.E
        self.device: torch.device = store.device

    @property
    def host_sync(self) -> bool:  # type: ignore[override]  # a class attribute elsewhere
        """The store's :attr:`~engramrt.source.RowSource.host_sync` (an exchange whose
        collective needs the host adds its own)."""
        return self.store.host_sync

    @property
    def has_update(self) -> bool:  # type: ignore[override]  # a class attribute elsewhere
        """The store's :attr:`~engramrt.source.RowSource.has_update`."""
        return self.store.has_update

    def use_gpu_reads(self, on: bool) -> bool:
        """Passed to the store, which reads this rank's rows (see
        :meth:`~engramrt.source.RowSource.use_gpu_reads`)."""
        return self.store.use_gpu_reads(on)

    @property
    def tp(self) -> int:
        """The group's size (the tensor-parallel degree for TP exchanges)."""
        return self.world

    def update(self, stream: torch.cuda.Stream | None = None) -> None:
        self.store.update(stream)

    def stats(self) -> Any:
        return self.store.stats()

    def _check_row_ids(self, row_ids: torch.Tensor) -> int:
        if row_ids.dim() != 2 or row_ids.shape[1] != self.num_cols:
            raise ValidationError(
                f"row_ids has shape {tuple(row_ids.shape)}; expected [T, C] with "
                f"C={self.num_cols} hash columns"
            )
        return row_ids.shape[0]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world={self.world}, cols=[{self.col_begin}, "
            f"{self.col_end}), store={self.store!r})"
        )
