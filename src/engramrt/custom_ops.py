"""engramrt's steps as PyTorch custom operators, for ``torch.compile`` and CUDA graphs.

Serving engines compile their model with ``torch.compile(fullgraph=True)``;
a plain Python launch of a Triton kernel, a side stream or a worker thread
inside it breaks the graph. The operators here (namespace ``engramrt``) are
opaque to the compiler, carry fake implementations that give output shapes
and dtypes without running anything, and are thin skins over the objects
the eager API uses: a compiled model runs the same
:meth:`EngramRuntime.plan <engramrt.runtime.EngramRuntime.plan>` and
:meth:`EngramRuntime.run <engramrt.runtime.EngramRuntime.run>`, so it keeps
the runtime's side-stream lookups, its CPU workers for host tiers and its
prefetch, and computes the eager bytes.

========================================  ======================================  ============
operator                                  what                                    mutates
========================================  ======================================  ============
``engramrt::plan_step``                   ``runtime.plan``; history from lookback  nothing
``engramrt::plan_step_slot_cache``        the same, history in a SlotHashCache    its slots
``engramrt::plan_step_request_history``   the same, history in a RequestHistory   its ring
``engramrt::plan_step_state_pool``        the same, request contexts in a pool    its contexts
                                          (Qwen4-Exp PLE's ``PleStatePool``)
``engramrt::run_layer``                   ``runtime.run(layer, hidden)``          nothing
``engramrt::lookup_rows``                 rows ``[T, C, E]`` of a packed table    nothing
``engramrt::engram_gate``                 the fused gate (SPEC §8)                nothing
========================================  ======================================  ============

A runtime reaches the operators through its explicit handle,
:attr:`EngramRuntime.handle <engramrt.runtime.EngramRuntime.handle>` (an int,
so a compiled graph holds it as a constant; the runtime is looked up weakly,
by :func:`~engramrt.runtime.runtime_from_handle`). The history's tensors are
passed explicitly as well, so the compiler sees the mutation. Use
:func:`plan` and :func:`run_layer` from model code: they pick the operator
for the runtime's history and pass its tensors::

    row_ids = custom_ops.plan(runtime, batch)                 # the step's plan
    hidden = custom_ops.run_layer(runtime, 0, hidden, row_ids)
    ...
    hidden = custom_ops.run_layer(runtime, 1, hidden, row_ids)

Passing the plan's ``row_ids`` to ``run_layer`` orders the two for the
compiler (the operator reads nothing of it). An engine that plans on the
host outside its compiled model calls ``runtime.plan(batch)`` there and
``run_layer(runtime, i, hidden)`` inside. ``plan_step`` returns a copy of the
row ids (an operator's output never aliases the runtime's buffers), and
``run_layer`` writes a fresh output tensor.

Under CUDA-graph capture the operators' host work (the runtime's slot
rotation, its queue of planned steps, worker threads) runs once, at
capture: capture ``plan`` and ``run_layer`` together only where every source
runs without a host synchronisation, one graph per staging slot (see the
runtime's module documentation). ``run_layer`` carries the
``cudagraph_unsafe`` tag (where torch has it): with
``torch._inductor.config.graph_partition = True``, ``mode="reduce-overhead"``
captures the compiled model's pieces between Engram layers in CUDA graphs and
runs each layer eagerly between them, which works with every source.

Importing this module registers the operators; ``import engramrt`` does not.
"""

from __future__ import annotations

import copy

import torch

from engramrt.errors import ValidationError
from engramrt.hashing.history import RequestHistory, SlotHashCache
from engramrt.hashing.types import HashBatch
from engramrt.runtime import EngramRuntime, runtime_from_handle

__all__ = [
    "engram_gate",
    "lookup_rows",
    "plan",
    "plan_step",
    "plan_step_request_history",
    "plan_step_slot_cache",
    "run_layer",
    "run_layer_op",
]


# -- plan ----------------------------------------------------------------------
#
# Three operators, one per kind of history, so that each declares exactly the
# tensors it mutates (an optional mutated argument does not survive Inductor's
# lowering of functionalised operators).


_COMMON_FIELDS = (
    "input_ids",
    "positions",
    "query_start_loc",
    "dead_mask",
    "lookback_token_ids",
    "lookback_dead",
)
"""The :class:`HashBatch` fields every plan operator takes first, in this order."""


def _plan(
    handle: int,
    common: tuple[torch.Tensor | None, ...],
    history_slots: torch.Tensor | None = None,
    history_tags: torch.Tensor | None = None,
    *,
    history_field: str = "slots",
    **fields: torch.Tensor | None,
) -> torch.Tensor:
    """``runtime.plan`` of the batch of ``common`` (:data:`_COMMON_FIELDS`) and ``fields``,
    over the history tensors given (None: the runtime's history as it is):
    ``history_slots`` stands for the history's ``history_field`` tensor."""
    fields.update(zip(_COMMON_FIELDS, common, strict=True))
    runtime = runtime_from_handle(handle)
    history = runtime.history
    if history_slots is not None:
        if history is None:
            raise ValidationError(
                f"plan ops: history tensors given but runtime {handle} has no history "
                f"(EngramRuntime(history=...))"
            )
        # The history's memory is the tensors passed in (under opcheck or
        # functionalisation they may be copies of the runtime's): a shallow copy
        # of the runtime's history object over them.
        history = copy.copy(history)
        setattr(history, history_field, history_slots)
        if isinstance(history, RequestHistory) and history_tags is not None:
            history.tags = history_tags
    step = runtime.plan(HashBatch(**fields), history=history)  # type: ignore[arg-type]
    return step.row_ids.clone()


def _plan_fake(handle: int, input_ids: torch.Tensor) -> torch.Tensor:
    runtime = runtime_from_handle(handle)
    shape = (input_ids.shape[0], runtime.n_layers, runtime.n_cols)
    return input_ids.new_empty(shape, dtype=runtime.hasher.out_dtype)


@torch.library.custom_op("engramrt::plan_step", mutates_args=())
def plan_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    handle: int,
) -> torch.Tensor:
    """``runtime.plan`` of a batch whose history comes from lookback ids (or none), by
    the runtime with ``handle``; returns a copy of the row ids ``[T, L, C]``. The
    fields are :class:`HashBatch`'s."""
    common = (input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead)
    return _plan(handle, common)


@plan_step.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      handle):  # fmt: skip
    return _plan_fake(handle, input_ids)


@torch.library.custom_op("engramrt::plan_step_slot_cache", mutates_args=("history_slots",))
def plan_step_slot_cache(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    history_slots: torch.Tensor,
    handle: int,
) -> torch.Tensor:
    """:func:`plan_step` with a :class:`SlotHashCache`: ``history_slots`` is the cache's
    ``slots`` (the runtime's cache gives the block size), updated in place."""
    common = (input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead)
    return _plan(handle, common, history_slots, slot_mapping=slot_mapping, block_table=block_table)


@plan_step_slot_cache.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      slot_mapping, block_table, history_slots, handle):  # fmt: skip
    return _plan_fake(handle, input_ids)


@torch.library.custom_op(
    "engramrt::plan_step_request_history", mutates_args=("history_slots", "history_tags")
)
def plan_step_request_history(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    request_slots: torch.Tensor,
    history_slots: torch.Tensor,
    history_tags: torch.Tensor,
    handle: int,
) -> torch.Tensor:
    """:func:`plan_step` with a :class:`RequestHistory`: ``history_slots`` and
    ``history_tags`` are its ``slots`` and ``tags``, updated in place."""
    common = (input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead)
    return _plan(handle, common, history_slots, history_tags, request_slots=request_slots)


@plan_step_request_history.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      request_slots, history_slots, history_tags, handle):  # fmt: skip
    return _plan_fake(handle, input_ids)


@torch.library.custom_op("engramrt::plan_step_state_pool", mutates_args=("pool_contexts",))
def plan_step_state_pool(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    request_slots: torch.Tensor,
    pool_contexts: torch.Tensor,
    handle: int,
) -> torch.Tensor:
    """:func:`plan_step` with a state pool keyed by request (a Qwen4-Exp ``PleStatePool``):
    ``pool_contexts`` is its ``contexts`` (each request's last ids), updated in place at
    ``request_slots``. The pool's other state (PLE conv states) belongs to the layers'
    heads, which ``run_layer`` updates."""
    common = (input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead)
    return _plan(
        handle, common, pool_contexts, history_field="contexts", request_slots=request_slots
    )


@plan_step_state_pool.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead,
      request_slots, pool_contexts, handle):  # fmt: skip
    return _plan_fake(handle, input_ids)


def plan(runtime: EngramRuntime, batch: HashBatch) -> torch.Tensor:
    """The plan operator for ``batch`` and ``runtime``'s history; returns row ids
    ``[T, L, C]`` (a copy: pass it to :func:`run_layer` to order the layers after it)."""
    if not isinstance(runtime, EngramRuntime):
        raise ValidationError(f"runtime is a {type(runtime).__name__}; expected an EngramRuntime")
    history = runtime.history
    common = tuple(getattr(batch, name) for name in _COMMON_FIELDS)
    if isinstance(history, SlotHashCache):
        if batch.slot_mapping is None or batch.block_table is None:
            raise ValidationError(
                "the runtime's history is a SlotHashCache; expected the batch's slot_mapping "
                "and block_table"
            )
        return plan_step_slot_cache(
            *common, batch.slot_mapping, batch.block_table, history.slots, runtime.handle
        )
    if isinstance(history, RequestHistory):
        if batch.request_slots is None:
            raise ValidationError(
                "the runtime's history is a RequestHistory; expected the batch's request_slots"
            )
        return plan_step_request_history(
            *common, batch.request_slots, history.slots, history.tags, runtime.handle
        )
    contexts = getattr(history, "contexts", None)
    if isinstance(contexts, torch.Tensor):  # a pool of per-request state (PleStatePool)
        if batch.request_slots is None:
            raise ValidationError(
                f"the runtime's history is a {type(history).__name__}; expected the batch's "
                f"request_slots (each request's row of the pool)"
            )
        return plan_step_state_pool(*common, batch.request_slots, contexts, runtime.handle)
    return plan_step(*common, runtime.handle)


# -- run -----------------------------------------------------------------------

# run_layer waits on host work (a worker thread's lookup) and keeps the runtime's
# queue of planned steps: it must run eagerly, never be replayed from a CUDA graph.
# Inductor's CUDA graphs (mode="reduce-overhead" with graph partitions) split the
# compiled model around operators tagged so, as engines' piecewise graphs split
# around attention: the blocks replay from graphs, the layer runs between them.
_RUN_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("engramrt::run_layer", mutates_args=(), tags=_RUN_TAGS)
def run_layer_op(
    hidden: torch.Tensor,
    token_mask: torch.Tensor | None,
    after: torch.Tensor | None,
    handle: int,
    layer: int,
) -> torch.Tensor:
    """``runtime.run(layer, hidden, token_mask)`` of the runtime with ``handle``, into a
    fresh ``[Tl, hc, D]`` bf16 tensor. ``after`` (the plan's row ids, or None) is not
    read: it orders this operator after the plan for the compiler."""
    runtime = runtime_from_handle(handle)
    out = torch.empty(hidden.shape, dtype=torch.bfloat16, device=hidden.device)
    runtime.run(layer, hidden, token_mask, out=out)
    return out


@run_layer_op.register_fake
def _(hidden, token_mask, after, handle, layer):  # fmt: skip
    return hidden.new_empty(hidden.shape, dtype=torch.bfloat16)


def run_layer(
    runtime: EngramRuntime,
    layer: int,
    hidden: torch.Tensor,
    after: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``engramrt::run_layer`` for ``runtime``: Engram layer ``layer`` of the oldest
    planned step that has not run it (:meth:`EngramRuntime.run`)."""
    if not isinstance(runtime, EngramRuntime):
        raise ValidationError(f"runtime is a {type(runtime).__name__}; expected an EngramRuntime")
    return run_layer_op(hidden, token_mask, after, runtime.handle, layer)


# -- pure kernels ----------------------------------------------------------------


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


@torch.library.custom_op("engramrt::engram_gate", mutates_args=())
def engram_gate(
    hidden: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The fused gate ``[T, hc, D]`` bf16 (:func:`engramrt.gate.engram_gate`, its checks on).
    The operands are separate arguments here: an operator's schema lists tensors one by one."""
    from engramrt.gate import GateInputs
    from engramrt.gate import engram_gate as gate

    return gate(GateInputs(hidden, kv, q_weight, k_weight, eps, token_mask))


@engram_gate.register_fake
def _(hidden, kv, q_weight, k_weight, eps, token_mask):  # fmt: skip
    return hidden.new_empty(hidden.shape, dtype=torch.bfloat16)
