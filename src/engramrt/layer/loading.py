"""Building an :class:`EngramLayer` from a safetensors checkpoint.

The table goes through :func:`engramrt.checkpoint.load_table` (only this
rank's rows are read); the layer's own weights — ``wkv`` (bf16, or fp8 with
its ``weight_scale_inv``), ``q_weight`` and ``k_weight`` — are read whole.
Their names default to DeepSeek's ``model.layers.<block>.<module>``
convention; like the table's names they are defaults, not a statement of
what every checkpoint uses: override any of them with a format string
(``{layer}``: the backbone block index, ``{index}``: the position in
``engram_layer_ids``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engramrt.config import EngramConfig, load_config
from engramrt.errors import CheckpointError
from engramrt.layer.module import EngramLayer
from engramrt.source import RowSource

__all__ = ["DEFAULT_LAYER_WEIGHT_NAMES", "load_layer"]

DEFAULT_LAYER_WEIGHT_NAMES: dict[str, str] = {
    "wkv": "model.layers.{layer}.engram.wkv.weight",
    "wkv_scale": "model.layers.{layer}.engram.wkv.weight_scale_inv",
    "q_weight": "model.layers.{layer}.engram.q_norm.weight",
    "k_weight": "model.layers.{layer}.engram.k_norm.weight",
}


def _read_tensor(checkpoint: Any, name: str, role: str, layer_id: int) -> torch.Tensor:
    from safetensors import safe_open

    locations = checkpoint.locations(name)
    if not locations:
        raise CheckpointError(
            f"layer {layer_id}: no {role} tensor {name!r} in {checkpoint.describe()}; pass "
            f"weight_names={{{role!r}: ...}} if the checkpoint names it differently"
        )
    with safe_open(str(locations[0].file), framework="pt") as handle:
        return handle.get_tensor(name)


def load_layer(
    checkpoint: str | os.PathLike[str] | Any,
    config: EngramConfig | str | Path,
    layer_index: int,
    *,
    max_tokens: int,
    tp: int = 1,
    rank: int = 0,
    group: Any = None,
    tier: str = "auto",
    device: torch.device | str | None = None,
    table_names: Any = None,
    weight_names: Mapping[str, str] | None = None,
    collective: str = "reduce_scatter",
    **store_options: Any,
) -> EngramLayer:
    """The Engram layer ``layer_index`` (position in ``engram_layer_ids``) of a checkpoint.

    Args:
        checkpoint: a ``.safetensors`` file or a directory of them.
        config: the model's Engram config (or a preset / config.json).
        max_tokens: sizes the layer's staging buffers.
        tp, rank: tensor-parallel shard to load.
        group, collective: under sequence parallelism, the group to exchange
            rows over and how (a :class:`~engramrt.exchange.SequenceParallelExchange`
            becomes the layer's source); None: the store is the source.
        tier, device, store_options: where the table's rows live (see
            :func:`engramrt.lookup.tiers.make_store`).
        table_names: names of the table tensors (see :mod:`engramrt.checkpoint.names`).
        weight_names: overrides of :data:`DEFAULT_LAYER_WEIGHT_NAMES`.

    Raises:
        CheckpointError: a tensor is missing (naming it, the layer and the
            files searched) or has the wrong shape or dtype.
    """
    from engramrt.checkpoint import load_table
    from engramrt.checkpoint.reader import SafetensorsCheckpoint

    cfg = load_config(config)
    if not 0 <= layer_index < cfg.n_layers:
        raise CheckpointError(f"layer_index={layer_index} must be in [0, {cfg.n_layers})")
    unknown = sorted(set(weight_names or {}) - set(DEFAULT_LAYER_WEIGHT_NAMES))
    if unknown:
        raise CheckpointError(
            f"weight_names has {unknown}; expected only {', '.join(DEFAULT_LAYER_WEIGHT_NAMES)}"
        )
    names = {**DEFAULT_LAYER_WEIGHT_NAMES, **(weight_names or {})}
    layer_id = cfg.layer_ids[layer_index]
    ckpt = (
        checkpoint
        if isinstance(checkpoint, SafetensorsCheckpoint)
        else SafetensorsCheckpoint(checkpoint)
    )

    def name_of(role: str) -> str:
        return names[role].format(layer=layer_id, index=layer_index)

    wkv = _read_tensor(ckpt, name_of("wkv"), "wkv", layer_id)
    wkv_scale = None
    if wkv.dtype == torch.float8_e4m3fn:
        wkv_scale = _read_tensor(ckpt, name_of("wkv_scale"), "wkv_scale", layer_id)
    q_weight = _read_tensor(ckpt, name_of("q_weight"), "q_weight", layer_id)
    k_weight = _read_tensor(ckpt, name_of("k_weight"), "k_weight", layer_id)
    store = load_table(
        ckpt,
        cfg,
        layer_index,
        tp=tp,
        rank=rank,
        names=table_names,
        tier=tier,
        device=device,
        **store_options,
    )
    source: RowSource = store
    if group is not None:
        from engramrt.exchange import SequenceParallelExchange

        source = SequenceParallelExchange(
            store, num_cols=cfg.n_cols, max_tokens=max_tokens, group=group, collective=collective
        )
    layer = EngramLayer(cfg, source, max_tokens=max_tokens)
    layer.load_weights(wkv=wkv, wkv_scale=wkv_scale, q_weight=q_weight, k_weight=k_weight)
    return layer
