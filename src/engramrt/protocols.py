"""What the runtime composes: a row-id maker, row sources and heads.

An Engram layer is three parts, each reached through one small interface so
that another kind of each plugs in without touching the runtime, the layer
or the custom operators:

- :class:`RowIdMaker`: an engine step's batch -> row ids ``[T, L, C]`` of
  every layer (:class:`~engramrt.hashing.NgramHasher`, the n-gram hash; a
  token-keyed table would be another);
- :class:`~engramrt.source.RowSource` (``source.py``): row ids ``[T, C]``
  -> rows ``[T_local, C, E]`` (storage tiers, the hot-row cache, exchanges);
- :class:`LayerHead`: rows and hidden streams -> the layer's output
  (:class:`~engramrt.layer.EngramHead`, ``wkv`` and the fused gate).

:class:`~engramrt.runtime.EngramRuntime`, :class:`~engramrt.layer.EngramLayer`
and :mod:`engramrt.custom_ops` use only what these declare. Both are
``runtime_checkable``: ``isinstance(x, RowIdMaker)`` checks that the members
exist (not their signatures), which is what the entry points check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from engramrt.hashing.types import HashBatch

__all__ = ["LayerHead", "RowIdMaker"]


@runtime_checkable
class RowIdMaker(Protocol):
    """Row ids of every Engram layer for an engine step.

    Attributes:
        n_layers: ``L``, the Engram layers it makes ids for.
        num_cols: ``C``, row ids per token and layer (hash columns).
        device: where it writes the ids (the batch's device).
        out_dtype: the ids' dtype, ``torch.int32`` or ``torch.int64``.
    """

    n_layers: int
    num_cols: int
    device: torch.device
    out_dtype: torch.dtype

    def __call__(
        self,
        batch: HashBatch,
        history: Any = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Row ids ``[T, L, C]`` of ``batch``, written into ``out`` when given (a fixed
        address, ``[T, L, C]`` of :attr:`out_dtype`); updates ``history`` (the engine's
        history object, or None) with the batch's tokens. Launches work on the
        current stream and never waits on the device."""
        ...


@runtime_checkable
class LayerHead(Protocol):
    """One Engram layer's computation on the rows it is given.

    Attributes:
        hidden_size: ``D``.
        hc_mult: ``hc``, hidden streams per token.
        head_dim: ``E``, values per row (must match the source's ``E``).
        num_cols: ``C``, rows per token (must match the id maker's ``C``).
        device: where it computes (the source's device).
    """

    hidden_size: int
    hc_mult: int
    head_dim: int
    num_cols: int
    device: torch.device

    def compute(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        kv_out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """``out [T, hc, D]`` bf16 from ``hidden [T, hc, D]`` and ``rows [T, C, E]`` bf16,
        device work only; callers checked shapes already.

        ``token_mask`` (bool ``[T]``): False passes the token's hidden state through.
        ``out`` and ``kv_out`` (``[T, (hc+1)*D]`` bf16, the projected rows) are fixed
        buffers to write; returns ``out``, or ``(out, kv)`` with ``return_kv``.
        """
        ...

    def load_weights(self, *args: Any, **weights: Any) -> None:
        """Load the head's weights from plain tensors (names are the head's own)."""
        ...
