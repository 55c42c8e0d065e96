"""A simulated serving engine for tests, the soak, the demos and the example.

One seeded scheduler (:class:`Scheduler`: paged KV blocks, chunked
prefill, decode, speculative drafts with rollback, prefix-cache hits on live
and finished requests, dead spans, preemption and block reuse, CUDA-graph
padding, prefill/decode hand-off) whose steps are expressed as vLLM-v1
runner metadata (:class:`VllmView`) or SGLang forward batches
(:class:`SglangView`), go through the adapters into a
:class:`~engramrt.hashing.HashBatch` and from there into a hasher or an
:class:`~engramrt.runtime.EngramRuntime` (:class:`Replay`). Expected
results come from things neither the adapters nor the runtime computed
(:func:`one_shot_rows`, the slot cache's contents, the reference lookup).

Imports torch; ``import engramrt`` does not import this package.
"""

from engramrt.testing.engines import (
    ENGINES,
    SglangView,
    VllmEngine,
    VllmView,
    adapt,
    lookback_of,
    seed_started,
    sglang_adapter,
)
from engramrt.testing.oneshot import one_shot_rows
from engramrt.testing.policy import (
    CAPTURE_SIZES,
    REQUEST_CAPTURE_SIZES,
    RandomSchedule,
    capture_size,
)
from engramrt.testing.replay import MODES, SABOTAGES, Replay, Schedule, run_schedules
from engramrt.testing.scheduler import Chunk, Request, Scheduler, Step

__all__ = [
    "CAPTURE_SIZES",
    "ENGINES",
    "MODES",
    "REQUEST_CAPTURE_SIZES",
    "SABOTAGES",
    "Chunk",
    "RandomSchedule",
    "Replay",
    "Request",
    "Schedule",
    "Scheduler",
    "SglangView",
    "Step",
    "VllmEngine",
    "VllmView",
    "adapt",
    "capture_size",
    "lookback_of",
    "one_shot_rows",
    "run_schedules",
    "seed_started",
    "sglang_adapter",
]
