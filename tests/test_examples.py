from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
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
    assert engine_loop.main(["--device", str(device), "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "8 steps" in out and "0 mismatches" in out


def _record_steps(monkeypatch) -> list:
    """Every batch the example plans (what the adapter returned), with the row ids."""
    from engramrt.runtime import EngramRuntime

    steps: list = []

    def spy(real):
        def call(self, batch, **kwargs):
            plan = real(self, batch, **kwargs)
            host = {
                k: (v.cpu().numpy().copy() if v is not None else None)
                for k, v in vars(batch).items()
            }
            steps.append((host, plan.row_ids.to(torch.int64).cpu().numpy().copy()))
            return plan

        return call

    for name in ("plan", "prefetch"):  # the first step, then one prefetch per step
        monkeypatch.setattr(EngramRuntime, name, spy(getattr(EngramRuntime, name)))
    return steps


def _independent_mismatches(steps, token_map, block_size: int) -> int:
    """Rebuild each request's sequence from the batches alone and hash it in one shot here.

    Tokens are remembered by KV slot, as the batches wrote them (``slot_mapping``); a
    chunk's earlier positions are read back through its block table row. Padding
    rows (past ``query_start_loc[-1]``) hash as a lone token.
    """
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    tokens: dict[int, tuple[int, bool]] = {}  # slot -> (tokenizer id, dead)
    bad = 0
    for batch, row_ids in steps:
        ids, pos, qsl = batch["input_ids"], batch["positions"], batch["query_start_loc"]
        dead = batch["dead_mask"] if batch["dead_mask"] is not None else np.zeros(len(ids), bool)
        table, slots = batch["block_table"], batch["slot_mapping"]
        for r in range(len(qsl) - 1):
            begin, end = int(qsl[r]), int(qsl[r + 1])
            if begin == end:
                continue
            start = int(pos[begin])
            earlier = [
                tokens[int(table[r, p // block_size]) * block_size + p % block_size]
                for p in range(start)
            ]
            seq = [t for t, _ in earlier] + ids[begin:end].tolist()
            seq_dead = [d for _, d in earlier] + dead[begin:end].tolist()
            want = hash_sequence(token_map.map[np.array(seq)], consts, np.array(seq_dead))
            bad += int(not np.array_equal(row_ids[begin:end], want[start:]))
        for i in range(int(qsl[-1])):
            tokens[int(slots[i])] = (int(ids[i]), bool(dead[i]))
        for i in range(int(qsl[-1]), len(ids)):
            lone = hash_sequence(token_map.map[np.array([ids[i]])], consts)
            bad += int(not np.array_equal(row_ids[i : i + 1], lone))
    return bad


@pytest.fixture(scope="module")
def recorded() -> tuple[list, int]:
    """One run of the example on the CPU, every planned batch recorded."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        steps = _record_steps(monkeypatch)
        engine_loop = _load("engine_loop")
        assert engine_loop.main(["--device", "cpu", "--steps", "8"]) == 0
    return steps, engine_loop.BLOCK


def test_engine_loop_rows_match_one_shot_hashing_done_here(recorded, token_map) -> None:
    steps, block_size = recorded
    assert len(steps) == 8
    assert _independent_mismatches(steps, token_map, block_size) == 0


def test_control_wrong_rows_fail_the_independent_check(recorded, token_map) -> None:
    steps, block_size = recorded
    wrong = [(batch, row_ids.copy()) for batch, row_ids in steps]
    wrong[3][1][0, 0, 0] += 1  # one row id of one step, wrong
    assert _independent_mismatches(wrong, token_map, block_size) == 1


def test_control_the_example_fails_on_a_wrong_row(capsys, monkeypatch) -> None:
    """The example's own check: one bit of every row flipped in the table it reads (not in
    its copy) makes it exit 1."""
    engine_loop = _load("engine_loop")
    real = engine_loop.synthetic_runtime

    def corrupted(*args, **kwargs):
        runtime = real(*args, **kwargs)
        store = runtime.sources[0]
        packed = store.gather_packed(torch.arange(store.num_rows))
        original = packed.clone()
        packed[:, 0] ^= 1
        store.write_rows(0, packed)
        store.gather_packed = lambda ids: original[ids]  # the example's copy stays right
        return runtime

    monkeypatch.setattr(engine_loop, "synthetic_runtime", corrupted)
    assert engine_loop.main(["--device", "cpu", "--steps", "3"]) == 1
    assert "3 mismatches" in capsys.readouterr().out
