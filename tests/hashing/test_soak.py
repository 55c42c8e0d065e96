"""The soak: a bounded slice in CI, its CLI, and a negative control with a planted bug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants, SlotHashCache, hash_sequence
from engramrt.hashing.soak import main, soak
from engramrt.testing import MODES, one_shot_rows, run_schedules

ROOT = Path(__file__).resolve().parents[2]


def test_soak_slice_has_no_mismatch() -> None:
    result = soak(300, seed=1000, kernel=2)
    assert result.schedules == 300
    assert not result.mismatches, [str(m) for m in result.mismatches[:3]]


def test_one_shot_rows_equal_hash_sequence(token_map) -> None:
    """The vectorised one-shot rows the soak compares with are bit-equal to the reference's."""
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    rng = np.random.default_rng(4)
    sequences, want = [], []
    for length in (1, 2, 3, 5, 17, 40):
        ids = token_map.map[rng.integers(0, token_map.map.shape[0], length)]
        dead = rng.random(length) < 0.2
        start = int(rng.integers(0, length))
        end = int(rng.integers(start, length + 1))  # end == start: no rows
        sequences.append((ids, dead, start, end))
        want.append(hash_sequence(ids[:end], consts, dead[:end])[start:end])
    got = one_shot_rows(sequences, consts)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.concatenate(want))
    assert one_shot_rows([], consts).shape == (0, consts.n_layers, consts.n_cols)
    # Negative control: a dead token the reference sees changes the rows.
    ids = token_map.map[rng.integers(0, token_map.map.shape[0], 10)]
    alive = np.zeros(10, dtype=bool)
    one_dead = alive.copy()
    one_dead[5] = True
    assert not np.array_equal(
        one_shot_rows([(ids, one_dead, 0, 10)], consts), hash_sequence(ids, consts, alive)
    )


@pytest.mark.parametrize("mode", MODES)
def test_schedules_run_together_as_alone(mode: str, token_map) -> None:
    """A group draws every schedule's steps exactly as each alone, and none mismatches."""
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    seeds = [11, 12, 13, 14, 15]
    together = run_schedules(seeds, mode, "reference", consts, token_map)
    for seed, engine in zip(seeds, together, strict=True):
        (alone,) = run_schedules([seed], mode, "reference", consts, token_map)
        assert engine.steps == alone.steps > 2
        assert engine.mismatches == alone.mismatches == []


def _forget_position(monkeypatch: pytest.MonkeyPatch, position: int) -> None:
    """Plant a bug that hits each schedule alike, alone or grouped: the slot cache's
    history update forgets every token at ``position``."""
    original = SlotHashCache.commit_reference

    def commit_forgetting(self, batch, token_map):
        if batch.slot_mapping is not None:
            batch.slot_mapping = batch.slot_mapping.clone()
            batch.slot_mapping[batch.positions == position] = -1
        original(self, batch, token_map)

    monkeypatch.setattr(SlotHashCache, "commit_reference", commit_forgetting)


def test_control_grouped_verdicts_replay_alone(monkeypatch) -> None:
    """With a planted bug, each schedule's verdict in a group of 8 is its verdict alone
    (``--seed S --count 1``), and some but not all schedules fail."""
    _forget_position(monkeypatch, 5)
    grouped = soak(16, seed=40, modes=["slot"], width=8)
    failing = {m.seed for m in grouped.mismatches}
    assert 0 < len(failing) < 16, failing
    assert all(m.mode == "slot" and m.backend == "reference" for m in grouped.mismatches)
    for seed in range(40, 56):
        alone = soak(1, seed=seed, modes=["slot"])
        assert bool(alone.mismatches) == (seed in failing), seed
        if alone.mismatches:
            detail = next(m.detail for m in grouped.mismatches if m.seed == seed)
            assert alone.mismatches[0].detail == detail


def _drop_last_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a bug: the slot cache's history update forgets each batch's last token."""
    original = SlotHashCache.commit_reference

    def commit_dropping_one(self, batch, token_map):
        owned = int(batch.query_start_loc[-1])
        if owned and batch.slot_mapping is not None:
            batch.slot_mapping = batch.slot_mapping.clone()
            batch.slot_mapping[owned - 1] = -1
        original(self, batch, token_map)

    monkeypatch.setattr(SlotHashCache, "commit_reference", commit_dropping_one)


def test_control_soak_reports_a_planted_history_bug(monkeypatch, capsys) -> None:
    _drop_last_token(monkeypatch)
    result = soak(20, seed=3, modes=["slot"])
    assert result.mismatches
    first = result.mismatches[0]
    assert first.mode == "slot" and first.backend == "reference"
    assert first.detail.startswith("step ")
    # The script's exit code and last line say so too, with the seed to replay.
    assert main(["20", "--seed", "3", "--modes", "slot"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].endswith("mismatches") and not out[-1].endswith(" 0 mismatches")
    assert f"seed {first.seed}, mode slot" in out[0]


def test_schedule_draws_stay_in_range(token_map) -> None:
    """Every seed in a band draws valid ranges (numpy raises ValueError on low >= high), and
    long schedules stop adding requests before history slots or KV blocks run out."""
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    for seed in np.random.default_rng(0).integers(0, 2**32 - 1, 40).tolist():
        run_schedules([int(seed)], "lookback", "reference", consts, token_map, max_steps=20)
    for seed in (1, 2):
        (engine,) = run_schedules([seed], "request", "reference", consts, token_map, max_steps=150)
        assert not engine.mismatches and engine.steps > 2


def test_soak_script_runs_the_installed_package(tmp_path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [str(ROOT / "scripts" / "soak"), "5", "--seed", "9"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "5 schedules, 0 mismatches"
    for args in (["-3"], ["4", "--width", "0"]):
        bad = subprocess.run(
            [str(ROOT / "scripts" / "soak"), *args], capture_output=True, text=True, env=env
        )
        assert bad.returncode == 2, args
