"""Building an :class:`EngramLayer` from a safetensors checkpoint.

The table goes through :func:`engramrt.checkpoint.load_table` (only this
rank's rows are read); the layer's own weights — ``wkv`` (bf16, or fp8 with
its block scales), ``q_weight`` and ``k_weight`` — are read whole. Their
names default to DeepSeek-V4.1's (:data:`DEFAULT_LAYER_WEIGHT_NAMES`:
``layers.{layer}.engram.wkv.weight``, ``...wkv.weight_scale_inv`` or
``...wkv.scale``, ``...engram.q_weight``, ``...engram.k_weight``, each with
or without ``model.``); override any of them with a format string or a list
of them tried in order (``{layer}``: the backbone block index, ``{index}``:
the position in ``engram_layer_ids``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engramrt.checkpoint.names import DEFAULT_HEAD_NAMES, head_name_templates
from engramrt.config import EngramConfig, load_config
from engramrt.errors import CheckpointError
from engramrt.layer.module import EngramLayer
from engramrt.source import RowSource

__all__ = ["DEFAULT_LAYER_WEIGHT_NAMES", "load_layer"]

DEFAULT_LAYER_WEIGHT_NAMES: dict[str, tuple[str, ...]] = DEFAULT_HEAD_NAMES
"""Head weight role -> names tried in order (see :data:`engramrt.checkpoint.names.DEFAULT_HEAD_NAMES`)."""


def _read_tensor(checkpoint: Any, names: Sequence[str]) -> torch.Tensor | None:
    """The first of ``names`` the checkpoint holds, read whole; None if it holds none."""
    from safetensors import safe_open

    for name in names:
        locations = checkpoint.locations(name)
        if locations:
            # Through the checkpoint's held descriptor: the same set as its tables.
            where = locations[0].open_path or str(locations[0].file)
            with safe_open(where, framework="pt") as handle:
                return handle.get_tensor(name)
    return None


def _require(
    tensor: torch.Tensor | None, checkpoint: Any, names: Sequence[str], role: str, layer_id: int
) -> torch.Tensor:
    if tensor is None:
        tried = ", ".join(repr(n) for n in names)
        raise CheckpointError(
            f"layer {layer_id}: no {role} tensor (tried {tried}) in {checkpoint.describe()}; "
            f"pass weight_names={{{role!r}: ...}} if the checkpoint names it differently"
        )
    return tensor


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
    weight_names: Mapping[str, str | Sequence[str]] | None = None,
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
    templates = head_name_templates(weight_names)
    layer_id = cfg.layer_ids[layer_index]
    ckpt = (
        checkpoint
        if isinstance(checkpoint, SafetensorsCheckpoint)
        else SafetensorsCheckpoint(checkpoint)
    )

    def read(role: str) -> torch.Tensor:
        names = [t.format(layer=layer_id, index=layer_index) for t in templates[role]]
        return _require(_read_tensor(ckpt, names), ckpt, names, role, layer_id)

    wkv = read("wkv")
    wkv_scale = read("wkv_scale") if wkv.dtype == torch.float8_e4m3fn else None
    q_weight = read("q_weight")
    k_weight = read("k_weight")
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
