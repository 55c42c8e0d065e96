"""Engine adapters: a serving engine's step metadata as a :class:`HashBatch`.

- :func:`from_vllm_step`: a vLLM-style V1 model runner's step (flattened
  tokens, ``query_start_loc``, ``slot_mapping``, a block table; CUDA-graph
  padding) for a :class:`SlotHashCache` made by :func:`vllm_slot_cache`.
- :func:`from_sglang_batch`: an SGLang-style forward batch (per-request
  lengths, ``req_pool_indices`` into a request-to-token pool) for a
  :class:`SlotHashCache` made by :func:`sglang_slot_cache`, or (SGLang's own
  design) one history row per pool row, :func:`sglang_request_history`.

Neither synchronises with the device; their checks (``validate=True``) read
host metadata only. docs/adapters.md maps every field.
"""

from engramrt.adapters.sglang import (
    from_sglang_batch,
    sglang_request_history,
    sglang_slot_cache,
)
from engramrt.adapters.vllm import from_vllm_step, vllm_slot_cache

__all__ = [
    "from_sglang_batch",
    "from_vllm_step",
    "sglang_request_history",
    "sglang_slot_cache",
    "vllm_slot_cache",
]
