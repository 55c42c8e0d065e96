"""The soak: a bounded slice in CI, its CLI, and a negative control with a planted bug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants, SlotHashCache
from engramrt.hashing.engine_sim import MODES, run_schedule
from engramrt.hashing.soak import main, soak

ROOT = Path(__file__).resolve().parents[2]


def test_soak_slice_has_no_mismatch() -> None:
    result = soak(300, seed=1000, kernel=2)
    assert result.schedules == 300
    assert not result.mismatches, [str(m) for m in result.mismatches[:3]]


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


@pytest.mark.parametrize("mode", MODES)
def test_prefix_request_after_long_accepted_drafts(mode: str, token_map) -> None:
    """Seed 2001185 takes the first request past 29 tokens before a prefix hit (a bounded draw once raised)."""
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    engine = run_schedule(2001185, mode, "reference", consts, token_map)
    assert not engine.mismatches, engine.mismatches
    assert engine.steps > 2


def test_schedule_draws_stay_in_range(token_map) -> None:
    """Every seed in a band draws valid ranges (numpy raises ValueError on low >= high), and
    long schedules stop adding requests before history slots or KV blocks run out."""
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    for seed in np.random.default_rng(0).integers(0, 2**32 - 1, 40).tolist():
        run_schedule(int(seed), "lookback", "reference", consts, token_map, max_steps=20)
    for seed in (1, 2):
        engine = run_schedule(seed, "request", "reference", consts, token_map, max_steps=150)
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
    bad = subprocess.run(
        [str(ROOT / "scripts" / "soak"), "-3"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2
