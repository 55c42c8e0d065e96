"""``EngramLayer``: a head and a row source, one Engram layer (SPEC §8).

One step of a layer::

    layer.prepare(row_ids, stream=side)    # optional: start the rows early
    ...                                    # backbone layers run meanwhile
    out = layer(hidden)                    # wait for the rows, wkv, gate

or simply ``out = layer(hidden, row_ids)``. This is one layer on its own;
a model's Engram layers under one hash launch and one set of staging slots
are :class:`~engramrt.runtime.EngramRuntime`'s (``plan`` / ``run``).

The rows come from a :class:`~engramrt.source.RowSource`: a storage tier,
a cache, or an exchange over this rank's column shard (sequence
parallelism: the source's :meth:`~engramrt.source.RowSource.local_tokens`
gives this rank's ``ceil(T/tp)`` tokens, and ``hidden`` holds those).
The computation on the rows is the :class:`~engramrt.layer.EngramHead`'s.

Staging and graph safety. Every intermediate lives in a buffer allocated at
construction for ``max_tokens`` tokens: the rows ``[max_local, C, E]``, kv
``[max_local, (hc+1)*D]`` and the output ``[max_local, hc, D]``. A step
writes leading slices of them, so its addresses depend only on ``T``: on a
source without :attr:`~engramrt.source.RowSource.host_sync` ``prepare`` and
``forward`` allocate nothing, read no device memory on the host and never
synchronise, and both can be captured in one CUDA graph per ``T`` (capture
``prepare`` together with ``forward``: a captured stream cannot wait for an
event recorded outside the capture). The host and disk tiers synchronise
inside their lookup (the CPU must learn the ids), so they run eagerly only.

**The returned tensor is a view of the layer's output buffer**: the next
step overwrites it (as with any CUDA-graph output). Pass ``out=`` or clone
it to keep it.

Overlap. ``prepare(row_ids, stream=s)`` makes ``s`` wait for the work
already queued on the current stream (the hashing that produced
``row_ids``, and the previous step's ``forward``, which read the rows
buffer this lookup overwrites), runs the source on ``s`` and records an
event there; ``forward`` makes the current stream wait for that event
(:class:`~engramrt.source.PendingRows`). The pending rows hold a reference
to ``row_ids`` until then, so the caching allocator cannot hand its memory
to someone else while ``s`` still reads it.

Memory at V4.1-Flash shapes (D = 5120, hc = 4, C = 24, E = 256), per
``max_tokens`` token: rows 12 KiB + kv 50 KiB + out 40 KiB = 102 KiB
(0.8 GiB at 8192), plus what the source's exchange keeps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engramrt.config import EngramConfig
from engramrt.errors import ShardingError, ValidationError
from engramrt.layer.head import EngramHead
from engramrt.protocols import LayerHead
from engramrt.source import PendingRows, RowSource

__all__ = ["EngramLayer", "check_hidden", "pair_head_with_source"]

_ID_DTYPES = (torch.int32, torch.int64)


def pair_head_with_source(
    head: LayerHead | EngramConfig,
    source: RowSource,
    *,
    backend: str = "auto",
    validate: bool = True,
    head_name: str = "head",
    source_name: str = "source",
) -> LayerHead:
    """``head`` (any :class:`~engramrt.protocols.LayerHead`; an :class:`EngramConfig`
    builds an unloaded :class:`EngramHead`, the default kind, on the source's device),
    checked to compute on what ``source`` writes: the same E, the same device, the
    rows of every hash column. The names go into the errors (``heads[1]``, ...)."""
    if isinstance(head, EngramConfig):
        head = EngramHead(head, device=source.device, backend=backend, validate=validate)
    if not isinstance(head, LayerHead):
        raise ValidationError(
            f"{head_name} is a {type(head).__name__}; expected a head (engramrt.protocols."
            f"LayerHead, e.g. an EngramHead) or an EngramConfig"
        )
    if head.head_dim != source.E:
        raise ValidationError(
            f"{source_name} holds rows of E={source.E} values; {head_name} has head_dim "
            f"E={head.head_dim}"
        )
    if head.device != source.device:
        raise ValidationError(
            f"{head_name} is on {head.device} but {source_name} writes rows on "
            f"{source.device}; expected one device"
        )
    served = source.served_columns(head.num_cols)
    if served != (0, head.num_cols):
        raise ShardingError(
            f"{source_name} serves hash columns [{served[0]}, {served[1]}) of C={head.num_cols}; "
            f"the layer needs the rows of every column: give it an exchange over this "
            f"rank's column shard (engramrt.exchange) instead of the shard's store"
        )
    return head


def check_hidden(
    hidden: torch.Tensor, head: LayerHead, local: int, num_tokens: int, *, where: str
) -> None:
    """``hidden`` is ``[local, hc, D]`` on the head's device, for a step of ``num_tokens``
    row-id tokens of which this rank holds ``local``; ``where`` names the caller in
    the errors (``"the layer"``, ``"Engram layer 1"``)."""
    if not isinstance(hidden, torch.Tensor):
        raise ValidationError(f"hidden is a {type(hidden).__name__}; expected a tensor")
    expected = [local, head.hc_mult, head.hidden_size]
    if list(hidden.shape) != expected:
        tokens = (
            f"T = {num_tokens} row-id tokens"
            if local == num_tokens
            else f"local_tokens({num_tokens}) = {local} tokens of this rank"
        )
        raise ValidationError(
            f"hidden has shape {list(hidden.shape)}; expected {expected} ({tokens}, hc, D) "
            f"for {where}"
        )
    if hidden.device != head.device:
        raise ValidationError(
            f"hidden is on {hidden.device}; expected {where}'s device {head.device}"
        )


class EngramLayer(nn.Module):
    """One Engram layer: rows from a :class:`RowSource`, then a head.

    Args:
        head: the layer's head (a :class:`~engramrt.protocols.LayerHead`, such as
            an :class:`EngramHead`), or an :class:`EngramConfig` to build an
            :class:`EngramHead` (unloaded, on the source's device, with ``backend``).
        source: where the rows come from (a store, a cache, an exchange);
            the layer runs on ``source.device``.
        max_tokens: the most tokens ``T`` one step may have (all ranks
            together under sequence parallelism); sizes the staging buffers.
        backend: the gate's backend when ``head`` is a config.
        validate: check shapes, dtypes, devices and token counts on the host
            every step (no device reads). Off only for known-good callers.

    Attributes:
        head, source: the two halves.
        max_local_tokens: ``source.local_tokens(max_tokens)``.
    """

    def __init__(
        self,
        head: LayerHead | EngramConfig,
        source: RowSource,
        *,
        max_tokens: int,
        backend: str = "auto",
        validate: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValidationError(f"max_tokens={max_tokens!r}; expected a positive integer")
        if not isinstance(source, RowSource):
            raise ValidationError(
                f"source is a {type(source).__name__}; expected a RowSource (a store from "
                f"make_store, a CachedRowStore or an exchange)"
            )
        head = pair_head_with_source(head, source, backend=backend, validate=validate)
        self.head = head
        self.source = source
        self.device = source.device
        self.num_cols = head.num_cols
        self.max_tokens = max_tokens
        self.validate = validate
        local = source.local_tokens(max_tokens)
        self.max_local_tokens = local
        hc, dim = head.hc_mult, head.hidden_size

        # Staging buffers, NaN-poisoned so a slice that was never written shows.
        # Plain attributes, not registered buffers: they are not state, and
        # Module.to(dtype) must not convert them.
        def staging(*shape: int) -> torch.Tensor:
            return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=self.device)

        self._rows = staging(local, self.num_cols, head.head_dim)  # [Tl, C, E]
        self.kv_buffer = staging(local, (hc + 1) * dim)  # [Tl, (hc+1)*D]
        self.out_buffer = staging(local, hc, dim)  # [Tl, hc, D]
        # Rows started by prepare() and not yet consumed by forward().
        self._pending: PendingRows | None = None

    @property
    def staged_rows(self) -> torch.Tensor:
        """The fixed ``[max_local_tokens, C, E]`` bf16 buffer :meth:`prepare` stages rows into."""
        return self._rows

    @property
    def pending_steps(self) -> int:
        """1 when :meth:`prepare` started rows that :meth:`forward` has not consumed, else 0."""
        return int(self._pending is not None)

    def local_tokens(self, num_tokens: int) -> int:
        """Tokens of ``hidden`` for a step of ``num_tokens`` row-id tokens."""
        return self.source.local_tokens(num_tokens)

    def load_weights(self, **weights: Any) -> None:
        """The head's ``load_weights`` (:meth:`EngramHead.load_weights` for the default head)."""
        self.head.load_weights(**weights)

    # Steps ---------------------------------------------------------------------
    def prepare(self, row_ids: torch.Tensor, *, stream: torch.cuda.Stream | None = None) -> None:
        """Start fetching the rows of ``row_ids [T, C]`` into the layer's rows buffer.

        Args:
            row_ids: ``[T, C]`` int32/int64 global row ids of this layer for
                all ``T`` tokens (a strided view of the hasher's ``[T, L, C]``
                output is fine).
            stream: a CUDA stream to run the source on (overlapping the work
                queued after this call on the current stream); None runs it
                on the current stream.

        The next :meth:`forward` consumes the rows; a second ``prepare``
        before it is an error (the rows buffer would be overwritten).
        """
        num_tokens = self._check_row_ids(row_ids)
        if self._pending is not None:
            staged = self._pending.num_tokens
            raise ValidationError(
                f"prepare() was already called for a batch of {staged} tokens that forward() "
                f"has not consumed"
            )
        if stream is not None and self.device.type != "cuda":
            raise ValidationError(
                f"stream={stream!r} given but the layer runs on {self.device}; streams need CUDA"
            )
        self._start(row_ids, num_tokens, stream)

    def _start(
        self, row_ids: torch.Tensor, num_tokens: int, stream: torch.cuda.Stream | None
    ) -> None:
        local = self.source.local_tokens(num_tokens)
        self._pending = self.source.start(row_ids, self._rows[:local], stream=stream)

    def forward(
        self,
        hidden: torch.Tensor,
        row_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """``out [Tl, hc, D]`` bf16 = head(hidden, rows).

        Args:
            hidden: ``[Tl, hc, D]`` hidden streams (bf16; fp16/fp32 accepted),
                contiguous, where ``Tl = source.local_tokens(T)``: ``T``, or
                under sequence parallelism ``ceil(T / tp)`` (this rank's
                tokens, the last rank padded: padding tokens get zero rows,
                so they pass through unchanged).
            row_ids: ``[T, C]`` to fetch now; None consumes the rows started
                by :meth:`prepare`.
            token_mask: optional bool ``[Tl]``; False passes the token's
                hidden state through unchanged.
            out: optional contiguous bf16 ``[Tl, hc, D]`` to write instead of
                the layer's output buffer.
            return_kv: also return kv ``[Tl, (hc+1)*D]`` (a view of the
                layer's kv buffer).

        Returns:
            ``out``, a view of the layer's output buffer unless ``out`` was
            given (overwritten by the next step), or ``(out, kv)``.
        """
        if row_ids is not None:
            if self._pending is not None:
                raise ValidationError(
                    f"forward() got row_ids for {row_ids.shape[0]} tokens but rows of "
                    f"{self._pending.num_tokens} tokens were already started; pass the "
                    f"ids to one of them"
                )
            num_tokens = self._check_row_ids(row_ids)
        elif self._pending is not None:
            num_tokens = self._pending.num_tokens
        else:
            raise ValidationError(
                "forward() got row_ids=None but no rows were started; call prepare(row_ids) "
                "first, or pass row_ids"
            )
        local = self.source.local_tokens(num_tokens)
        if self.validate:
            check_hidden(hidden, self.head, local, num_tokens, where="the layer")
        if row_ids is not None:
            self._start(row_ids, num_tokens, None)
        pending, self._pending = self._pending, None
        assert pending is not None
        rows = pending.wait()
        return self.head.compute(
            hidden,
            rows,
            token_mask,
            out=self.out_buffer[:local] if out is None else out,
            kv_out=self.kv_buffer[:local],
            return_kv=return_kv,
        )

    # Internals -----------------------------------------------------------------
    def _check_row_ids(self, row_ids: torch.Tensor) -> int:
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in _ID_DTYPES:
            found = (
                str(row_ids.dtype) if isinstance(row_ids, torch.Tensor) else type(row_ids).__name__
            )
            raise ValidationError(f"row_ids has dtype {found}; expected torch.int32 or torch.int64")
        if row_ids.dim() != 2 or row_ids.shape[1] != self.num_cols:
            raise ValidationError(
                f"row_ids has shape {list(row_ids.shape)}; expected [T, C] with C = "
                f"{self.num_cols} hash columns"
            )
        num_tokens = row_ids.shape[0]
        if num_tokens > self.max_tokens:
            raise ValidationError(
                f"row_ids has T = {num_tokens} tokens, more than the layer's max_tokens = "
                f"{self.max_tokens} (the size its staging buffers were built for)"
            )
        return num_tokens

    def extra_repr(self) -> str:
        return f"max_tokens={self.max_tokens}, source={self.source!r}"
