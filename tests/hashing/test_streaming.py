"""Property tests: any schedule hashes exactly like one-shot hashing (SPEC §5).

Schedules are drawn from a seed by the engine simulator
(:mod:`engramrt.testing`), as vLLM runner steps through the adapter: random
prefill chunkings, requests interleaved in one batch, decode steps,
speculative drafts with rejections, prefix-cache hits on live and finished
requests, preemption and block reuse, requests prefilled elsewhere that
arrive with lookback ids only, dead spans, padding rows and padded requests,
and empty batches. Each history mode runs on the reference and the Triton
kernel (through the interpreter on CPU). Negative controls show that the
comparison catches a schedule whose history is lost.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engramrt.testing import MODES, run_schedules


@pytest.mark.parametrize("mode", MODES)
@given(seed=st.integers(0, 2**32 - 1))
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_reference_schedules_match_one_shot(seed: int, mode: str, consts, token_map) -> None:
    (engine,) = run_schedules([seed], mode, "reference", consts, token_map)
    assert not engine.mismatches, engine.mismatches


@pytest.mark.parametrize("mode", MODES)
@given(seed=st.integers(0, 2**32 - 1))
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_kernel_schedules_match_one_shot(seed: int, mode: str, consts, token_map, device) -> None:
    (engine,) = run_schedules([seed], mode, "triton", consts, token_map, max_steps=8, device=device)
    assert not engine.mismatches, engine.mismatches


# Negative controls: the same schedules with history lost must NOT match.


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_dropping_lookback_changes_ids(backend: str, consts, token_map, device) -> None:
    dev = device if backend == "triton" else "cpu"
    engines = run_schedules(  # four schedules in one batch: some step reads the lost history
        range(7, 11),
        "lookback",
        backend,
        consts,
        token_map,
        max_steps=4,
        sabotage="drop_lookback",
        device=dev,
    )
    assert any(engine.mismatches for engine in engines)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_rebinding_slot_cache_loses_history(
    backend: str, consts, token_map, device
) -> None:
    dev = device if backend == "triton" else "cpu"
    engines = run_schedules(  # four schedules in one batch: some step reads the lost history
        range(11, 15),
        "slot",
        backend,
        consts,
        token_map,
        max_steps=5,
        sabotage="rebind",
        device=dev,
    )
    assert any(engine.mismatches for engine in engines)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_resetting_request_history_loses_history(
    backend: str, consts, token_map, device
) -> None:
    dev = device if backend == "triton" else "cpu"
    engines = run_schedules(  # four schedules in one batch: some step reads the lost history
        range(5, 9),
        "request",
        backend,
        consts,
        token_map,
        max_steps=5,
        sabotage="reset",
        device=dev,
    )
    assert any(engine.mismatches for engine in engines)
