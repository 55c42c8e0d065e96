"""engramrt's steps as PyTorch custom operators, for ``torch.compile`` and CUDA graphs.

Serving engines compile their model with ``torch.compile(fullgraph=True)``;
a plain Python launch of a Triton kernel inside it breaks the graph. The
operators here (namespace ``engramrt``) are opaque to the compiler, carry
fake implementations that give output shapes and dtypes without running
anything, and call the same launchers as the eager API, so a compiled
model computes the eager bytes:

=====================================  =======================================  ==========
operator                               what                                     mutates
=====================================  =======================================  ==========
``engramrt::hash_ids``                 row ids ``[T, L, C]`` (SPEC §4-5)         nothing
``engramrt::hash_ids_slot_cache``      the same, history in a SlotHashCache     its slots
``engramrt::hash_ids_request_history`` the same, history in a RequestHistory    its ring
``engramrt::lookup_rows``              rows ``[T, C, E]`` of a packed table     nothing
``engramrt::fetch_rows``               rows of any registered row source        nothing
``engramrt::engram_gate``              the fused gate (SPEC §8)                 nothing
=====================================  =======================================  ==========

Objects the operators cannot take as arguments (a hasher with its
constants and history, a row source with its memory and threads) are
registered once under a name (:func:`register_hasher`,
:func:`register_source`) and named in the call, as engines name their
attention layers. The hasher's history tensors are passed explicitly as
well, so the compiler sees the mutation. Host-side checks are the
registered objects' own settings: build them with their synchronising
checks off (the default) to capture a step.

Importing this module registers the operators; ``import engramrt`` does not.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, NgramHasher, RequestHistory, SlotHashCache
from engramrt.source import RowSource

__all__ = [
    "engram_gate",
    "fetch_rows",
    "hash_batch",
    "hash_ids",
    "hash_ids_request_history",
    "hash_ids_slot_cache",
    "head_step",
    "lookup_rows",
    "register_hasher",
    "register_source",
]

_HASHERS: dict[str, tuple[NgramHasher, SlotHashCache | RequestHistory | None]] = {}
_SOURCES: dict[str, RowSource] = {}


def register_hasher(
    name: str, hasher: NgramHasher, history: SlotHashCache | RequestHistory | None = None
) -> None:
    """Make ``hasher`` (and the history it updates) callable as ``hash_ids(..., name)``."""
    if not isinstance(hasher, NgramHasher):
        raise ValidationError(f"hasher is a {type(hasher).__name__}; expected an NgramHasher")
    _HASHERS[name] = (hasher, history)


def register_source(name: str, source: RowSource) -> None:
    """Make ``source`` callable as ``fetch_rows(row_ids, name)``."""
    if not isinstance(source, RowSource):
        raise ValidationError(f"source is a {type(source).__name__}; expected a RowSource")
    _SOURCES[name] = source


def _hasher(name: str) -> tuple[NgramHasher, SlotHashCache | RequestHistory | None]:
    try:
        return _HASHERS[name]
    except KeyError:
        raise ValidationError(
            f"hasher name {name!r} is not registered; expected one of {sorted(_HASHERS)} "
            f"(engramrt.custom_ops.register_hasher)"
        ) from None


def _source(name: str) -> RowSource:
    try:
        return _SOURCES[name]
    except KeyError:
        raise ValidationError(
            f"source name {name!r} is not registered; expected one of {sorted(_SOURCES)} "
            f"(engramrt.custom_ops.register_source)"
        ) from None


# -- hashing -------------------------------------------------------------------
#
# Three operators, one per kind of history, so that each declares exactly the
# tensors it mutates (an optional mutated argument does not survive Inductor's
# lowering of functionalised operators).


def _hash(
    hasher: str,
    history_slots: torch.Tensor | None,
    history_tags: torch.Tensor | None,
    **fields: torch.Tensor | None,
) -> torch.Tensor:
    owner, registered = _hasher(hasher)
    history = None
    if history_slots is not None:
        if registered is None:
            raise ValidationError(
                f"hash ops: history tensors given but hasher {hasher!r} was registered "
                f"without a history (register_hasher(name, hasher, history))"
            )
        # The history's memory is the tensors passed in (under opcheck or
        # functionalisation they may be copies of the registered ones): a
        # shallow copy of the registered object over them.
        history = copy.copy(registered)
        history.slots = history_slots
        if isinstance(history, RequestHistory) and history_tags is not None:
            history.tags = history_tags
    return owner(HashBatch(**fields), history)  # type: ignore[arg-type]


def _hash_fake(hasher: str, input_ids: torch.Tensor) -> torch.Tensor:
    owner, _history = _hasher(hasher)
    shape = (input_ids.shape[0], owner.consts.n_layers, owner.consts.n_cols)
    return input_ids.new_empty(shape, dtype=owner.out_dtype)


@torch.library.custom_op("engramrt::hash_ids", mutates_args=())
def hash_ids(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    hasher: str,
) -> torch.Tensor:
    """Row ids ``[T, L, C]`` of a batch whose history comes from lookback ids (or none),
    by the hasher registered as ``hasher``; the fields are :class:`HashBatch`'s."""
    return _hash(
        hasher,
        None,
        None,
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        dead_mask=dead_mask,
        lookback_token_ids=lookback_token_ids,
        lookback_dead=lookback_dead,
    )


@hash_ids.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      hasher):  # fmt: skip
    return _hash_fake(hasher, input_ids)


@torch.library.custom_op("engramrt::hash_ids_slot_cache", mutates_args=("history_slots",))
def hash_ids_slot_cache(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    history_slots: torch.Tensor,
    hasher: str,
) -> torch.Tensor:
    """:func:`hash_ids` with a :class:`SlotHashCache`: ``history_slots`` is the cache's
    ``slots`` (the one registered with the hasher gives the block size), updated in
    place with the batch's tokens."""
    return _hash(
        hasher,
        history_slots,
        None,
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        dead_mask=dead_mask,
        lookback_token_ids=lookback_token_ids,
        lookback_dead=lookback_dead,
        slot_mapping=slot_mapping,
        block_table=block_table,
    )


@hash_ids_slot_cache.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      slot_mapping, block_table, history_slots, hasher):  # fmt: skip
    return _hash_fake(hasher, input_ids)


@torch.library.custom_op(
    "engramrt::hash_ids_request_history", mutates_args=("history_slots", "history_tags")
)
def hash_ids_request_history(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    request_slots: torch.Tensor,
    history_slots: torch.Tensor,
    history_tags: torch.Tensor,
    hasher: str,
) -> torch.Tensor:
    """:func:`hash_ids` with a :class:`RequestHistory`: ``history_slots`` and
    ``history_tags`` are its ``slots`` and ``tags``, updated in place."""
    return _hash(
        hasher,
        history_slots,
        history_tags,
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        dead_mask=dead_mask,
        lookback_token_ids=lookback_token_ids,
        lookback_dead=lookback_dead,
        request_slots=request_slots,
    )


@hash_ids_request_history.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      request_slots, history_slots, history_tags, hasher):  # fmt: skip
    return _hash_fake(hasher, input_ids)


def hash_batch(batch: HashBatch, hasher: str) -> torch.Tensor:
    """The hash operator for ``batch`` and the history registered with ``hasher``."""
    _owner, history = _hasher(hasher)
    common = (
        batch.input_ids,
        batch.positions,
        batch.query_start_loc,
        batch.dead_mask,
        batch.lookback_token_ids,
        batch.lookback_dead,
    )
    if isinstance(history, SlotHashCache):
        if batch.slot_mapping is None or batch.block_table is None:
            raise ValidationError(
                f"hasher {hasher!r} has a SlotHashCache; expected the batch's slot_mapping "
                f"and block_table"
            )
        return hash_ids_slot_cache(
            *common, batch.slot_mapping, batch.block_table, history.slots, hasher
        )
    if isinstance(history, RequestHistory):
        if batch.request_slots is None:
            raise ValidationError(
                f"hasher {hasher!r} has a RequestHistory; expected the batch's request_slots"
            )
        return hash_ids_request_history(
            *common, batch.request_slots, history.slots, history.tags, hasher
        )
    return hash_ids(*common, hasher)


# -- rows ----------------------------------------------------------------------


@torch.library.custom_op("engramrt::lookup_rows", mutates_args=())
def lookup_rows(
    row_ids: torch.Tensor,
    packed_table: torch.Tensor,
    col_begin: int,
    col_end: int,
    row_begin: int,
) -> torch.Tensor:
    """Rows ``[T, C, E]`` bf16 of a packed table on the compute device
    (:func:`engramrt.lookup.lookup_rows`; columns outside ``[col_begin, col_end)`` are 0)."""
    from engramrt.lookup import lookup_rows as lookup

    return lookup(row_ids, packed_table, col_begin=col_begin, col_end=col_end, row_begin=row_begin)


@lookup_rows.register_fake
def _(row_ids, packed_table, col_begin, col_end, row_begin):  # fmt: skip
    from engramrt.packed import row_width_for

    E = row_width_for(packed_table.shape[1])
    return row_ids.new_empty((*row_ids.shape, E), dtype=torch.bfloat16)


@torch.library.custom_op("engramrt::fetch_rows", mutates_args=())
def fetch_rows(row_ids: torch.Tensor, source: str) -> torch.Tensor:
    """Rows ``[local_tokens(T), C, E]`` bf16 from the row source registered as ``source``.

    Capturable in a CUDA graph when the source has no
    :attr:`~engramrt.source.RowSource.host_sync`.
    """
    owner = _source(source)
    rows = owner.fetch(row_ids)
    if owner.has_update:
        owner.update()
    return rows


@fetch_rows.register_fake
def _(row_ids, source):  # fmt: skip
    owner = _source(source)
    shape = (owner.local_tokens(row_ids.shape[0]), row_ids.shape[1], owner.E)
    return row_ids.new_empty(shape, dtype=torch.bfloat16)


# -- gate ----------------------------------------------------------------------


@torch.library.custom_op("engramrt::engram_gate", mutates_args=())
def engram_gate(
    hidden: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The fused gate ``[T, hc, D]`` bf16 (:func:`engramrt.gate.engram_gate`, its checks on)."""
    from engramrt.gate import engram_gate as gate

    return gate(hidden, kv, q_weight, k_weight, eps, token_mask)


@engram_gate.register_fake
def _(hidden, kv, q_weight, k_weight, eps, token_mask):  # fmt: skip
    return hidden.new_empty(hidden.shape, dtype=torch.bfloat16)


def head_step(head: Any, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """An :class:`~engramrt.layer.EngramHead`'s output through the operators: ``wkv`` as a
    plain linear (the compiler sees it) and the gate as ``engramrt::engram_gate``."""
    num_tokens = rows.shape[0]
    kv = head.wkv(rows.view(num_tokens, -1))
    return engram_gate(hidden, kv, head.q_weight, head.k_weight, head.eps, None)
