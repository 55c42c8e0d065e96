"""Load tables and layers from a safetensors checkpoint: calls of :class:`EngramWeightLoader`.

Each loader here builds one :class:`~engramrt.checkpoint.EngramWeightLoader`
for the layers asked for, placed by a
:class:`~engramrt.lookup.tiers.TablePlacement`, and fills it with
:meth:`~engramrt.checkpoint.EngramWeightLoader.read_checkpoint`: only this
rank's rows are read, in blocks, each written into the store as it arrives
(memory peaks at the store plus one block). The head weights — ``wkv``
(bf16, or fp8 with its block scales), ``q_weight`` and ``k_weight`` — are
read whole and refused when not finite, naming the tensor. Their names
default to DeepSeek-V4.1's (:data:`DEFAULT_LAYER_WEIGHT_NAMES`); override
any of them with a format string or a list of them tried in order
(``{layer}``: the backbone block index, ``{index}``: the position in
``engram_layer_ids``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engramrt.checkpoint.engine_loader import EngramWeightLoader
from engramrt.checkpoint.names import DEFAULT_HEAD_NAMES
from engramrt.checkpoint.reader import ConfigSource, NamesSpec, SafetensorsCheckpoint, _resolve
from engramrt.errors import CheckpointError
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import RowStore, TablePlacement
from engramrt.tokenmap import TokenMap

if TYPE_CHECKING:
    from engramrt.layer.module import EngramLayer

__all__ = ["DEFAULT_LAYER_WEIGHT_NAMES", "load_layer", "load_table", "load_tables"]

DEFAULT_LAYER_WEIGHT_NAMES: dict[str, tuple[str, ...]] = DEFAULT_HEAD_NAMES
"""Head weight role -> names tried in order (see :data:`engramrt.checkpoint.names.DEFAULT_HEAD_NAMES`)."""

Checkpoint = SafetensorsCheckpoint | str | os.PathLike[str]


def load_table(
    checkpoint: Checkpoint,
    config: ConfigSource,
    layer_index: int,
    placement: TablePlacement | None = None,
    *,
    names: NamesSpec = None,
    store: RowStore | None = None,
    block_rows: int | None = None,
    layout: EngramLayout | None = None,
    token_map: TokenMap | None = None,
    verify_checksums: bool = False,
    group: Any = None,
) -> RowStore:
    """Load the placement's rank's rows of layer ``layer_index``'s table into a :class:`RowStore`.

    Args:
        checkpoint: a ``.safetensors`` file or a directory of them.
        config: an :class:`~engramrt.config.EngramConfig`, preset name or config path.
        layer_index: position in ``config.layer_ids``.
        placement: where the rows live (tier and settings, device, rank,
            directory of tier ``"disk"``); default: ``TablePlacement()``
            (tier ``"auto"``, the whole table).
        names: tensor names (see :mod:`engramrt.checkpoint.names`).
        store: an empty store to fill instead (its rows, E and row_begin
            must match the shard).
        block_rows: rows per block (default: about 64 MiB).
        layout: the config's layout, if already built.
        token_map, verify_checksums: see :meth:`EngramWeightLoader.read_checkpoint`.
        group: the process group of the ranks loading this checkpoint: they
            compare conversion ids before reading (see
            :meth:`EngramWeightLoader.read_checkpoint`); every rank must call this.

    Raises:
        CheckpointError: a tensor is missing or has the wrong dtype or shape;
            with ``group``, the ranks hold different conversions (naming each id).
        CapacityError: the chosen memory or disk is too small.
        TokenizerError: the checkpoint was hashed with another token map.
    """
    cfg, layout = _resolve(config, layout)
    loader = EngramWeightLoader(
        cfg,
        placement,
        layer_ids=[cfg.layer_ids[layer_index]],
        with_heads=False,
        stores=None if store is None else [store],
        table_names=names,
        block_rows=block_rows,
        layout=layout,
    )
    loader.read_checkpoint(
        checkpoint, token_map=token_map, verify_checksums=verify_checksums, group=group
    )
    return loader.finish()[0]


def load_tables(
    checkpoint: Checkpoint,
    config: ConfigSource,
    placement: TablePlacement | None = None,
    *,
    names: NamesSpec = None,
    block_rows: int | None = None,
    token_map: TokenMap | None = None,
    verify_checksums: bool = False,
    group: Any = None,
) -> list[RowStore]:
    """:func:`load_table` for every Engram layer, in ``config.layer_ids`` order.

    Tier ``"disk"`` (or ``"auto"`` falling back to it) writes
    ``engram-layer<id>-rank<r>-of-<tp>.rows`` files under the placement's
    ``disk_dir``. Every layer is checked against ``token_map`` (default: the
    DeepSeek-V4 map, built once per process). With ``group`` (the process group
    of the ranks loading the checkpoint, e.g. the tensor-parallel group), the
    ranks compare conversion ids first and refuse to serve different
    conversions (see :meth:`EngramWeightLoader.read_checkpoint`). To know
    which conversion was read, open it first and read its id::

        with SafetensorsCheckpoint(path) as checkpoint:
            stores = load_tables(checkpoint, config, placement, group=group)
            served = checkpoint.conversion_id
    """
    loader = EngramWeightLoader(
        config, placement, with_heads=False, table_names=names, block_rows=block_rows
    )
    loader.read_checkpoint(
        checkpoint, token_map=token_map, verify_checksums=verify_checksums, group=group
    )
    return loader.finish()


def load_layer(
    checkpoint: Checkpoint,
    config: ConfigSource,
    layer_index: int,
    placement: TablePlacement | None = None,
    *,
    max_tokens: int,
    group: Any = None,
    collective: str = "reduce_scatter",
    agree_group: Any = None,
    table_names: NamesSpec = None,
    weight_names: Mapping[str, str | Sequence[str]] | None = None,
    token_map: TokenMap | None = None,
) -> EngramLayer:
    """The Engram layer ``layer_index`` (position in ``engram_layer_ids``) of a checkpoint.

    Args:
        checkpoint: a ``.safetensors`` file or a directory of them.
        config: the model's Engram config (or a preset / config.json).
        placement: where the table's rows live and which rank's shard they are
            (see :func:`load_table`).
        max_tokens: sizes the layer's staging buffers.
        group, collective: under sequence parallelism, the group to exchange
            rows over and how (a :class:`~engramrt.exchange.SequenceParallelExchange`
            becomes the layer's source); None: the store is the source. The
            group's ranks also compare conversion ids before reading (see
            :meth:`EngramWeightLoader.read_checkpoint`).
        agree_group: the group whose ranks compare conversion ids when there
            is no exchange ``group`` (e.g. plain tensor parallelism); default
            ``group``.
        table_names: names of the table tensors (see :mod:`engramrt.checkpoint.names`).
        weight_names: overrides of :data:`DEFAULT_LAYER_WEIGHT_NAMES`.
        token_map: see :meth:`EngramWeightLoader.read_checkpoint`.

    Raises:
        CheckpointError: a tensor is missing (naming it, the layer and the
            files searched), has the wrong shape or dtype, or holds NaN or
            inf (a head weight, or a wkv scale that is not > 0).
    """
    from engramrt.layer.module import EngramLayer
    from engramrt.source import RowSource

    cfg, layout = _resolve(config, None)
    if not 0 <= layer_index < cfg.n_layers:
        raise CheckpointError(f"layer_index={layer_index} must be in [0, {cfg.n_layers})")
    loader = EngramWeightLoader(
        cfg,
        placement,
        layer_ids=[cfg.layer_ids[layer_index]],
        table_names=table_names,
        weight_names=weight_names,
        layout=layout,
    )
    loader.read_checkpoint(
        checkpoint, token_map=token_map, group=group if agree_group is None else agree_group
    )
    (store,) = loader.finish()
    (weights,) = loader.head_weights
    source: RowSource = store
    if group is not None:
        from engramrt.exchange import SequenceParallelExchange

        source = SequenceParallelExchange(
            store, num_cols=cfg.n_cols, max_tokens=max_tokens, group=group, collective=collective
        )
    layer = EngramLayer(cfg, source, max_tokens=max_tokens)
    layer.load_weights(
        wkv=weights["wkv"],
        wkv_scale=weights.get("wkv_scale"),
        q_weight=weights["q_weight"],
        k_weight=weights["k_weight"],
    )
    return layer
