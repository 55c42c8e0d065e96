"""engramrt: the Engram runtime.

Exact n-gram hashing for streaming engines, fp8 table lookups from GPU
memory, pinned host memory or disk, and a fused gate, for DeepSeek's Engram
conditional memory. ``import engramrt`` is cheap: it touches no GPU,
imports neither torch nor Triton and compiles no kernel.

The names of the config, layout, token map and errors are imported here.
Everything that needs torch (hashing, lookups, the gate, the layer, the
runtime, the exchanges) is listed in :data:`_LAZY` and imported on first
access, so ``engramrt.NgramHasher`` imports torch and the hashing package;
Triton itself is imported only when a kernel first runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engramrt.config import PRESETS, EngramConfig, load_config
from engramrt.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    EngramError,
    LayoutError,
    ShardingError,
    TokenizerError,
    ValidationError,
)
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.plan import memory_plan
from engramrt.tokenmap import TokenMap

if TYPE_CHECKING:
    from engramrt.cache import CachedRowStore
    from engramrt.checkpoint import load_layer, load_table, load_tables
    from engramrt.exchange import (
        AllGatherExchange,
        AllToAllExchange,
        SequenceParallelExchange,
    )
    from engramrt.gate import GateInputs, engram_gate
    from engramrt.hashing import HashBatch, NgramHasher, RequestHistory, SlotHashCache
    from engramrt.layer import (
        EngramHead,
        EngramLayer,
    )
    from engramrt.lookup import lookup_rows
    from engramrt.lookup.tiers import RowStore, TablePlacement, make_store
    from engramrt.protocols import LayerHead, RowIdMaker
    from engramrt.quant import dequantize_rows, quantize_rows
    from engramrt.runtime import EngramRuntime
    from engramrt.source import PendingRows, RowSource

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # hashing (SPEC §4-5)
    "HashBatch": "engramrt.hashing:HashBatch",
    "NgramHasher": "engramrt.hashing:NgramHasher",
    "RowIdMaker": "engramrt.protocols:RowIdMaker",
    "RequestHistory": "engramrt.hashing:RequestHistory",
    "SlotHashCache": "engramrt.hashing:SlotHashCache",
    # rows (SPEC §6-7): row sources, storage tiers, the hot-row cache, exchanges
    "RowSource": "engramrt.source:RowSource",
    "PendingRows": "engramrt.source:PendingRows",
    "RowStore": "engramrt.lookup.tiers:RowStore",
    "TablePlacement": "engramrt.lookup.tiers:TablePlacement",
    "make_store": "engramrt.lookup.tiers:make_store",
    "load_table": "engramrt.checkpoint:load_table",
    "load_tables": "engramrt.checkpoint:load_tables",
    "load_layer": "engramrt.checkpoint:load_layer",
    "CachedRowStore": "engramrt.cache:CachedRowStore",
    "AllGatherExchange": "engramrt.exchange:AllGatherExchange",
    "SequenceParallelExchange": "engramrt.exchange:SequenceParallelExchange",
    "AllToAllExchange": "engramrt.exchange:AllToAllExchange",
    # operations with a stable signature
    "quantize_rows": "engramrt.quant:quantize_rows",
    "dequantize_rows": "engramrt.quant:dequantize_rows",
    "lookup_rows": "engramrt.lookup:lookup_rows",
    "GateInputs": "engramrt.gate:GateInputs",
    "engram_gate": "engramrt.gate:engram_gate",
    # modules and the engine-facing runtime (SPEC §8)
    "EngramHead": "engramrt.layer:EngramHead",
    "LayerHead": "engramrt.protocols:LayerHead",
    "EngramLayer": "engramrt.layer:EngramLayer",
    "EngramRuntime": "engramrt.runtime:EngramRuntime",
}
"""Public names imported on first access: name -> ``"module:attribute"``."""

__all__ = [
    "PRESETS",
    "AllGatherExchange",
    "AllToAllExchange",
    "CachedRowStore",
    "CapacityError",
    "CheckpointError",
    "ColumnShard",
    "ConfigError",
    "EngramConfig",
    "EngramError",
    "EngramHead",
    "EngramLayer",
    "EngramLayout",
    "EngramRuntime",
    "GateInputs",
    "HashBatch",
    "LayerHead",
    "LayoutError",
    "NgramHasher",
    "PendingRows",
    "RequestHistory",
    "RowIdMaker",
    "RowSource",
    "RowStore",
    "SequenceParallelExchange",
    "ShardingError",
    "SlotHashCache",
    "TablePlacement",
    "TokenMap",
    "TokenizerError",
    "ValidationError",
    "__version__",
    "dequantize_rows",
    "engram_gate",
    "load_config",
    "load_layer",
    "load_table",
    "load_tables",
    "lookup_rows",
    "make_store",
    "memory_plan",
    "quantize_rows",
]


def __getattr__(name: str) -> Any:
    """Import a name of :data:`_LAZY` on first access and keep it in the module."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(
            f"module 'engramrt' has no attribute {name!r}; the public names are in engramrt.__all__"
        )
    module_name, attribute = target.split(":")
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
