"""PLE streaming state in a serving engine: slot-indexed pools, snapshots, rollback, hand-off.

docs/families.md, "Streaming state". Between steps a request carries, for PLE:

- its id context: the last ``N - 1`` raw ids, oldest first, EOS-filled at its start
  (docs/families.md §4; the same for every PLE layer);
- per PLE layer, its conv state: the last ``S = (K-1)*N`` vectors ``b`` (§6; zeros at its
  start).

Nothing else. :class:`PleStatePool` keeps both for every live request in fixed tensors that
the step's ops read and update in place (the contract of the fused ops):

- ``contexts`` ``[num_slots, N - 1]`` int64, read and written by the row-id step
  (:func:`ple_row_ids_slots`);
- ``conv_states[l]`` ``[num_slots, S, hc*D]`` in the model dtype, read and written by PLE
  layer ``l`` (:func:`ple_layer_reference_slots`);
- a step's sequence ``i`` is addressed by ``state_slots[i]``: the engine's stable row of the
  request (vLLM's persistent-batch row, SGLang's request-pool row). Slot ``pad_slot`` (the
  last) belongs to no request: padded sequences of a captured step point at it, and what
  is written there is never read. Several padded sequences share it only where the op
  accepts a repeated slot (the references here do); an op that wants distinct slots
  (``module.PleLayer``) takes padding as tokens past ``query_start_loc[B]`` instead.

The pool also owns everything that moves state between slots and other places, each one
plain tensor ops on the pool's device (no host synchronisation, fixed addresses, so they
can run inside a captured step; the checks that read the host run only with
``validate=True``):

==========================  ==========================================================
schedule event              rule
==========================  ==========================================================
a request starts at 0       :meth:`~PleStatePool.reset` its slot (EOS context, zero conv)
chunked prefill, decode,    nothing: the step's ops carry the state in place; a slot
interleaved requests        appears at most once in a step
a full KV block is          if the request's computed tokens end exactly at the block's
computed                    end, :meth:`~PleStatePool.save_snapshots` into the block's
                            snapshot (one per KV block, keyed like the block); a block
                            whose end fell inside a chunk has no snapshot
prefix-cache hit            only up to the last hit block that holds a valid snapshot
                            (the engine's prefix cache keeps the flag beside the block
                            and drops it when the block is evicted or reused); then
                            :meth:`~PleStatePool.restore_snapshots`
speculative drafts          :meth:`~PleStatePool.checkpoint_drafts` before the verify
                            step, :meth:`~PleStatePool.rollback_drafts` after it, to the
                            last accepted token
preemption                  the request restarts as a new one: reset, or a prefix hit
hand-off (P/D)              :meth:`~PleStatePool.export_state` on the prefill instance,
                            :meth:`~PleStatePool.import_state` on the decode instance: a
                            :class:`PleRequestState` (context, every layer's conv state,
                            the token count they follow) travels with the KV blocks
==========================  ==========================================================

Why snapshots only at chunk ends: the conv state after position ``p`` needs ``b`` of
positions ``p-S .. p-1``, which depend on the hidden streams (the whole prefix, through
attention), not on token ids alone; the layer writes only the state at its chunk's end.
An engine that wants every full block to be reusable ends its prefill chunks at block
boundaries (vLLM's mamba prefix caching does the same). The id context alone could be
rebuilt from token ids (:meth:`PleIdContext.from_history`); the pool keeps it beside the
conv state so that one copy moves both.

Why rollback needs a checkpoint: a verify chunk of ``c`` tokens (the next token and its
drafts) shifts ``c`` rows out of the conv state; keeping ``m <= c`` of them needs rows
``m .. c-1`` of the state before the step. :meth:`~PleStatePool.checkpoint_drafts` copies
the first ``max_draft_tokens + 1`` rows of the draft slots (not the whole state), and the
rollback rebuilds the state at the last accepted token from those rows and the rows the
layer wrote. This needs ``c <= S`` (at the defaults S = 9: up to 8 drafts). The id context
is rebuilt from the checkpointed context and the step's accepted token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engramrt.errors import ValidationError, describe_tensor
from engramrt.families.qwen4_ple.config import PleConfig, resolve_ple_config
from engramrt.families.qwen4_ple.layer import PleLayerWeights, ple_layer_reference_varlen

__all__ = [
    "PleRequestState",
    "PleStatePool",
    "ple_layer_reference_slots",
    "ple_row_ids_slots",
]

_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

Indices = torch.Tensor | Sequence[int]
"""Slot or snapshot numbers: a 1-D integer tensor (any device) or a host sequence."""


@dataclass(frozen=True)
class PleRequestState:
    """What a request carries for PLE when it moves to another instance (a prefill/decode
    hand-off) or is parked off the device: everything, and nothing else.

    Attributes:
        contexts: ``[N - 1]`` int64, the last ``N - 1`` raw ids (EOS before the request).
        conv_states: ``[L, S, hc*D]`` model dtype, each PLE layer's last ``S`` vectors ``b``.
        num_tokens: the request's tokens these follow (positions ``0 .. num_tokens - 1``
            computed); the receiver's next chunk starts there.
    """

    contexts: torch.Tensor
    conv_states: torch.Tensor
    num_tokens: int

    def to(self, device: torch.device | str) -> PleRequestState:
        """A copy on ``device`` (a transfer between instances)."""
        return PleRequestState(
            self.contexts.to(device), self.conv_states.to(device), self.num_tokens
        )


class PleStatePool:
    """The PLE streaming state of every live request, its snapshots and draft checkpoints.

    Args:
        config: the model's :class:`PleConfig` (PLE on).
        max_requests: request slots ``0 .. max_requests - 1``; one more slot,
            :attr:`pad_slot`, takes the padded sequences of a captured step.
        num_snapshots: snapshot entries (one per KV block for prefix caching; 0: none).
        max_draft_tokens: the most speculative drafts after a request's next token in one
            step (0: no speculative decoding); ``1 + max_draft_tokens <= S``.
        dtype: the model dtype (the conv states').
        device: where the pools live.
        validate: check the slots, snapshot numbers and counts of every call on the host
            (reads index tensors back; off on a captured hot path).

    Attributes:
        contexts: ``[num_slots, N - 1]`` int64.
        conv_state_pool: ``[L, num_slots, S, hc*D]``; ``conv_states[l]`` is layer l's view.
        snapshot_contexts, snapshot_conv_states: the same per snapshot entry.
        num_slots: ``max_requests + 1``. pad_slot: ``max_requests``.
    """

    def __init__(
        self,
        config: PleConfig | Any,
        *,
        max_requests: int,
        num_snapshots: int = 0,
        max_draft_tokens: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        validate: bool = True,
    ) -> None:
        config = resolve_ple_config(config)
        for name, value, least in (
            ("max_requests", max_requests, 1),
            ("num_snapshots", num_snapshots, 0),
            ("max_draft_tokens", max_draft_tokens, 0),
        ):
            if not _is_int(value) or value < least:
                raise ValidationError(f"{name}={value!r}; expected an integer >= {least}")
        state_len = config.conv_state_len
        if max_draft_tokens + 1 > state_len:
            raise ValidationError(
                f"max_draft_tokens={max_draft_tokens}; expected at most S - 1 = {state_len - 1} "
                f"(S = (K-1)*N = {state_len}): a rollback rebuilds the state from the rows "
                f"the verify chunk shifted out, which the state holds only for chunks <= S"
            )
        if dtype not in _MODEL_DTYPES:
            raise ValidationError(f"dtype={dtype}; expected a model dtype {_MODEL_DTYPES}")
        self.config = config
        self.eos = config.eos
        self.n_layers = config.n_layers
        self.context_len = config.context_len
        self.state_len = state_len
        self.width = config.hc_count * config.hidden_size
        self.max_requests = max_requests
        self.num_slots = max_requests + 1
        self.pad_slot = max_requests
        self.num_snapshots = num_snapshots
        self.max_draft_tokens = max_draft_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.validate = validate
        n_ctx, length, width = self.context_len, state_len, self.width
        self.contexts = torch.full(
            (self.num_slots, n_ctx), self.eos, dtype=torch.int64, device=self.device
        )
        self.conv_state_pool = torch.zeros(
            (self.n_layers, self.num_slots, length, width), dtype=dtype, device=self.device
        )
        self.snapshot_contexts = torch.full(
            (num_snapshots, n_ctx), self.eos, dtype=torch.int64, device=self.device
        )
        self.snapshot_conv_states = torch.zeros(
            (self.n_layers, num_snapshots, length, width), dtype=dtype, device=self.device
        )
        # Draft checkpoints: the context and the first max_draft_tokens + 1 conv rows of a
        # slot before its verify step (the rows that step shifts out).
        self._draft_contexts = torch.full_like(self.contexts, self.eos)
        self._draft_rows = torch.zeros(
            (self.n_layers, self.num_slots, max_draft_tokens + 1, width),
            dtype=dtype,
            device=self.device,
        )
        self._state_rows = torch.arange(length, dtype=torch.int64, device=self.device)
        self._context_columns = torch.arange(n_ctx, dtype=torch.int64, device=self.device)

    @property
    def conv_states(self) -> tuple[torch.Tensor, ...]:
        """``conv_states[l]``: ``[num_slots, S, hc*D]``, PLE layer l's pool (a view)."""
        return tuple(self.conv_state_pool.unbind(0))

    # -- requests start ----------------------------------------------------------------

    def reset(self, state_slots: Indices) -> None:
        """Start requests at position 0: EOS contexts, zero conv states."""
        slots = self._indices("state_slots", state_slots, self.max_requests)
        self.contexts.index_fill_(0, slots, self.eos)
        self.conv_state_pool.index_fill_(1, slots, 0)

    def save_snapshots(self, state_slots: Indices, snapshot_ids: Indices) -> None:
        """Copy slots' states into snapshot entries (the state at the end of a KV block
        whose end is the request's last computed token; the entry is the block's)."""
        slots = self._indices("state_slots", state_slots, self.max_requests)
        ids = self._indices("snapshot_ids", snapshot_ids, self.num_snapshots)
        self._check_pairs(slots, ids)
        self.snapshot_contexts.index_copy_(0, ids, self.contexts.index_select(0, slots))
        self.snapshot_conv_states.index_copy_(1, ids, self.conv_state_pool.index_select(1, slots))

    def restore_snapshots(self, state_slots: Indices, snapshot_ids: Indices) -> None:
        """Start requests from snapshots: each the state at the end of the last block of
        its prefix-cache hit (a snapshot may serve several requests at once)."""
        slots = self._indices("state_slots", state_slots, self.max_requests)
        ids = self._indices("snapshot_ids", snapshot_ids, self.num_snapshots, distinct=False)
        self._check_pairs(slots, ids)
        self.contexts.index_copy_(0, slots, self.snapshot_contexts.index_select(0, ids))
        self.conv_state_pool.index_copy_(1, slots, self.snapshot_conv_states.index_select(1, ids))

    # -- speculative decoding ----------------------------------------------------------

    def checkpoint_drafts(self, state_slots: Indices) -> None:
        """Before a step that verifies drafts: keep what its rollback needs of each slot."""
        slots = self._indices("state_slots", state_slots, self.max_requests)
        rows = self.max_draft_tokens + 1
        self._draft_contexts.index_copy_(0, slots, self.contexts.index_select(0, slots))
        self._draft_rows.index_copy_(
            1, slots, self.conv_state_pool[:, :, :rows].index_select(1, slots)
        )

    def rollback_drafts(
        self,
        state_slots: Indices,
        num_scheduled: Indices,
        num_accepted: Indices,
        token_ids: torch.Tensor,
        chunk_starts: Indices,
    ) -> None:
        """After the verify step: each slot's state at its last accepted token.

        Sequence i scheduled ``c_i = num_scheduled[i]`` tokens (its next token and drafts,
        ``c_i <= max_draft_tokens + 1``), at ``token_ids[chunk_starts[i] ..]`` of the step,
        and keeps the first ``m_i = num_accepted[i]`` of them (``0 <= m_i <= c_i``; ``m_i =
        c_i`` leaves the state as the step wrote it). With ``X = old state ++ b of the
        chunk``, the layer wrote ``X[c : c+S]``; the state after ``m`` is ``X[m : m+S]``:
        rows below ``c`` from the checkpoint, the rest from the written state. The context
        is ``(old context ++ chunk)[m : m+N-1]`` the same way, from ``token_ids``.

        Args:
            state_slots: ``[B]`` slots, each checkpointed before the step.
            num_scheduled, num_accepted, chunk_starts: ``[B]`` integers.
            token_ids: ``[T]`` the step's token ids (as hashed).
        """
        slots = self._indices("state_slots", state_slots, self.max_requests)
        scheduled = self._counts("num_scheduled", num_scheduled, slots)
        accepted = self._counts("num_accepted", num_accepted, slots)
        starts = self._counts("chunk_starts", chunk_starts, slots)
        if self.validate:
            self._check_rollback(scheduled, accepted, starts, token_ids)
        n_ctx = self.context_len
        # Contexts: X = old context ++ chunk ids; keep X[m : m + N - 1].
        joined = accepted[:, None] + self._context_columns[None, :]  # [B, N-1]
        old = self._draft_contexts.index_select(0, slots).gather(1, joined.clamp(max=n_ctx - 1))
        readable = torch.cat([token_ids.to(self.device, torch.int64), old.new_zeros(1)])
        token_index = (starts[:, None] + joined - n_ctx).clamp(0, readable.shape[0] - 1)
        contexts = torch.where(joined < n_ctx, old, readable[token_index])
        self.contexts.index_copy_(0, slots, contexts)
        # Conv states: X = old state ++ b of the chunk, the layer kept X[c : c + S].
        window = accepted[:, None] + self._state_rows[None, :]  # [B, S] rows of X to keep
        from_checkpoint = window < scheduled[:, None]
        last_checkpointed = self.max_draft_tokens
        checkpoint_rows = window.clamp(max=last_checkpointed)
        written_rows = (window - scheduled[:, None]).clamp(0, self.state_len - 1)
        width = self.width
        checkpointed = self._draft_rows.index_select(1, slots)  # [L, B, c_max, W]
        written = self.conv_state_pool.index_select(1, slots)  # [L, B, S, W]
        shape = (self.n_layers, *window.shape, width)
        kept = torch.where(
            from_checkpoint[None, :, :, None],
            checkpointed.gather(2, checkpoint_rows[None, :, :, None].expand(shape)),
            written.gather(2, written_rows[None, :, :, None].expand(shape)),
        )
        self.conv_state_pool.index_copy_(1, slots, kept)

    # -- hand-off ----------------------------------------------------------------------

    def export_state(self, state_slot: int, num_tokens: int) -> PleRequestState:
        """The request's state (copies) after its first ``num_tokens`` tokens, to travel
        with its KV blocks to another instance."""
        (slot,) = self._host_indices("state_slot", [state_slot], self.max_requests)
        _check_count("num_tokens", num_tokens)
        return PleRequestState(
            self.contexts[slot].clone(), self.conv_state_pool[:, slot].clone(), int(num_tokens)
        )

    def import_state(self, state_slot: int, state: PleRequestState) -> None:
        """Start a request from a state made elsewhere (its next chunk starts at
        ``state.num_tokens``). Refuses a state of another shape or dtype."""
        (slot,) = self._host_indices("state_slot", [state_slot], self.max_requests)
        for name, tensor, shape, dtype in (
            ("contexts", state.contexts, [self.context_len], torch.int64),
            (
                "conv_states",
                state.conv_states,
                [self.n_layers, self.state_len, self.width],
                self.dtype,
            ),
        ):
            if list(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValidationError(
                    f"state.{name} has {describe_tensor(tensor)}; expected {dtype} {shape} "
                    f"(this pool's model)"
                )
        self.contexts[slot] = state.contexts.to(self.device, non_blocking=True)
        self.conv_state_pool[:, slot] = state.conv_states.to(self.device, non_blocking=True)

    # -- checks ------------------------------------------------------------------------

    def _indices(
        self, name: str, values: Indices, limit: int, *, distinct: bool = True
    ) -> torch.Tensor:
        """``values`` as int64 on the pool's device; checked on the host when validating
        (in ``[0, limit)``; distinct when asked)."""
        if isinstance(values, torch.Tensor):
            if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
                raise ValidationError(
                    f"{name} has {describe_tensor(values)}; expected a 1-D integer tensor"
                )
            if self.validate:
                self._host_indices(name, values.tolist(), limit, distinct=distinct)
            return values.to(self.device, torch.int64, non_blocking=True)
        checked = self._host_indices(name, values, limit, distinct=distinct)
        return torch.tensor(checked, dtype=torch.int64).to(self.device, non_blocking=True)

    def _host_indices(
        self, name: str, values: Sequence[int], limit: int, *, distinct: bool = True
    ) -> list[int]:
        found = list(values)
        allowed = f"an integer in [0, {limit})"
        for i, value in enumerate(found):
            if not _is_int(value) or not 0 <= value < limit:
                raise ValidationError(f"{name}[{i}]={value!r}; expected {allowed}")
        if distinct and len(set(found)) != len(found):
            raise ValidationError(f"{name}={found} names an entry twice; expected distinct ones")
        return [int(v) for v in found]

    def _counts(self, name: str, values: Indices, slots: torch.Tensor) -> torch.Tensor:
        counts = (
            values.to(self.device, torch.int64, non_blocking=True)
            if isinstance(values, torch.Tensor)
            else torch.tensor([int(v) for v in values], dtype=torch.int64).to(self.device)
        )
        if counts.shape != slots.shape:
            raise ValidationError(
                f"{name} has shape {list(counts.shape)}; expected [{slots.shape[0]}] "
                f"(one per state slot)"
            )
        return counts

    def _check_pairs(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        if slots.shape != ids.shape:
            raise ValidationError(
                f"state_slots has shape {list(slots.shape)} and snapshot_ids "
                f"{list(ids.shape)}; expected one snapshot per slot"
            )

    def _check_rollback(
        self,
        scheduled: torch.Tensor,
        accepted: torch.Tensor,
        starts: torch.Tensor,
        token_ids: torch.Tensor,
    ) -> None:
        """Counts against each other and the step (reads them back to the host)."""
        if token_ids.dim() != 1 or token_ids.dtype not in (torch.int32, torch.int64):
            raise ValidationError(
                f"token_ids has {describe_tensor(token_ids)}; expected [T] int32 or int64"
            )
        most = self.max_draft_tokens + 1
        rows = zip(scheduled.tolist(), accepted.tolist(), starts.tolist(), strict=True)
        for i, (count, kept, start) in enumerate(rows):
            if not 1 <= count <= most:
                raise ValidationError(
                    f"num_scheduled[{i}]={count}; expected 1 .. max_draft_tokens + 1 = {most}"
                )
            if not 0 <= kept <= count:
                raise ValidationError(
                    f"num_accepted[{i}]={kept}; expected 0 .. num_scheduled[{i}] = {count}"
                )
            if not 0 <= start <= token_ids.shape[0] - count:
                raise ValidationError(
                    f"chunk_starts[{i}]={start}; expected 0 .. T - num_scheduled[{i}] = "
                    f"{token_ids.shape[0] - count}"
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: object) -> None:
    if not _is_int(value) or int(value) < 0:  # type: ignore[call-overload]
        raise ValidationError(f"{name}={value!r}; expected a token count, an integer >= 0")


# -- the step's ops over the pools (the contract of the fused ops) ----------------------


def ple_row_ids_slots(
    hasher: Any,
    token_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    contexts: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids ``[T, L, C]`` of a step whose sequence i carries ``contexts[state_slots[i]]``;
    those rows of ``contexts`` are advanced in place (docs/families.md §4).

    ``hasher``: a :class:`~engramrt.families.qwen4_ple.ops.PleHasher` (or anything called
    the same way). A gather, the hasher, a scatter: a fused kernel reads and writes the
    pool directly. ``state_slots`` are distinct except the pool's pad slot.
    """
    carried = contexts.index_select(0, state_slots.long())
    rows, next_context = hasher(token_ids, query_start_loc, carried, out=out)
    contexts.index_copy_(0, state_slots.long(), next_context)
    return rows


def ple_layer_reference_slots(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    *,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    conv_states: torch.Tensor,
    ngram_size: int,
    eps: float,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~engramrt.families.qwen4_ple.layer.ple_layer_reference_varlen` over a pool:
    sequence i carries ``conv_states[state_slots[i]]`` (``[num_slots, S, hc*D]``, one PLE
    layer's pool), updated in place. Returns ``out [T, hc*D]``.

    The definition the fused layer op meets: its outputs and the slots it writes equal
    this, bit for bit on the CPU. Slots not in ``state_slots`` are not touched.
    """
    slots = state_slots.long()
    out, states = ple_layer_reference_varlen(
        hidden,
        rows,
        weights,
        query_start_loc=query_start_loc,
        ngram_size=ngram_size,
        eps=eps,
        conv_states=conv_states.index_select(0, slots),
        token_mask=token_mask,
    )
    conv_states.index_copy_(0, slots, states)
    return out
