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
  (:class:`~engramrt.layer.EngramHead`, ``wkv`` and the fused gate; Qwen4-Exp's
  :class:`~engramrt.families.qwen4_ple.serving.PleHead`, the gate and the dilated conv).

Optional: :class:`HostRowIdMaker`, a row-id maker that also makes a step's ids on the
host from the step's host mirror (:attr:`~engramrt.step.EngineStep.host`).

:class:`~engramrt.runtime.EngramRuntime`, :class:`~engramrt.layer.EngramLayer`
and :mod:`engramrt.custom_ops` use only what these declare. Both are
``runtime_checkable``: ``isinstance(x, RowIdMaker)`` checks that the members
exist (not their signatures), which is what the entry points check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    import numpy as np

    from engramrt.step import EngineStep

__all__ = ["HostRowIdMaker", "LayerHead", "RowIdMaker"]


@runtime_checkable
class RowIdMaker(Protocol):
    """Row ids of every Engram layer for an engine step.

    Attributes:
        n_layers: ``L``, the Engram layers it makes ids for.
        num_cols: ``C``, row ids per token and layer (hash columns).
        device: where it writes the ids (the batch's device).
        out_dtype: the ids' dtype, ``torch.int32`` or ``torch.int64``.
        history_window: tokens before a chunk that its ids depend on (``N - 1`` for
            n-grams of up to ``N`` tokens): what an engine adapter must supply.
    """

    n_layers: int
    num_cols: int
    device: torch.device
    out_dtype: torch.dtype

    @property
    def history_window(self) -> int: ...

    def __call__(
        self,
        batch: EngineStep,
        history: Any = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Row ids ``[T, L, C]`` of ``batch``, written into ``out`` when given (a fixed
        address, ``[T, L, C]`` of :attr:`out_dtype`); updates ``history`` (the engine's
        history object, or None) with the batch's tokens. Launches work on the
        current stream and never waits on the device."""
        ...


@runtime_checkable
class HostRowIdMaker(RowIdMaker, Protocol):
    """A :class:`RowIdMaker` that also makes a step's ids on the host, from its mirror."""

    def hash_on_host(self, batch: EngineStep, layers: Any = None) -> np.ndarray:
        """``[T, len(layers), C]`` int64 row ids of ``batch`` (on the CPU, its history in
        the batch) for ``layers`` (positions; None: all), bit for bit :meth:`__call__`'s;
        never touches the device."""
        ...

    def check_host_step(self, host: EngineStep, step: EngineStep, *, has_history: bool) -> None:
        """Raise a :class:`~engramrt.errors.ValidationError` unless ``host`` can stand for
        ``step`` in :meth:`hash_on_host` (``has_history``: the device's history comes from
        a store, so the mirror must carry it). Host arrays only."""
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

    A head owns its workspace: :meth:`reserve` allocates its fixed buffers once (the
    runtime calls it with the most tokens a step holds), so a step's addresses depend
    on its size only (CUDA graphs).
    """

    hidden_size: int
    hc_mult: int
    head_dim: int
    num_cols: int
    device: torch.device

    def reserve(self, max_tokens: int) -> None:
        """Allocate the fixed buffers for steps of up to ``max_tokens`` tokens (the output
        ``[max_tokens, hc, D]`` and whatever else a step computes into); called once,
        before any step."""
        ...

    def output_buffer(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows of the fixed output ``[max_tokens, hc, D]``."""
        ...

    def compute(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        step: EngineStep | None = None,
        out: torch.Tensor | None = None,
        kv_out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """``out [T, hc, D]`` from ``hidden [T, hc, D]`` and ``rows [T, C, E]`` bf16,
        device work only; callers checked shapes already.

        ``token_mask`` (bool ``[T]``): False passes the token's hidden state through.
        ``step``: the engine step the rows were planned for (a head that carries state
        between steps reads its requests from it; others ignore it). ``out``: a fixed
        buffer to write; ``kv_out`` (``[T, (hc+1)*D]`` bf16, the projected rows): one to
        write the projection into instead of the head's own. Returns ``out``, or
        ``(out, kv)`` with ``return_kv``.
        """
        ...

    def load_weights(self, *args: Any, **weights: Any) -> None:
        """Load the head's weights from plain tensors (names are the head's own)."""
        ...
