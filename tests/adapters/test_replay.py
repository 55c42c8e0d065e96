"""Engine replays: simulated vLLM and SGLang engines through the adapters (SPEC §5).

The simulator (:mod:`engramrt.testing`) runs random schedules: chunked
prefill with requests interleaved, decode, speculative drafts with
rejection, prefix-cache hits (on live and finished requests), preemption,
CUDA-graph padding of tokens and requests, requests finishing and their
blocks reused, requests prefilled elsewhere. Every step goes through the
engine's adapter into a hasher, or into ``runtime.plan`` / ``runtime.run``;
its row ids are compared bit for bit with one-shot hashing of each full
sequence, the slot cache with the tokens each live request owns and,
through a runtime, every layer's rows with the reference lookup of a copy of
the table taken before the replay. Negative controls run the same schedules
through a wrong adapter, a skipped rollback and a corrupted row, and must fail.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engramrt.adapters import from_vllm_step
from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher
from engramrt.testing import ENGINES, Replay, sglang_adapter
from engramrt.testing.model import synthetic_runtime

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def consts(token_map) -> HashConstants:
    return HashConstants.from_config(CFG, token_map)


def _replay(engine, seed, consts, token_map, *, backend="reference", device="cpu", steps=12, **kw):
    hasher = NgramHasher(consts, token_map, device, backend=backend, validate=True, check_ids=True)
    assert hasher.backend == backend
    return Replay([seed], consts, token_map, engine=engine, hasher=hasher, device=device, **kw).run(
        steps
    )


def _through_runtime(engine, seed, consts, token_map, *, steps=6, **kw):
    """A replay through ``plan`` / ``run`` of a runtime over random device-tier tables."""
    hasher = NgramHasher(consts, token_map, "cpu", check_ids=True)

    def runtime(history):
        return synthetic_runtime(
            CFG, hasher, history, max_tokens=64, max_requests=8, head_backend="reference"
        )

    return Replay([seed], consts, token_map, engine=engine, runtime=runtime, **kw).run(steps)


def _mismatches(replay: Replay) -> list[str]:
    return [m for s in replay.schedules for m in s.mismatches]


_FAST = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 3, 4, 16]),
    pad_slot_id=st.sampled_from([-1, 0]),
    mode=st.sampled_from(["slot", "lookback", "request"]),
)
@settings(max_examples=100, **_FAST)
def test_vllm_replays_match_one_shot(seed, block_size, pad_slot_id, mode, consts, token_map):
    replay = _replay(
        "vllm", seed, consts, token_map, mode=mode, block_size=block_size, pad_slot_id=pad_slot_id
    )
    assert not _mismatches(replay)


@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["slot", "lookback"]))
@settings(max_examples=100, **_FAST)
def test_sglang_replays_match_one_shot(seed, mode, consts, token_map) -> None:
    assert not _mismatches(_replay("sglang", seed, consts, token_map, mode=mode))


@pytest.mark.parametrize("engine", ENGINES)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 4, 16]))
@settings(max_examples=10, **_FAST)
def test_kernel_replays_match_one_shot(engine, seed, block_size, consts, token_map, device):
    replay = _replay(
        engine, seed, consts, token_map, backend="triton", device=device, steps=16,
        block_size=block_size,
    )  # fmt: skip
    assert not _mismatches(replay)


@pytest.mark.parametrize("engine", ENGINES)
@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=4, **_FAST)
def test_runtime_replays_match_ids_and_rows(engine, seed, consts, token_map) -> None:
    """adapters -> plan -> run: ids, the slot cache and every layer's rows."""
    replay = _through_runtime(engine, seed, consts, token_map)
    assert not _mismatches(replay)
    assert replay.runtime.pending_steps == 0  # every layer ran once per step


def test_schedules_reach_every_engine_state(consts, token_map) -> None:
    """The replays above would prove little if the schedules never reached these states."""
    reached: dict[str, Counter[str]] = {name: Counter() for name in ENGINES}
    for name in ENGINES:
        for seed in range(8):
            replay = _replay(name, seed, consts, token_map, steps=16)
            assert not _mismatches(replay)
            reached[name].update(replay.schedules[0].events)
    common = [
        "drafts rejected",
        "padded tokens",
        "padded requests",
        "prefix hit",
        "prefix hit on a finished request",
        "whole prompt hit",
        "requests in one step",
        "block reused",
        "preempted",
        "prefill ran elsewhere",
    ]
    wanted = {
        "vllm": [*common, "mixed step"],
        "sglang": [*common, "extend step", "decode step", "verify step"],
    }
    for name, states in wanted.items():
        missing = [s for s in states if reached[name][s] == 0]
        assert not missing, f"{name} schedules never reached {missing}: {dict(reached[name])}"


# Negative controls: the same schedules with one thing wrong must fail.


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


def _padding_ignored(adapter, counts=("num_reqs", "num_actual_tokens")):
    def wrong(**step) -> HashBatch:
        return adapter(**{**step, **dict.fromkeys(counts), "validate": False})

    return wrong


def _real_adapter(engine: str, consts):
    return from_vllm_step if engine == "vllm" else sglang_adapter(consts)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sabotage", [_positions_off_by_one, _block_table_row_dropped])
def test_control_wrong_adapter_breaks_rows(sabotage, engine, backend, consts, token_map, device):
    dev = device if backend == "triton" else "cpu"
    wrong = sabotage(_real_adapter(engine, consts))
    replay = _replay(
        engine, 3, consts, token_map, backend=backend, device=dev, steps=6, adapter=wrong
    )
    assert _mismatches(replay)  # rows, the slot cache or the hasher's validation


def test_control_sglang_padding_as_requests_corrupts_history(consts, token_map) -> None:
    """Padded requests (pool row 0, length 1) treated as real overwrite a live request's slot."""
    wrong = _padding_ignored(_real_adapter("sglang", consts))
    replays = [_replay("sglang", s, consts, token_map, adapter=wrong) for s in range(6)]
    assert any(" holds " in m for r in replays for m in _mismatches(r))


@pytest.mark.parametrize("adapter", ["real", "wrong"])
def test_control_vllm_padding_as_requests_breaks_rows(adapter, consts, token_map) -> None:
    """Padded requests that own padding tokens (as a uniform-decode graph pads them),
    taken as real requests, read stale block table rows: padding rows stop hashing as
    padding. The real adapter on the same schedules stays exact."""
    counts = ("num_reqs_unpadded", "num_tokens_unpadded")
    wrong = _padding_ignored(from_vllm_step, counts) if adapter == "wrong" else None
    replays = [
        _replay("vllm", s, consts, token_map, adapter=wrong, worst_padding=True) for s in range(3)
    ]
    found = [m for r in replays for m in _mismatches(r)]
    assert (not found) if adapter == "real" else found


@pytest.mark.parametrize("engine", ENGINES)
def test_control_skipped_rollback_breaks_rows(engine, consts, token_map) -> None:
    """An engine that keeps rejected drafts' KV slots as if accepted hashes later tokens
    against the drafts."""
    replays = [
        _replay(engine, s, consts, token_map, steps=16, sabotage="skip_rollback") for s in range(4)
    ]
    assert any(_mismatches(r) for r in replays)
    rejected = sum(r.schedules[0].events["drafts rejected"] for r in replays)
    assert rejected > 0


def test_control_a_corrupted_row_is_caught(consts, token_map) -> None:
    """One bit flipped in every row of layer 1's table after the replay copied it: ids
    still match, rows do not."""
    hasher = NgramHasher(consts, token_map, "cpu", check_ids=True)

    def runtime(history):
        rt = synthetic_runtime(
            CFG, hasher, history, max_tokens=64, max_requests=8, head_backend="reference"
        )
        return rt

    replay = Replay([5], consts, token_map, runtime=runtime)
    store = replay.runtime.sources[1]
    every = torch.arange(store.num_rows)
    packed = store.gather_packed(every).clone()
    packed[:, 0] ^= 1
    store.write_rows(0, packed)
    found = _mismatches(replay.run(2))
    assert found and all("rows of layer 1 differ" in m for m in found), found
