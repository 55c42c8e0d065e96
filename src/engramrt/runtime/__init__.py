"""The engine-facing runtime: one object per model turns each step's batch into ready rows."""

from engramrt.runtime.runtime import EngramRuntime, StepRows
from engramrt.runtime.synthetic import synthetic_rows, synthetic_stores

__all__ = ["EngramRuntime", "StepRows", "synthetic_rows", "synthetic_stores"]
