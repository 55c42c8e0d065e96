"""bench/full_size.py on the CPU: publish, attach, restart and lookups on gloo, at a tiny scale."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.spawn import torchrun_bench

from engramrt.distributed import SharedHostTable
from engramrt.errors import CapacityError
from engramrt.lookup.tiers.synthetic import synthetic_packed_rows

ROOT = Path(__file__).resolve().parents[1]
SCALE = 0.00005  # 19,200 rows per layer, 5 MiB


def _module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("full_size", ROOT / "bench" / "full_size.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["full_size"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def _torchrun(*options: str) -> subprocess.CompletedProcess:
    return torchrun_bench(
        "full_size.py",
        "--cpu",
        "--scale",
        str(SCALE),
        "--baseline-gib",
        "0.002",
        "--tokens",
        "3,17",
        "--reps",
        "1",
        "--fill-threads",
        "2",
        *options,
    )


def test_full_size_script_publishes_once_restarts_and_refuses_other_rows(tmp_path) -> None:
    shm, first, second = tmp_path / "shm", tmp_path / "first.json", tmp_path / "second.json"
    done = _torchrun("--shared-dir", str(shm), "--restart", "--keep", "--out", str(first))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads(first.read_text())
    assert report["world"] == 2 and report["failures"] == []
    tables = {t["name"]: t for t in report["tables"]}
    assert set(tables) == {
        "engramrt-fullsize-layer1",
        "engramrt-fullsize-layer14",
        "engramrt-fullsize-baseline",
    }
    assert tables["engramrt-fullsize-layer1"]["num_rows"] == round(384_006_168 * SCALE)
    # Each layer table was created by exactly one rank (rank r takes layer r first).
    created = {
        (rank["rank"], phase["table"])
        for rank in report["ranks"]
        for phase in rank["publish"] + rank["publish_baseline"]
        if phase["created"]
    }
    assert {name for _, name in created} == set(tables) and len(created) == 3
    assert {(0, "engramrt-fullsize-layer1"), (1, "engramrt-fullsize-layer14")} <= created
    for rank in report["ranks"]:
        for phase in rank["publish"]:
            keys = {"allocate_s", "fill_s", "publish_s"} if phase["created"] else {"wait_attach_s"}
            assert keys <= set(phase)
        assert set(rank["attach_s"]) == {"engramrt-fullsize-layer1", "engramrt-fullsize-layer14"}
        assert rank["ready_s"] > 0 and rank["memory_ready"]["ru_maxrss"] > 0
        restart = rank["restart"]
        assert restart["ok"] and [t["created"] for t in restart["tables"]] == [False, False]
        assert all(t["other_fingerprint_refused"] for t in restart["tables"])
        # Ready after launch: imports included, teardown not; the process took longer.
        assert 0 < restart["ready_s"] < restart["launch_to_ready_s"] < restart["process_s"]
        cases = {(r["table"], r["tier"], r["ids"], r["T"]) for r in rank["lookups"]}
        assert len(cases) == 3 * 2 * 2 and all(r["exact"] for r in rank["lookups"])
    # Outside the script: the kept file holds the synthetic rows (torch definition).
    for name, table in tables.items():
        data = np.fromfile(shm / name, dtype=np.uint8).reshape(-1, 264)
        expected = synthetic_packed_rows(torch.arange(table["num_rows"]), 256, 0).numpy()
        assert np.array_equal(data, expected), name

    # A second invocation (a restart) maps the kept tables without building them.
    done = _torchrun("--shared-dir", str(shm), "--expect-existing", "--out", str(second))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    again = json.loads(second.read_text())
    assert again["failures"] == []
    assert not any(p["created"] for rank in again["ranks"] for p in rank["publish"])
    assert sorted(p.name for p in shm.iterdir()) == []  # removed at the end (no --keep)

    # Control: without tables, --expect-existing refuses to build them.
    done = _torchrun("--shared-dir", str(shm), "--expect-existing", "--skip-lookups")
    assert done.returncode != 0 and "expected one published by an earlier run" in done.stdout


def test_restart_refuses_a_table_of_other_rows(tmp_path) -> None:
    """A kept table of another seed is refused by name, geometry and fingerprint."""
    module = _module()
    (spec,) = module.table_specs([0], SCALE, seed=0)
    (other,) = module.table_specs([0], SCALE, seed=1)
    assert spec.name == other.name and spec.fingerprint != other.fingerprint

    def load(target: torch.Tensor) -> None:
        target.copy_(synthetic_packed_rows(torch.arange(spec.num_rows), 256, 0))

    table = SharedHostTable.create_or_attach(
        spec.name, spec.num_rows, 264, load, directory=tmp_path, fingerprint=spec.fingerprint
    )
    assert module.check_sample(spec, table.rows) and not module.check_sample(other, table.rows)
    args = type("Args", (), {"shared_dir": tmp_path, "cpu": True})()
    good = module.restart([spec], args, torch.device("cpu"))
    assert good["ok"], good
    bad = module.restart([other], args, torch.device("cpu"))
    assert not bad["ok"] and "holds another table" in bad["error"]
    del table
    SharedHostTable.remove(spec.name, tmp_path)


def test_preflight_names_the_shortfall(tmp_path, monkeypatch) -> None:
    module = _module()
    specs = module.table_specs([0, 1], 1.0, seed=0)
    assert [s.num_rows for s in specs] == [384_006_168, 384_016_682]
    assert sum(s.nbytes for s in specs) == 202_758_032_400  # 188.8 GiB
    monkeypatch.setattr(module, "free_bytes", lambda directory: 64 * 2**30)
    with pytest.raises(CapacityError, match=r"need 202758032400 bytes \(188.83 GiB\).*shm-size"):
        module.preflight(tmp_path, specs)
    with pytest.raises(CapacityError, match=r"shared-dir .*missing does not exist; expected"):
        module.preflight(tmp_path / "missing", specs)
    small = module.table_specs([1], 0.001, seed=0)
    assert module.preflight(tmp_path, small)["needed_bytes"] == small[0].nbytes  # control


def test_row_ids_are_in_range_and_zipf_is_skewed() -> None:
    module = _module()
    uniform = module.row_ids(1_000_003, 4096, "uniform", seed=1)
    zipf = module.row_ids(1_000_003, 4096, "zipf", seed=1)
    for ids in (uniform, zipf):
        assert ids.shape == (4096, 24) and int(ids.min()) >= 0 and int(ids.max()) < 1_000_003
    top = lambda ids: torch.unique(ids, return_counts=True)[1].max()  # noqa: E731
    assert int(top(zipf)) > 100 > int(top(uniform))


def test_runtime_phase_pairs_each_block_with_the_reference_of_its_round() -> None:
    """A machine whose speed drifts between rounds: the paired loss of a placement 2% slower
    than the reference is 2% every round, and the A/A control is 0; unpaired medians of the
    same timings would not show it. Negative control: a missing reference is refused."""
    module = _module()
    clock = [0]  # blocks timed so far: the machine slows down as it runs
    costs = {"none": 1.0, "none-again": 1.0, "host": 1.0 / 0.98}

    def block(placement):
        def run(round_index: int) -> float:
            clock[0] += 1
            return 5.0 * (1 + 0.3 * round_index) * costs[placement]  # 30% drift a round

        return run

    blocks = {(p, "decode", False): block(p) for p in costs}
    results = {r["placement"]: r for r in module.paired_rounds(blocks, rounds=5, seed=3)}
    assert clock[0] == 15  # every block once a round
    assert results["host"]["loss_pct"] == pytest.approx(2.0)
    assert all(v == pytest.approx(2.0) for v in results["host"]["loss_pct_rounds"])
    assert results["none-again"]["loss_pct"] == pytest.approx(0.0)
    spread = results["host"]["ms_per_step_p75"] - results["host"]["ms_per_step_p25"]
    assert spread > 0.1 * results["host"]["ms_per_step"]  # the drift the pairing removes
    with pytest.raises(ValueError, match="no 'none-again' block"):
        module.paired_rounds({k: v for k, v in blocks.items() if k[0] != "none-again"}, 1, 0)


def test_summary_prints_the_paired_runtime_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary reads the runtime phase's rows as paired_rounds writes them."""
    module = _module()
    blocks = {(p, "decode", False): (lambda r: 5.0) for p in ("none", "none-again", "host")}
    rows = module.paired_rounds(blocks, rounds=2, seed=0)
    module.print_summary({"ranks": [{"rank": 0, "runtime": rows}], "failures": []})
    lines = [line for line in capsys.readouterr().out.splitlines() if "runtime host" in line]
    assert len(lines) == 1 and "loss   0.00% [0.00, 0.00] over 2 rounds" in lines[0], lines


def test_summary_prints_each_rounds_stalls(capsys: pytest.CaptureFixture[str]) -> None:
    """A runtime row with its rounds' stalls prints their median per layer; one without
    prints none."""
    module = _module()
    blocks = {(p, "decode", False): (lambda r: 5.0) for p in ("none", "none-again", "host")}
    rows = module.paired_rounds(blocks, rounds=3, seed=0)
    host = next(r for r in rows if r["placement"] == "host")
    host["stall_us_rounds"] = [[1.0, 20.0], [7.0, 2.0], [3.0, 29.0]]
    module.print_summary({"ranks": [{"rank": 0, "runtime": rows}], "failures": []})
    out = capsys.readouterr().out.splitlines()
    assert next(line for line in out if "runtime host" in line).endswith(", stall us 3/20")
    assert "stall" not in next(line for line in out if "runtime none-again" in line)
