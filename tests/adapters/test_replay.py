"""Engine replays: adapted steps hash exactly like one-shot hashing (SPEC §5).

Simulated vLLM-style runners and SGLang-style forward batches (see
``engines.py``) run random schedules: chunked prefill with requests
interleaved, decode, speculative drafts with rejection, prefix-cache hits
(on live and finished requests), preemption, CUDA-graph padding of tokens
and requests, requests finishing and their blocks or slots reused. Every
step's row ids are compared bit for bit with ``hash_sequence`` of each full
sequence, and the slot cache with the tokens each live request owns, on the
reference and through the Triton kernel. Negative controls run the same
schedules through deliberately wrong adapters and must fail.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tests.adapters.engines import SglangRunner, VllmRunner

from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher

ENGINES = {"vllm": VllmRunner, "sglang": SglangRunner}


@pytest.fixture(scope="module")
def consts(token_map) -> HashConstants:
    return HashConstants.from_config(PRESETS["tiny"], token_map)


def _replay(
    engine: str,
    seed: int,
    backend: str,
    consts,
    token_map,
    *,
    device="cpu",
    steps: int = 12,
    adapter=None,
    block_size: int = 4,
    pad_slot_id: int = -1,
    worst_padding: bool = False,
):
    rng = np.random.default_rng(seed)
    hasher = NgramHasher(consts, token_map, device, backend=backend, validate=True)
    assert hasher.backend == backend
    dead_rate = float(rng.choice([0.0, 0.0, 0.1]))
    options = (
        {"block_size": block_size, "pad_slot_id": pad_slot_id, "worst_padding": worst_padding}
        if engine == "vllm"
        else {}
    )
    sim = ENGINES[engine](
        rng, consts, token_map.map, hasher, adapter, dead_rate=dead_rate, **options
    )
    sim.run(steps)
    return sim


_FAST = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 3, 4, 16]),
    pad_slot_id=st.sampled_from([-1, 0]),
)
@settings(max_examples=100, **_FAST)
def test_vllm_replays_match_one_shot(seed, block_size, pad_slot_id, consts, token_map) -> None:
    sim = _replay(
        "vllm", seed, "reference", consts, token_map, block_size=block_size, pad_slot_id=pad_slot_id
    )
    assert not sim.mismatches, sim.mismatches


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=100, **_FAST)
def test_sglang_replays_match_one_shot(seed, consts, token_map) -> None:
    sim = _replay("sglang", seed, "reference", consts, token_map)
    assert not sim.mismatches, sim.mismatches


@pytest.mark.parametrize("engine", sorted(ENGINES))
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 4, 16]))
@example(seed=845399, block_size=1)  # drafts accepted past the simulator's MAX_LEN
@settings(max_examples=10, **_FAST)
def test_kernel_replays_match_one_shot(engine, seed, block_size, consts, token_map, device) -> None:
    sim = _replay(
        engine, seed, "triton", consts, token_map, device=device, steps=16, block_size=block_size
    )
    assert not sim.mismatches, sim.mismatches


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_replays_explicit_seeds(engine, seed, consts, token_map, device) -> None:
    sim = _replay(engine, seed, "triton", consts, token_map, device=device, steps=14)
    assert not sim.mismatches, sim.mismatches
    assert sim.steps == 14


def test_schedules_reach_every_engine_state(consts, token_map) -> None:
    """The replays above would prove little if the schedules never reached these states."""
    reached: dict[str, Counter[str]] = {name: Counter() for name in ENGINES}
    for name in ENGINES:
        for seed in range(8):
            sim = _replay(name, seed, "reference", consts, token_map, steps=16)
            assert not sim.mismatches, sim.mismatches
            reached[name].update(sim.events)
    common = [
        "drafts rejected",
        "padded tokens",
        "padded requests",
        "prefix hit",
        "prefix hit on a finished request",
        "requests in one step",
    ]
    wanted = {
        "vllm": [*common, "block reused", "preempted", "whole prompt hit"],
        "sglang": [*common, "slot reused", "extend step", "decode step", "verify step"],
    }
    for name, states in wanted.items():
        missing = [s for s in states if reached[name][s] == 0]
        assert not missing, f"{name} schedules never reached {missing}: {dict(reached[name])}"


# Negative controls: the same schedules through wrong adapters must fail.


def _positions_off_by_one(adapter):
    def wrong(**step) -> HashBatch:
        batch = adapter(**step)
        batch.positions = batch.positions + 1
        return batch

    return wrong


def _block_table_row_dropped(adapter):
    def wrong(**step) -> HashBatch:
        batch = adapter(**step)
        table = batch.block_table
        assert table is not None
        batch.block_table = torch.cat([table[1:], torch.zeros_like(table[:1])])
        return batch

    return wrong


def _padding_ignored(adapter):
    def wrong(**step) -> HashBatch:
        return adapter(**{**step, "num_reqs": None, "num_actual_tokens": None, "validate": False})

    return wrong


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("sabotage", [_positions_off_by_one, _block_table_row_dropped])
def test_control_wrong_adapter_breaks_rows(
    sabotage, engine, backend, consts, token_map, device
) -> None:
    dev = device if backend == "triton" else "cpu"
    wrong = sabotage(ENGINES[engine].real_adapter)
    sim = _replay(engine, 3, backend, consts, token_map, device=dev, steps=6, adapter=wrong)
    assert sim.row_mismatches


def test_control_sglang_padding_as_requests_corrupts_history(consts, token_map) -> None:
    """Padded requests (pool row 0, length 1) treated as real overwrite a live request's slot."""
    wrong = _padding_ignored(SglangRunner.real_adapter)
    sims = [_replay("sglang", s, "reference", consts, token_map, adapter=wrong) for s in range(6)]
    assert any(sim.cache_mismatches for sim in sims)


@pytest.mark.parametrize("adapter", ["real", "wrong"])
def test_control_vllm_padding_as_requests_breaks_rows(adapter, consts, token_map) -> None:
    """Padded requests that own padding tokens (as a uniform-decode graph pads them),
    taken as real requests, read stale block table rows: padding rows stop hashing as
    padding. The real adapter on the same schedules stays exact."""
    wrong = _padding_ignored(VllmRunner.real_adapter) if adapter == "wrong" else None
    sims = [
        _replay("vllm", s, "reference", consts, token_map, adapter=wrong, worst_padding=True)
        for s in range(3)
    ]
    if adapter == "real":
        assert not any(sim.mismatches for sim in sims), [sim.mismatches for sim in sims]
    else:
        assert any(sim.row_mismatches for sim in sims)
