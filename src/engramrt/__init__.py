"""engramrt: the Engram runtime.

Exact n-gram hashing for streaming engines, fp8 table lookups from GPU
memory, pinned host memory or disk, and a fused gate, for DeepSeek's Engram
conditional memory. ``import engramrt`` is cheap: it touches no GPU and
compiles no kernel; kernels are imported and compiled on first use.
"""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CapacityError",
    "CheckpointError",
    "ColumnShard",
    "ConfigError",
    "EngramConfig",
    "EngramError",
    "EngramLayout",
    "LayoutError",
    "ShardingError",
    "TokenMap",
    "TokenizerError",
    "ValidationError",
    "__version__",
    "load_config",
    "memory_plan",
]
