"""The Engram layer (SPEC §8): rows from a row source, then ``wkv`` and the gate.

- :class:`EngramHead` (:mod:`.head`): ``wkv`` and the gate's norm weights;
  ``head(hidden, rows)`` on rows it is given.
- :class:`EngramLayer` (:mod:`.module`): a head plus a
  :class:`~engramrt.source.RowSource` (a store, a cache, an exchange);
  ``prepare(row_ids)`` / ``forward(hidden)`` over staging buffers sized at
  construction (CUDA-graph capturable on sources without a host sync).
- :class:`EngramLinear` (:mod:`.linear`): ``wkv`` from a bf16 or a
  block-scaled fp8 checkpoint weight.
- sequence parallelism: an :class:`~engramrt.exchange.SequenceParallelExchange`
  as the layer's source.
- :mod:`.reference`: the plain PyTorch definition and the derived tolerances.

:func:`load_layer` (a layer from a checkpoint) lives in
:mod:`engramrt.checkpoint.loading` and is importable from here too (imported
on first use, so this package does not import the checkpoint reader).
"""

from __future__ import annotations

from typing import Any

from engramrt.layer.head import EngramHead
from engramrt.layer.linear import EngramLinear, dequantize_block_fp8
from engramrt.layer.module import EngramLayer
from engramrt.layer.reference import (
    BF16_DEQUANT_ROUNDING,
    WEIGHT_BLOCK,
    assert_layer_within_tolerance,
    dequantize_block_fp8_reference,
    engram_layer_reference,
    engram_linear_reference,
    linear_exact,
    linear_tolerance,
)

__all__ = [
    "BF16_DEQUANT_ROUNDING",
    "DEFAULT_LAYER_WEIGHT_NAMES",
    "WEIGHT_BLOCK",
    "EngramHead",
    "EngramLayer",
    "EngramLinear",
    "assert_layer_within_tolerance",
    "dequantize_block_fp8",
    "dequantize_block_fp8_reference",
    "engram_layer_reference",
    "engram_linear_reference",
    "linear_exact",
    "linear_tolerance",
    "load_layer",
]


def __getattr__(name: str) -> Any:
    """``load_layer`` and ``DEFAULT_LAYER_WEIGHT_NAMES``, from :mod:`engramrt.checkpoint.loading`."""
    if name in ("load_layer", "DEFAULT_LAYER_WEIGHT_NAMES"):
        from engramrt.checkpoint import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'engramrt.layer' has no attribute {name!r}")
