from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants, hash_sequence

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_loop_example_runs_clean(capsys, device) -> None:
    engine_loop = _load("engine_loop")
    assert engine_loop.main(["--device", str(device), "--requests", "4", "--steps", "25"]) == 0
    out = capsys.readouterr().out
    assert "0 mismatches" in out and "request-steps checked" in out


def _record_steps(monkeypatch) -> list:
    """Every batch the example hands the runtime, with the row ids the runtime returned."""
    from engramrt.runtime import EngramRuntime

    steps: list = []

    def spy(real):
        def call(self, batch, **kwargs):
            handle = real(self, batch, **kwargs)
            steps.append(
                (
                    batch.input_ids.cpu().numpy().copy(),
                    batch.positions.cpu().numpy().copy(),
                    batch.query_start_loc.cpu().numpy().copy(),
                    batch.block_table.cpu().numpy()[:, 0].copy(),  # first block: the request
                    handle.row_ids.to(torch.int64).cpu().numpy().copy(),
                )
            )
            return handle

        return call

    for name in ("plan", "prefetch"):  # the first step, then one prefetch per step
        monkeypatch.setattr(EngramRuntime, name, spy(getattr(EngramRuntime, name)))
    return steps


def _independent_mismatches(steps, token_map) -> int:
    """Rebuild each request's sequence from the batches and hash it in one shot here."""
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    sequences: dict[int, list[int]] = {}
    bad = 0
    for ids, positions, qsl, keys, row_ids in steps:
        for r in range(len(qsl) - 1):
            begin, end = int(qsl[r]), int(qsl[r + 1])
            if begin == end:
                continue
            seq = sequences.setdefault(int(keys[r]), [])
            start = int(positions[begin])
            del seq[start:]
            seq.extend(int(t) for t in ids[begin:end])
            want = hash_sequence(token_map.map[np.array(seq)], consts)[start:]
            bad += int(not np.array_equal(row_ids[begin:end], want))
    return bad


def test_engine_loop_rows_match_one_shot_hashing_done_here(capsys, monkeypatch, token_map) -> None:
    steps = _record_steps(monkeypatch)
    engine_loop = _load("engine_loop")
    assert engine_loop.main(["--device", "cpu", "--requests", "3", "--steps", "12"]) == 0
    assert len(steps) >= 10 and _independent_mismatches(steps, token_map) == 0


def test_control_wrong_rows_fail_the_independent_check(capsys, monkeypatch, token_map) -> None:
    steps = _record_steps(monkeypatch)
    engine_loop = _load("engine_loop")
    engine_loop.main(["--device", "cpu", "--requests", "3", "--steps", "12"])
    steps[3][4][0, 0, 0] += 1  # one row id of one step, wrong
    assert _independent_mismatches(steps, token_map) == 1
