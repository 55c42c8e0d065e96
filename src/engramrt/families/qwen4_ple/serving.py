"""Qwen4-Exp PLE through :class:`~engramrt.runtime.EngramRuntime`: its row-id maker and head.

The runtime composes a row-id maker, one row source per layer and one head per layer
(:mod:`engramrt.protocols`). For PLE:

- :class:`PleRowIdMaker`: an engine step's row ids of every PLE layer from its raw ids,
  each request's id context read from and written back to a
  :class:`~engramrt.families.qwen4_ple.streaming.PleStatePool` (the runtime's
  ``history``) at the step's ``request_slots``;
- the row sources: a bf16 store per PLE layer of any tier (``make_store(...,
  row_format=BF16)``, :func:`~engramrt.families.qwen4_ple.loading.load_ple_tables`), or a
  cache in front of one;
- :class:`PleHead`: the layer from the rows the runtime staged (the norms, the gate, the
  dilated conv: :meth:`PleLayer.compute_rows
  <engramrt.families.qwen4_ple.module.PleLayer.compute_rows>`), its conv state in the same
  pool at the same slots.

:func:`ple_runtime` builds all of it from a checkpoint. So a PLE model plans and runs like
an Engram one: ``runtime.plan(step)`` after sampling,
``runtime.run(i, hidden)`` at PLE layer ``i``, hidden streams ``[T, hc, D]``. The step
must carry ``request_slots`` (each request's pool row: the engine's persistent-batch row);
the pool's other schedule rules (reset at a request's start, snapshots, rollback,
hand-off) are the engine's calls on the pool, as in docs/families.md, "Streaming state".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.layer import PleLayerWeights
from engramrt.families.qwen4_ple.module import PleLayer
from engramrt.families.qwen4_ple.ops import PleHasher
from engramrt.families.qwen4_ple.streaming import PleStatePool, ple_row_ids_slots
from engramrt.layer.workspace import fixed_buffer, leading_rows
from engramrt.step import EngineStep

if TYPE_CHECKING:
    from engramrt.checkpoint.reader import SafetensorsCheckpoint
    from engramrt.families.qwen4_ple.loading import FamilySource
    from engramrt.lookup.tiers import TablePlacement
    from engramrt.runtime import EngramRuntime

__all__ = ["PleHead", "PleRowIdMaker", "ple_runtime"]


def _request_slots(step: EngineStep | None, who: str) -> torch.Tensor:
    if not isinstance(step, EngineStep):
        raise ValidationError(
            f"{who}: step is a {type(step).__name__}; expected the EngineStep the rows were "
            f"planned for (EngramRuntime.run passes it)"
        )
    if step.request_slots is None:
        raise ValidationError(
            f"{who}: step.request_slots is None; expected [R] each request's row of the "
            f"PleStatePool (the engine's persistent-batch row; padded requests: pool.pad_slot)"
        )
    return step.request_slots


class PleRowIdMaker:
    """A :class:`~engramrt.protocols.RowIdMaker` for PLE: row ids ``[T, L, C]`` of every
    PLE layer of a step, each request's context in a :class:`PleStatePool`.

    Args:
        hasher: the :class:`~engramrt.families.qwen4_ple.ops.PleHasher` (its backend, checks
            and output dtype are this maker's).

    Called by the runtime with ``history`` = the runtime's pool; the contexts of the
    step's ``request_slots`` move on in place.
    """

    def __init__(self, hasher: PleHasher) -> None:
        if not isinstance(hasher, PleHasher):
            raise ValidationError(f"hasher is a {type(hasher).__name__}; expected a PleHasher")
        self.hasher = hasher
        self.n_layers = hasher.n_layers
        self.num_cols = hasher.n_cols
        self.device = hasher.device
        self.out_dtype = hasher.out_dtype
        self.history_window = hasher.ngram_size - 1

    def __call__(
        self,
        batch: EngineStep,
        history: Any = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(history, PleStatePool):
            raise ValidationError(
                f"history is a {type(history).__name__}; expected the PleStatePool that holds "
                f"the requests' id contexts (EngramRuntime(..., history=pool))"
            )
        slots = _request_slots(batch, "PleRowIdMaker")
        return ple_row_ids_slots(
            self.hasher, batch.input_ids, batch.query_start_loc, slots, history.contexts, out=out
        )


class PleHead:
    """A :class:`~engramrt.protocols.LayerHead` for one PLE layer: ``out [T, hc, D]`` from
    the hidden streams ``[T, hc, D]`` and the rows the runtime staged ``[T, C, d]``, the
    conv state of each request at its ``request_slots`` row of ``conv_states``.

    Args:
        layer: the layer's :class:`PleLayer` (``table=None, table_width=d``: the runtime
            gathers the rows).
        conv_states: ``[num_slots, S, hc*D]``, this layer's pool (``pool.conv_states[i]``).

    The output buffer (:meth:`reserve`) is in the model dtype.
    """

    def __init__(self, layer: PleLayer, conv_states: torch.Tensor) -> None:
        if not isinstance(layer, PleLayer):
            raise ValidationError(f"layer is a {type(layer).__name__}; expected a PleLayer")
        expected = [layer.state_len, layer.width]
        if (
            not isinstance(conv_states, torch.Tensor)
            or conv_states.dim() != 3
            or list(conv_states.shape[1:]) != expected
            or conv_states.dtype != layer.dtype
            or conv_states.device != layer.device
        ):
            raise ValidationError(
                f"conv_states is not [num_slots, S, hc*D] = [*, {expected[0]}, {expected[1]}] "
                f"{layer.dtype} on {layer.device}; expected this layer's view of the pool"
            )
        self.layer = layer
        self.conv_states = conv_states
        self.hidden_size = layer.hidden_size
        self.hc_mult = layer.hc_count
        self.head_dim = layer.table_width
        self.num_cols = layer.num_heads
        self.device = layer.device
        self._out: torch.Tensor | None = None

    @classmethod
    def from_pool(
        cls, pool: PleStatePool, index: int, weights: PleLayerWeights, **options: Any
    ) -> PleHead:
        """The head of PLE layer ``index`` (its position in ``ple_layer_ids``) over
        ``pool``; ``options`` go to :class:`PleLayer` (``backend``, ``validate``, ...)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < pool.n_layers:
            raise ValidationError(f"index={index!r}; expected a PLE layer in [0, {pool.n_layers})")
        config = pool.config
        layer = PleLayer.from_config(
            config, weights, None, table_width=config.table_width, **options
        )
        return cls(layer, pool.conv_states[index])

    def reserve(self, max_tokens: int) -> None:
        """Allocate the fixed output ``[max_tokens, hc, D]`` (model dtype, NaN-poisoned)."""
        layer = self.layer
        self._out = fixed_buffer(
            max_tokens, layer.hc_count, layer.hidden_size, dtype=layer.dtype, device=layer.device
        )

    def output_buffer(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows of the fixed output :meth:`reserve` allocated."""
        return leading_rows(self._out, num_tokens)

    @torch.no_grad()
    def load_weights(self, **weights: torch.Tensor) -> None:
        """Copy ``key_proj``, ``value_proj``, ``norm_key``, ``norm_query``, ``norm_conv`` and
        ``conv1d`` (the checkpoint's names under ``...ple.``) into the layer's tensors in
        place (their addresses stay: load before or after capturing a graph)."""
        names = ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")
        if set(weights) != set(names):
            raise ValidationError(
                f"load_weights got {sorted(weights)}; expected exactly {sorted(names)}"
            )
        given = PleLayerWeights(**weights)  # checks the shapes among themselves
        held = self.layer.weights
        for name in names:
            target, value = getattr(held, name), getattr(given, name)
            if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
                raise ValidationError(
                    f"{name} has shape {list(value.shape)} dtype {value.dtype}; expected "
                    f"{list(target.shape)} {target.dtype} (the layer's model dtype)"
                )
            target.copy_(value)

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
        """``out [T, hc, D]`` of the step's tokens; the step's requests' conv states move
        on. ``kv_out`` and ``return_kv`` are the Engram head's (a PLE head's key and
        value do not leave it): ``return_kv=True`` is refused."""
        if return_kv or kv_out is not None:
            raise ValidationError(
                "return_kv / kv_out: a PLE head keeps its key and value inside the layer; "
                "expected return_kv=False and kv_out=None"
            )
        slots = _request_slots(step, "PleHead")
        assert step is not None
        layer = self.layer
        num_tokens = hidden.shape[0]
        result = self.output_buffer(num_tokens) if out is None else out
        layer.compute_rows(
            hidden.reshape(num_tokens, layer.width),
            rows.reshape(num_tokens, layer.embed_dim),
            step.query_start_loc,
            self.conv_states,
            slots,
            token_mask=token_mask,
            out=result.view(num_tokens, layer.width),
        )
        return result


def ple_runtime(
    checkpoint: SafetensorsCheckpoint | str | os.PathLike[str],
    config: FamilySource,
    placement: TablePlacement | None = None,
    *,
    max_tokens: int,
    max_requests: int,
    num_snapshots: int = 0,
    max_draft_tokens: int = 0,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    validate: bool = True,
    **runtime_options: Any,
) -> tuple[EngramRuntime, PleStatePool]:
    """An :class:`~engramrt.runtime.EngramRuntime` serving a Qwen4-Exp model's PLE layers
    from ``checkpoint``, and the :class:`PleStatePool` its steps read and write.

    The tables go into bf16 stores of ``placement``'s tier
    (:func:`~engramrt.families.qwen4_ple.loading.load_ple_tables`), the layer weights into
    one :class:`PleHead` each (:func:`~engramrt.families.qwen4_ple.checkpoint.
    read_ple_layer_weights`, in ``dtype``, default the stored one), the ids from a
    :class:`PleRowIdMaker` on the placement's device. ``runtime_options`` go to the
    runtime (``lookup_workers``, ``gpu_reads``, ...). Each step must carry
    ``request_slots``; the engine calls the pool for the schedule's other events.

    Raises:
        ValidationError: ``placement.tp > 1``: a rank's store holds a slice of every row's
            values (``embedding_colwise``), which the heads cannot use until the slices are
            gathered across ranks (not provided yet).
        CheckpointError: what :func:`load_ple_tables` and ``read_ple_layer_weights`` raise.
    """
    from engramrt._device import resolve_device
    from engramrt.families.qwen4_ple.checkpoint import read_ple_layer_weights
    from engramrt.families.qwen4_ple.loading import load_ple_tables, ple_family
    from engramrt.lookup.tiers import check_placement
    from engramrt.runtime import EngramRuntime

    family = ple_family(config)
    placement = check_placement(placement, "ple_runtime(path, config, TablePlacement('host'))")
    if placement.tp > 1:
        raise ValidationError(
            f"placement.tp={placement.tp}; expected 1: under tensor parallelism a rank holds "
            f"a slice of every PLE row's values, and gathering them for the heads is not "
            f"provided yet (load_ple_tables loads the slices)"
        )
    device = resolve_device(placement.device)
    weights = [
        read_ple_layer_weights(checkpoint, family.config, index, dtype=dtype)
        for index in range(family.config.n_layers)
    ]
    model_dtype = weights[0].dtype
    stores = load_ple_tables(checkpoint, family, placement)
    pool = PleStatePool(
        family.config,
        max_requests=max_requests,
        num_snapshots=num_snapshots,
        max_draft_tokens=max_draft_tokens,
        dtype=model_dtype,
        device=device,
        validate=validate,
    )
    heads = [
        PleHead.from_pool(pool, index, layer.to(device=device), backend=backend, validate=validate)
        for index, layer in enumerate(weights)
    ]
    hasher = PleHasher(family.config, device, backend=backend, validate=validate)
    runtime = EngramRuntime(
        PleRowIdMaker(hasher),
        stores,
        heads=heads,
        max_tokens=max_tokens,
        max_requests=max_requests,
        history=pool,
        validate=validate,
        **runtime_options,
    )
    return runtime, pool
