"""The engine-facing runtime: one object per model turns each step's batch into ready rows."""

from engramrt.runtime.runtime import EngramRuntime, RuntimeLayer, StepPlan, runtime_from_handle
from engramrt.runtime.synthetic import synthetic_rows, synthetic_stores

__all__ = [
    "EngramRuntime",
    "RuntimeLayer",
    "StepPlan",
    "runtime_from_handle",
    "synthetic_rows",
    "synthetic_stores",
]
