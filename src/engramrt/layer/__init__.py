"""The Engram layer (SPEC §8): lookup, ``wkv`` projection and gate as one module.

- :class:`EngramLayer` (:mod:`.module`): config-driven ``nn.Module`` holding a
  :class:`~engramrt.lookup.tiers.RowStore`, ``wkv`` and the gate's norm
  weights; ``prepare(row_ids)`` / ``forward(hidden)`` over staging buffers
  sized at construction (CUDA-graph capturable on the device tier).
- :class:`EngramLinear` (:mod:`.linear`): ``wkv`` from a bf16 or a
  block-scaled fp8 checkpoint weight.
- :mod:`.parallel`: sequence parallelism over a tensor-parallel group.
- :mod:`.reference`: the plain PyTorch definition and the derived tolerances.
"""

from __future__ import annotations

from engramrt.layer.linear import EngramLinear, dequantize_block_fp8
from engramrt.layer.loading import DEFAULT_LAYER_WEIGHT_NAMES, load_layer
from engramrt.layer.module import EngramLayer
from engramrt.layer.parallel import (
    COLLECTIVES,
    SequenceParallelRows,
    rank_columns,
    shard_tokens,
    token_range,
    tokens_per_rank,
)
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
    "COLLECTIVES",
    "DEFAULT_LAYER_WEIGHT_NAMES",
    "WEIGHT_BLOCK",
    "EngramLayer",
    "EngramLinear",
    "SequenceParallelRows",
    "assert_layer_within_tolerance",
    "dequantize_block_fp8",
    "dequantize_block_fp8_reference",
    "engram_layer_reference",
    "engram_linear_reference",
    "linear_exact",
    "linear_tolerance",
    "load_layer",
    "rank_columns",
    "shard_tokens",
    "token_range",
    "tokens_per_rank",
]
