"""Property tests: any schedule hashes exactly like one-shot hashing (SPEC §5).

Schedules are generated from a seed: random prefill chunkings, requests
interleaved in one batch, decode steps, speculative drafts with rejections,
prefix-cache hits that borrow blocks, requests prefilled elsewhere that
arrive with lookback ids only, dead spans, padding rows and padded requests,
and empty batches. Each history mode runs on the reference and the Triton
kernel (through the interpreter on CPU). Negative controls show that the
comparison catches a schedule whose history is lost.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.hashing.engine_sim import BLOCK_SIZE, Engine

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants, NgramHasher

MODES = ("lookback", "slot", "request")


@pytest.fixture(scope="module")
def consts(token_map) -> HashConstants:
    return HashConstants.from_config(PRESETS["tiny"], token_map)


def _run_schedule(
    seed: int,
    mode: str,
    backend: str,
    consts,
    token_map,
    *,
    max_steps: int = 12,
    device="cpu",
    drop_lookback: bool = False,
    sabotage: str | None = None,
) -> Engine:
    rng = np.random.default_rng(seed)
    hasher = NgramHasher(consts, token_map, device, backend=backend, check_ids=True)
    engine = Engine(
        rng, consts, token_map.map, hasher, mode, drop_lookback=drop_lookback, device=device
    )
    dead_rate = float(rng.choice([0.0, 0.0, 0.15]))
    first = engine.new_request(int(rng.integers(9, 24)), dead_rate)
    active = [first]
    # The first step prefills part of the first request, so later steps need history.
    engine.step(
        [(first, int(rng.integers(1, 6)))], pad_rows=int(rng.integers(0, 3)), pad_requests=0
    )
    spawned_prefix = spawned_remote = False
    for _ in range(max_steps):
        if not spawned_prefix and first.computed >= BLOCK_SIZE and rng.random() < 0.5:
            active.append(
                engine.new_request(
                    int(rng.integers(first.computed + 1, 30)), dead_rate, prefix_of=first
                )
            )
            spawned_prefix = True
        if not spawned_remote and rng.random() < 0.3:
            active.append(
                engine.new_request(
                    int(rng.integers(6, 20)), dead_rate, remote_prefix=int(rng.integers(1, 6))
                )
            )
            spawned_remote = True
        if rng.random() < 0.2:
            active.append(engine.new_request(int(rng.integers(1, 12)), dead_rate))
        live = [r for r in active if r.computed < len(r.tokens)]
        if not live:
            break
        order = rng.permutation(len(live))
        chunks, specs = [], []
        for idx in order[: int(rng.integers(1, len(live) + 1))]:
            req = live[idx]
            remaining = len(req.tokens) - req.computed
            if remaining >= 2 and rng.random() < 0.3:
                drafts = int(rng.integers(1, min(4, remaining)))
                start, count = engine.speculate(req, drafts)
                chunks.append((req, count))
                specs.append((req, start, drafts))
            else:
                chunks.append((req, int(rng.integers(1, min(remaining, 7) + 1))))
        if sabotage == "rebind" and engine.steps == 2:
            engine.cache.bind(engine.cache.num_slots, BLOCK_SIZE)
        if sabotage == "reset" and engine.steps == 2:
            for req in active:
                engine.history.reset(req.slot)
        engine.step(chunks, pad_rows=int(rng.integers(0, 3)), pad_requests=int(rng.integers(0, 2)))
        for req, start, drafts in specs:
            engine.verify(req, start, int(rng.integers(0, drafts + 1)))
    engine.step([], pad_rows=0, pad_requests=0)  # an empty batch
    return engine


@pytest.mark.parametrize("mode", MODES)
@given(seed=st.integers(0, 2**32 - 1))
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_reference_schedules_match_one_shot(seed: int, mode: str, consts, token_map) -> None:
    engine = _run_schedule(seed, mode, "reference", consts, token_map)
    assert not engine.mismatches, engine.mismatches


@pytest.mark.parametrize("mode", MODES)
@given(seed=st.integers(0, 2**32 - 1))
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_kernel_schedules_match_one_shot(seed: int, mode: str, consts, token_map, device) -> None:
    engine = _run_schedule(seed, mode, "triton", consts, token_map, max_steps=8, device=device)
    assert not engine.mismatches, engine.mismatches


# Negative controls: the same schedules with history lost must NOT match.


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_dropping_lookback_changes_ids(backend: str, consts, token_map, device) -> None:
    dev = device if backend == "triton" else "cpu"
    engine = _run_schedule(
        7, "lookback", backend, consts, token_map, max_steps=4, drop_lookback=True, device=dev
    )
    assert engine.mismatches


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_rebinding_slot_cache_loses_history(
    backend: str, consts, token_map, device
) -> None:
    dev = device if backend == "triton" else "cpu"
    engine = _run_schedule(
        11, "slot", backend, consts, token_map, max_steps=5, sabotage="rebind", device=dev
    )
    assert engine.mismatches


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_resetting_request_history_loses_history(
    backend: str, consts, token_map, device
) -> None:
    dev = device if backend == "triton" else "cpu"
    engine = _run_schedule(
        5, "request", backend, consts, token_map, max_steps=5, sabotage="reset", device=dev
    )
    assert engine.mismatches
