"""What both engines read from engramrt: their step metadata classes import where the
docs say, and their own config readers derive engramrt's hash constants from the
config file engramrt writes (``EngramConfig.to_hf_dict``)."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
from tests.engines.helpers import engine_skip_reason, import_engine, requires_engine

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants

STEP_CLASSES = {
    "sglang": {
        "sglang.srt.model_executor.forward_batch_info": ["ForwardBatch", "ForwardMode"],
        "sglang.srt.mem_cache.memory_pool": ["ReqToTokenPool"],
        "sglang.srt.mem_cache.allocator": ["TokenToKVPoolAllocator"],
        "sglang.srt.managers.schedule_batch": ["MM_PAD_SHIFT_VALUE"],
        "sglang.kernels.ops.embeddings.engram_hash": ["engram_hash_ids"],
        "sglang.srt.layers.engram": ["EngramLayout", "compute_hash_multipliers"],
    },
    "vllm": {
        "vllm.v1.worker.block_table": ["BlockTable"],
        "vllm.v1.utils": ["CpuGpuBuffer"],
        "vllm.v1.attention.backend": ["CommonAttentionMetadata"],
        "vllm.models.deepseek_v41.common.engram": ["EngramLayout", "compute_hash_multipliers"],
    },
}
"""The classes the engine tests and docs/adapters.md name, by the module that defines them."""

ENGINE_PARAMS = [
    pytest.param(name, marks=requires_engine(name), id=name) for name in ("sglang", "vllm")
]


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_step_classes_import(engine: str) -> None:
    modules = import_engine(engine, *STEP_CLASSES[engine])
    for module, names in STEP_CLASSES[engine].items():
        found = getattr(modules, module.rsplit(".", 1)[-1])
        missing = [name for name in names if not hasattr(found, name)]
        assert not missing, f"{module} has no {missing}"


def engine_config(engine: str, hf: dict) -> object:
    """``hf`` (a config.json's fields) as the engine's model config object."""
    if engine == "sglang":
        from sglang.srt.configs.deepseek_v41 import DeepseekV41Config

        return DeepseekV41Config(**hf)
    return SimpleNamespace(**hf)  # vLLM reads the HF config's attributes


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("preset", ["tiny", "dsv41-flash"])
def test_engine_reads_the_config_file(engine: str, preset: str, token_map) -> None:
    assert engine_skip_reason(engine) is None
    engram = importlib.import_module(
        {"sglang": "sglang.srt.layers.engram", "vllm": "vllm.models.deepseek_v41.common.engram"}[
            engine
        ]
    )
    cfg = PRESETS[preset]
    hf = json.loads(json.dumps(cfg.to_hf_dict()))  # as written to config.json
    layout = engram.EngramLayout.from_config(engine_config(engine, hf))
    consts = HashConstants.from_config(cfg, token_map)
    primes = np.asarray(layout.primes).reshape(cfg.n_layers, -1)
    np.testing.assert_array_equal(primes, consts.col_primes)
    multipliers = engram.compute_hash_multipliers(
        tuple(cfg.layer_ids), cfg.max_ngram_size, cfg.compressed_vocab_size
    )
    np.testing.assert_array_equal(np.asarray(multipliers), consts.multipliers)
