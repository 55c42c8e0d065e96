"""Engram tables in safetensors checkpoints: read a rank's rows, write, convert.

- :func:`load_table` / :func:`load_tables` / :func:`load_layer`: stream one
  tensor-parallel rank's rows of each layer's fp8 table (values ``F8_E4M3 [rows, E]`` plus
  ue8m0 scales ``F8_E8M0`` or ``U8 [rows, E/32]``) from a checkpoint file or
  directory (``*.safetensors`` with an optional
  ``model.safetensors.index.json``) into a
  :class:`~engramrt.lookup.tiers.RowStore` placed by a
  :class:`~engramrt.lookup.tiers.TablePlacement`, reading only those rows
  (and, for a layer, its head weights).
- :class:`EngramWeightLoader`: the loader behind them, and an engine-style
  ``load_weights(iterable)`` of ``(name, tensor)`` pairs in any order,
  filling one rank's stores and the layers' heads.
- :func:`save_tables`: write fp8 tables atomically, in DeepSeek's layout.
- :func:`convert_checkpoint`: quantise float tables (bf16/fp16/fp32) into
  fp8 files, one per rank with ``tp=N`` (``engramrt convert``).
- The pieces other memory families' loaders and converters reuse:
  :func:`fill_store` (stream row blocks into a store, as bytes) and
  :func:`commit_conversion` (write a conversion's files as one atomic set);
  Qwen4-Exp PLE's are in :mod:`engramrt.families.qwen4_ple.loading` and
  :mod:`engramrt.families.qwen4_ple.convert`.

Tensor names are configurable per role (:class:`TensorNames`); the
defaults are in :mod:`engramrt.checkpoint.names`. The files engramrt
writes carry the metadata of :mod:`engramrt.checkpoint.metadata`; the
format itself is in :mod:`engramrt.checkpoint.safetensors_format`.
This package imports torch and safetensors; ``import engramrt`` does not
import it.
"""

from __future__ import annotations

from engramrt.checkpoint.convert import (
    ConversionPlan,
    commit_conversion,
    convert_checkpoint,
    output_paths,
    plan_conversion,
    run_conversion,
)
from engramrt.checkpoint.engine_loader import EngramWeightLoader
from engramrt.checkpoint.fill import fill_store
from engramrt.checkpoint.loading import (
    DEFAULT_LAYER_WEIGHT_NAMES,
    load_layer,
    load_table,
    load_tables,
)
from engramrt.checkpoint.metadata import LayerSlot
from engramrt.checkpoint.names import (
    DEFAULT_HEAD_NAMES,
    DEFAULT_SCALE_NAME,
    DEFAULT_SCALE_NAMES,
    DEFAULT_SOURCE_NAMES,
    DEFAULT_WEIGHT_NAME,
    DEFAULT_WEIGHT_NAMES,
    TensorNames,
    load_names,
)
from engramrt.checkpoint.reader import (
    DEFAULT_BLOCK_BYTES,
    SafetensorsCheckpoint,
    iter_packed_rows,
    read_table,
)
from engramrt.checkpoint.safetensors_format import (
    SafetensorsStreamWriter,
    TensorSpec,
    read_header,
)
from engramrt.checkpoint.writer import SCALE_DTYPES, save_tables

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_HEAD_NAMES",
    "DEFAULT_LAYER_WEIGHT_NAMES",
    "DEFAULT_SCALE_NAME",
    "DEFAULT_SCALE_NAMES",
    "DEFAULT_SOURCE_NAMES",
    "DEFAULT_WEIGHT_NAME",
    "DEFAULT_WEIGHT_NAMES",
    "SCALE_DTYPES",
    "ConversionPlan",
    "EngramWeightLoader",
    "LayerSlot",
    "SafetensorsCheckpoint",
    "SafetensorsStreamWriter",
    "TensorNames",
    "TensorSpec",
    "commit_conversion",
    "convert_checkpoint",
    "fill_store",
    "iter_packed_rows",
    "load_layer",
    "load_names",
    "load_table",
    "load_tables",
    "output_paths",
    "plan_conversion",
    "read_header",
    "read_table",
    "run_conversion",
    "save_tables",
]
