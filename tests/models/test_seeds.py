"""The seeds runner (every comparison over seeds, with its spread) and the Engram gate split
by whether the n-grams were seen in training."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engramrt.errors import CheckpointError, ValidationError
from engramrt_lab.models import seeds as seeds_mod
from engramrt_lab.models.wins import category_losses, gate_column

from .conftest import TRAIN_ARGS

# The aggregate is numpy's float64 mean/std; the test's are Python's statistics module
# (exact rational arithmetic, rounded once): on a few values near 2, they agree to a few
# ulps of 2, far inside 1e-12.
TOL = 1e-12


def _record(rng: np.random.Generator, package: bool = True) -> dict[str, Any]:
    """A synthetic ``--results`` record with the fields :func:`aggregate` reads."""

    def losses() -> dict[str, float]:
        return {m: float(rng.uniform(1.5, 2.5)) for m in ("engram", "baseline", "baseline_wide")}

    row = {"predictions": int(rng.integers(10, 20)), "share": 0.5, **losses()}
    row[gate_column("engram", 1)] = float(rng.uniform(0, 1))
    return {
        "steps": {"steps": 4, "schedule_steps": 4},
        "heldout": {"losses": losses()},
        "package_heldout": {"losses": losses()} if package else None,
        "memory_sweep": [
            {"name": "engram", "multiple_of_tiny_buckets": 8.0, "buckets_per_head": [1, 2, 3]},
            {"name": "engram_x1", "multiple_of_tiny_buckets": 1.0, "buckets_per_head": [4, 5, 6]},
        ],
        "where_it_wins": {"context": {"context unseen": row}},
    }


def _check_against_statistics(summary: dict[str, Any], records: dict[int, Any]) -> None:
    """Every held-out mean, std, min and max of ``summary`` equals the one computed here
    from the per-seed records."""
    order = sorted(records)
    assert summary["seeds"] == len(order) and summary["seed_values"] == order
    for split in ("heldout", "package_heldout"):
        for model, mean in summary["heldout_loss"][split].items():
            values = [records[s][split]["losses"][model] for s in order]
            got = summary["heldout_spread"][split][model]
            assert abs(mean - statistics.fmean(values)) < TOL, (split, model)
            assert abs(got["std"] - statistics.stdev(values)) < TOL, (split, model)
            assert got["min"] == min(values) and got["max"] == max(values)
            assert got["per_seed"] == values
        assert set(summary["heldout_loss"][split]) == set(records[order[0]][split]["losses"])


def test_aggregate_equals_independent_mean_and_sample_std() -> None:
    rng = np.random.default_rng(3)
    records = {seed: _record(rng) for seed in (5, 1, 9)}
    for record in records.values():
        for point in record["memory_sweep"]:
            point["losses"] = {"heldout": float(rng.uniform(2, 3)), "package_heldout": 1.0}
    summary = seeds_mod.aggregate(records)
    _check_against_statistics(summary, records)
    assert list(summary["sweep"]) == ["1", "8"]  # by table size, not the records' order
    values = [next(p for p in records[s]["memory_sweep"] if p["name"] == "engram_x1")
              ["losses"]["heldout"] for s in (1, 5, 9)]  # fmt: skip
    got = summary["sweep"]["1"]["heldout"]
    assert abs(got["mean"] - statistics.fmean(values)) < TOL
    assert abs(got["std"] - statistics.stdev(values)) < TOL
    assert summary["sweep"]["1"]["package_heldout"]["std"] == 0.0  # the same value each seed
    column = gate_column("engram", 1)
    gates = [records[s]["where_it_wins"]["context"]["context unseen"][column] for s in (1, 5, 9)]
    cell = summary["unseen"]["context"]["context unseen"]
    assert abs(cell[column]["mean"] - statistics.fmean(gates)) < TOL
    # Negative control: the population std (ddof = 0) is not what is reported.
    assert abs(cell[column]["std"] - statistics.pstdev(gates)) > 1e-6
    assert "ddof = 1" in summary["spread"]
    text = seeds_mod.markdown(summary)
    assert "± " in text and "x1" in text and "context unseen" in text
    assert summary["unseen_package"] == {} and "(package held-out)" not in text


def test_aggregate_splits_each_held_out_set_on_its_own() -> None:
    """A record's package split (``where_it_wins_package``) is aggregated beside the
    stdlib one, from its own values, and merged runs keep both."""
    rng = np.random.default_rng(7)
    records = {seed: _record(rng) for seed in (0, 1, 2)}
    column = gate_column("engram", 1)
    for record in records.values():
        row = dict(record["where_it_wins"]["context"]["context unseen"])
        row[column] = float(rng.uniform(0, 1))
        record["where_it_wins_package"] = {"context": {"context unseen": row}}
    summary = seeds_mod.aggregate(records)
    for field, key in (("unseen", "where_it_wins"), ("unseen_package", "where_it_wins_package")):
        gates = [records[s][key]["context"]["context unseen"][column] for s in (0, 1, 2)]
        got = summary[field]["context"]["context unseen"][column]
        assert got["per_seed"] == gates
    # Negative control: the two sets' gates differ, so neither field copies the other.
    assert (summary["unseen"]["context"]["context unseen"][column]["per_seed"]
            != summary["unseen_package"]["context"]["context unseen"][column]["per_seed"])  # fmt: skip
    text = seeds_mod.markdown(summary)
    assert "where it wins, context (stdlib held-out):" in text
    assert "where it wins, context (package held-out):" in text
    # Two runs of one seed (each model in one of them) merge both splits.
    first, second = dict(records[0]), dict(records[0])
    first["models"], second["models"] = {"engram": {}}, {"baseline": {}}
    second["memory_sweep"] = []
    first["command"] = second["command"] = "python -m engramrt_lab.models.train --seed 0"
    merged = seeds_mod.merge_records([first, second])
    assert merged["where_it_wins_package"] == records[0]["where_it_wins_package"]
    second["where_it_wins_package"] = {"context": {"context unseen": {**row, column: -1.0}}}
    with pytest.raises(ValueError, match=r"package held-out.*expected the same predictions"):
        seeds_mod.merge_records([first, second])


def test_the_seen_view_weighs_the_unseen_categories_by_their_predictions() -> None:
    """The aggregate's ``seen`` view: "4-gram seen" as the record has it, "4-gram unseen"
    every other ``longest_seen`` category, each column their prediction-weighted mean
    (an empty category left out), over seeds like any category; a record without
    ``longest_seen`` gets no such view."""
    column = gate_column("engram", 3)
    sizes = {"4-gram seen": 50, "3-gram seen, 4-gram not": 30, "2-gram seen, 3-gram not": 10,
             "bigram unseen": 0}  # fmt: skip
    records: dict[int, Any] = {}
    rng = np.random.default_rng(11)
    for seed in (0, 1, 2):
        record = _record(rng)
        view = {}
        for name, n in sizes.items():
            row: dict[str, Any] = {"predictions": n, "share": n / 90}
            for key in ("engram", "baseline", column):
                row[key] = float(rng.uniform(1, 3)) if n else None
            view[name] = row
        record["where_it_wins"]["longest_seen"] = view
        records[seed] = record
    summary = seeds_mod.aggregate(records)
    assert next(iter(summary["unseen"])) == "seen"
    seen = summary["unseen"]["seen"]
    for key in ("engram", "baseline", column):
        per_seed = []
        for seed in (0, 1, 2):
            view = records[seed]["where_it_wins"]["longest_seen"]
            per_seed.append((30 * view["3-gram seen, 4-gram not"][key]
                             + 10 * view["2-gram seen, 3-gram not"][key]) / 40)  # fmt: skip
            # Negative control: the categories' plain mean is not it.
            plain = (
                view["3-gram seen, 4-gram not"][key] + view["2-gram seen, 3-gram not"][key]
            ) / 2
            assert abs(per_seed[-1] - plain) > 1e-9
        got = seen["4-gram unseen"][key]
        assert got["per_seed"] == pytest.approx(per_seed, abs=TOL)
        assert abs(got["mean"] - statistics.fmean(per_seed)) < TOL
        assert seen["4-gram seen"][key]["per_seed"] == [
            records[s]["where_it_wins"]["longest_seen"]["4-gram seen"][key] for s in (0, 1, 2)
        ]
    assert seen["4-gram unseen"]["predictions"]["per_seed"] == [40.0, 40.0, 40.0]
    assert "4-gram unseen" in seeds_mod.markdown(summary)
    for record in records.values():
        del record["where_it_wins"]["longest_seen"]
    assert "seen" not in seeds_mod.aggregate(records)["unseen"]


def test_aggregate_leaves_out_what_a_seed_lacks() -> None:
    rng = np.random.default_rng(4)
    records = {0: _record(rng), 1: _record(rng, package=False)}
    summary = seeds_mod.aggregate(records)
    assert "package_heldout" not in summary["heldout_loss"]
    with pytest.raises(ValueError, match="at least 2"):
        seeds_mod.aggregate({0: records[0]})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seeds", "1,1"], "distinct seeds"),
        (["--seeds", "3", "--aggregate"], "at least 2 distinct seeds to aggregate"),
        (["--seeds", "a,b"], "--seeds"),
        (["--seed", "4"], "--seed is set per seed"),
        (["--results", "x.json"], "--results is set per seed"),
        (["--steps", "0"], "--steps=0"),  # the training command's own check, up front
        (["--jobs", "0"], "--jobs=0"),
    ],
)
def test_bad_flags_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as exc:
        seeds_mod.main(["--out", str(out), "--device", "cpu", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_gates_per_prediction_of_an_engram_model() -> None:
    """The gates captured at evaluation are in [0, 1], valid exactly where the losses are,
    leave the losses unchanged, and move with the gate's weights (a control that they are
    the model's gates); a dense model has none."""
    from engramrt_lab.models.lm import LMConfig, TinyLM
    from engramrt_lab.models.train import token_losses, token_losses_and_gates
    from engramrt_lab.training import EngramTable

    config = LMConfig(
        vocab_size=50,
        dim=32,
        n_blocks=3,
        n_heads=2,
        head_dim=16,
        mlp_dim=32,
        engram_layer_ids=(0, 2),
        engram_cols=2,
        engram_head_dim=32,
    )
    torch.manual_seed(1)
    model = TinyLM(config)
    model.reset_parameters(engram_identity=False)
    tables = [EngramTable(64, 32), EngramTable(64, 32)]
    tokens = torch.randint(0, 50, (5, 9))
    lengths = torch.tensor([9, 4, 1, 9, 7])
    row_ids = torch.randint(0, 64, (5, 9, 2, 2), dtype=torch.int32)

    def rows(index: int, ids: torch.Tensor) -> torch.Tensor:
        return tables[index](ids)

    losses, gates = token_losses_and_gates(model, rows, tokens, lengths, row_ids, batch_size=2)
    assert set(gates) == {0, 2}
    want = token_losses(model, rows, tokens, lengths, row_ids, batch_size=2)
    np.testing.assert_array_equal(losses, want)
    for block, values in gates.items():
        assert values.shape == losses.shape == (5, 8)
        np.testing.assert_array_equal(np.isnan(values), np.isnan(losses))
        finite = values[~np.isnan(values)]
        assert finite.size == int((lengths - 1).clamp(min=0).sum()), block
        assert ((finite >= 0) & (finite <= 1)).all(), block
        assert finite.std() > 0, block  # one gate per position, not a constant
    with torch.no_grad():
        model.engram_head(2).q_weight.mul_(-1)  # flips the sign of block 2's dot products
    _, flipped = token_losses_and_gates(model, rows, tokens, lengths, row_ids, batch_size=2)
    np.testing.assert_array_equal(flipped[0], gates[0])
    assert not np.allclose(flipped[2], gates[2], equal_nan=True)
    np.testing.assert_allclose(flipped[2], 1 - gates[2], atol=1e-6)  # sigmoid(-s) = 1 - g
    dense = TinyLM(config.baseline())
    assert token_losses_and_gates(dense, None, tokens, lengths, None)[1] == {}


def test_gate_split_counts_are_the_loss_splits() -> None:
    mask = np.array([[True, False, True], [False, True, False]])
    masks = {"view": {"a": mask, "b": ~mask}}
    losses = np.arange(6.0).reshape(2, 3)
    gates = np.linspace(0, 1, 6).reshape(2, 3)
    table = category_losses(masks, {"m": losses}, {"m": {3: gates}})
    column = gate_column("m", 3)
    assert table["view"]["a"][column] == round(float(gates[mask].mean()), 4)
    assert table["view"]["b"][column] == round(float(gates[~mask].mean()), 4)
    # Negative control: a gate missing on a prediction the loss counts is an error.
    gates[0, 0] = np.nan
    with pytest.raises(ValidationError, match=r"NaN at 1 of the 3 predictions"):
        category_losses(masks, {"m": losses}, {"m": {3: gates}})


def test_seeds_command_end_to_end(tiny_sources: tuple[Path, Path], tmp_path: Path) -> None:
    """Three seeds of the tests' tiny training run (about 25 s on one core) (and a memory-sweep point): every seed's
    model directory and record, an aggregate equal to the mean and sample std computed
    here from those records, seeds that differ (the seed is applied), and the gate split
    in [0, 1] over the loss split's predictions."""
    stdlib, site = tiny_sources
    out = tmp_path / "runs"
    args = [*TRAIN_ARGS, "--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    status = seeds_mod.main(["--seeds", "0,1,7", "--out", str(out), *args, "--memory-sweep", "1"])
    assert status == 0
    records = {s: json.loads((out / f"seed-{s}.json").read_text()) for s in (0, 1, 7)}
    for seed in (0, 1, 7):
        assert (out / f"seed-{seed}" / "model.json").is_file()
        settings = json.loads((out / f"seed-{seed}" / "model.json").read_text())["training"]
        assert settings["settings"]["seed"] == seed
    summary = json.loads((out / seeds_mod.AGGREGATE_JSON).read_text())
    assert (out / seeds_mod.SUMMARY_MD).read_text().startswith("# Over 3 seeds (0, 1, 7)")
    _check_against_statistics(summary, records)
    # Every seed's model.json carries every seed's held-out losses (still sealed), and the
    # figures a report shows from it are the mean and sample std computed here.
    from engramrt_lab.models import artifacts

    for seed in (0, 1, 7):
        record = artifacts.read_model_json(out / f"seed-{seed}")["training"]
        folded = record[seeds_mod.HELDOUT_SEEDS]
        assert folded["seeds"] == [0, 1, 7]
        figures = seeds_mod.heldout_figures(record)
        assert figures["seeds"] == 3
        for split, name in seeds_mod.HELDOUT_SET_NAMES.items():
            for model in records[0][split]["losses"]:
                values = [records[s][split]["losses"][model] for s in (0, 1, 7)]
                assert folded["losses"][split][model] == values
                assert abs(figures["loss"][name][model] - statistics.fmean(values)) < TOL
                assert abs(figures["spread"][name][model] - statistics.stdev(values)) < TOL
    assert set(summary["heldout_loss"]) == {"heldout", "package_heldout"}
    assert set(summary["heldout_loss"]["heldout"]) == {
        "engram",
        "engram_fp8",
        "baseline",
        "baseline_wide",
    }
    # Negative control: the seed reaches training (different losses for every model).
    for model, stats in summary["heldout_spread"]["heldout"].items():
        assert len(set(stats["per_seed"])) == 3, model
        assert stats["std"] > 0, model
    assert set(summary["sweep"]) == {"8", "1"}
    assert summary["sweep"]["1"]["name"] == "engram_x1"
    for split in ("heldout", "package_heldout"):
        values = [
            next(p for p in records[s]["memory_sweep"] if p["name"] == "engram_x1")["losses"][split]
            for s in (0, 1, 7)
        ]
        assert abs(summary["sweep"]["1"][split]["std"] - statistics.stdev(values)) < TOL
    # The gate split: per seed, each Engram model's gate per block beside the losses, over
    # the same predictions; in [0, 1].
    held = records[0]["heldout"]["predictions"]
    for record in records.values():
        for view, rows in record["where_it_wins"].items():
            assert sum(r["predictions"] for r in rows.values()) == held, view
            for row in rows.values():
                for model in ("engram", "engram_x1"):
                    for block in (1, 2):
                        gate = row[gate_column(model, block)]
                        if row["predictions"]:
                            assert 0 <= gate <= 1 and math.isfinite(gate)
                        else:
                            assert gate is None
                assert gate_column("baseline", 1) not in row
    cells = summary["unseen"]["context"]
    for category, cell in cells.items():
        if gate_column("engram", 1) in cell:
            assert 0 <= cell[gate_column("engram", 1)]["min"] <= 1, category


def _summary_with(record: dict[str, Any], seed: int, other: int) -> dict[str, Any]:
    """An aggregate of ``record``'s own held-out losses (as seed ``seed``) and another
    seed's (each loss 0.1 higher)."""
    records = {}
    for value, shift in ((seed, 0.0), (other, 0.1)):
        records[value] = {
            "steps": {"steps": 4},
            **{
                split: {"losses": {m: v + shift for m, v in record[split]["losses"].items()}}
                for split in seeds_mod.HELDOUT_SETS
            },
        }
    return seeds_mod.aggregate(records)


def test_fold_into_a_model_directory(trained_dir: Path, tmp_path: Path) -> None:
    """fold_into_model_dir writes the per-seed losses into model.json, still sealed (the
    loader reads it); the figures are the mean and sample std of the two seeds. Refused,
    with model.json left byte for byte, for a directory that is not one of the seeds."""
    from engramrt_lab.models import artifacts

    directory = tmp_path / "model"
    shutil.copytree(trained_dir, directory)
    record = artifacts.read_model_json(directory)["training"]
    assert seeds_mod.heldout_figures(record)["seeds"] == 1  # before: the run's own losses
    assert all(
        v is None
        for models in seeds_mod.heldout_figures(record)["spread"].values()
        for v in models.values()
    )
    seed = record["settings"]["seed"]
    summary = _summary_with(record, seed, seed + 1)

    before = (directory / artifacts.MODEL_JSON).read_bytes()
    wrong_seed = _summary_with(record, seed + 2, seed + 1)
    with pytest.raises(CheckpointError, match=r"settings\.seed=0 is not one of"):
        seeds_mod.fold_into_model_dir(directory, wrong_seed)
    other_losses = json.loads(json.dumps(summary))
    other_losses["heldout_spread"]["heldout"]["baseline"]["per_seed"][0] += 1e-9
    with pytest.raises(CheckpointError, match=r"training\.heldout\.losses\.baseline="):
        seeds_mod.fold_into_model_dir(directory, other_losses)
    assert (directory / artifacts.MODEL_JSON).read_bytes() == before

    folded = seeds_mod.fold_into_model_dir(directory, summary)
    data = artifacts.read_model_json(directory)  # the seal was recomputed
    assert data["training"][seeds_mod.HELDOUT_SEEDS] == folded
    figures = seeds_mod.heldout_figures(data["training"])
    assert figures["seeds"] == 2
    for split, name in seeds_mod.HELDOUT_SET_NAMES.items():
        for model, own in record[split]["losses"].items():
            values = [own, own + 0.1]
            assert abs(figures["loss"][name][model] - statistics.fmean(values)) < TOL
            assert abs(figures["spread"][name][model] - statistics.stdev(values)) < TOL
    # The other files are untouched: every checksum still holds where the loader checks.
    from engramrt.lookup.tiers import TablePlacement
    from engramrt_lab.models.serve import load_model

    load_model(directory, TablePlacement("device", device="cpu"), load_baseline=False)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda f: f.update(seeds=[0]), r"heldout_seeds\.seeds=\[0\]"),
        (lambda f: f.update(seeds=[0, 0]), r"heldout_seeds\.seeds="),
        (lambda f: f["losses"]["heldout"]["engram"].pop(), r"losses\.heldout\.engram="),
        (lambda f: f["losses"]["heldout"]["engram"].__setitem__(0, float("nan")), r"finite"),
        (lambda f: f["losses"].update(other={}), r"heldout_seeds\.losses="),
    ],
)
def test_heldout_figures_refuse_a_malformed_record(change, needle) -> None:
    record = {
        "heldout": {"losses": {"engram": 2.0}},
        seeds_mod.HELDOUT_SEEDS: {"seeds": [0, 1], "losses": {"heldout": {"engram": [2.0, 2.2]}}},
    }
    assert seeds_mod.heldout_figures(record)["loss"]["stdlib"]["engram"] == pytest.approx(2.1)
    change(record[seeds_mod.HELDOUT_SEEDS])
    with pytest.raises(CheckpointError, match=needle):
        seeds_mod.heldout_figures(record)


STUB_TRAINING = """
import json, sys, time
from pathlib import Path

args = sys.argv[1:]
seed, results = int(args[args.index("--seed") + 1]), Path(args[args.index("--results") + 1])
log = results.parent / "events.txt"
with log.open("a") as f:
    f.write(f"start {seed} {time.monotonic()}\\n")
print(f"training seed {seed}", flush=True)
time.sleep(0.5)
with log.open("a") as f:
    f.write(f"end {seed} {time.monotonic()}\\n")
raise SystemExit(3 if seed == 5 else 0)
"""


def _run_stub(tmp_path: Path, seeds: tuple[int, ...], jobs: int) -> tuple[dict[int, int], Path]:
    """``_run_in_processes`` with a stand-in training module (no torch: fast)."""
    (tmp_path / "stub_training.py").write_text(STUB_TRAINING)
    out = tmp_path / f"runs-{jobs}"
    out.mkdir()
    commands = [["--seed", str(s), "--results", str(out / f"seed-{s}.json")] for s in seeds]
    statuses = seeds_mod._run_in_processes(
        seeds, out, commands, jobs, module="stub_training", env_path=tmp_path
    )
    return statuses, out


def _overlaps(events: str) -> int:
    """The most seeds running at once, from the stub's start and end times."""
    moments = []
    for line in events.splitlines():
        kind, _, when = line.split()
        moments.append((float(when), 1 if kind == "start" else -1))
    running = most = 0
    for _, step in sorted(moments, key=lambda m: (m[0], m[1])):
        running += step
        most = max(most, running)
    return most


def test_jobs_run_seeds_at_once_and_keep_their_output(tmp_path: Path) -> None:
    """``--jobs 2``: two seeds at a time (never three), each one's output in its log."""
    statuses, out = _run_stub(tmp_path, (0, 1, 2, 3), jobs=2)
    assert statuses == {0: 0, 1: 0, 2: 0, 3: 0}
    assert _overlaps((out / "events.txt").read_text()) == 2
    for seed in (0, 1, 2, 3):
        assert (out / f"seed-{seed}.log").read_text() == f"training seed {seed}\n"
    # Control: one job runs them one after another.
    statuses, out = _run_stub(tmp_path, (0, 1, 2), jobs=1)
    assert _overlaps((out / "events.txt").read_text()) == 1


def test_jobs_stop_starting_seeds_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A seed that fails (exit 3) lets the running seeds finish, starts no other, and the
    command exits with its status, naming its log, without an aggregate."""
    statuses, _ = _run_stub(tmp_path, (5, 1, 2, 3), jobs=2)
    assert statuses[5] == 3 and statuses[1] == 0
    assert 3 not in statuses
    monkeypatch.setattr(seeds_mod, "_run_in_processes", lambda *a, **k: {0: 0, 1: 3})
    runs = tmp_path / "runs"
    status = seeds_mod.main(["--seeds", "0,1", "--out", str(runs), "--device", "cpu",
                             "--jobs", "2"])  # fmt: skip
    assert status == 3
    assert "seed 1 failed (exit status 3, its output in seed-1.log)" in capsys.readouterr().err
    assert not (runs / seeds_mod.AGGREGATE_JSON).exists()


def _shifted_record(record: dict[str, Any], seed: int, shift: float) -> dict[str, Any]:
    """``record`` (a ``--results`` JSON) as seed ``seed`` trained it: its command with
    ``--seed`` and every held-out loss ``shift`` higher."""
    other = json.loads(json.dumps(record))
    other["command"] = f"{record['command']} --seed {seed}"
    for split in seeds_mod.HELDOUT_SETS:
        for model in other[split]["losses"]:
            other[split]["losses"][model] += shift
    return other


def test_aggregate_of_records_made_elsewhere(
    trained_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--aggregate`` trains nothing: the records already in DIR (seed 0 with its model
    directory, seed 3 without) give the aggregate computed here, folded into seed 0's
    directory only."""
    from engramrt_lab.models import artifacts

    out = tmp_path / "runs"
    shutil.copytree(trained_dir, out / "seed-0")
    record = json.loads((out / "seed-0" / "results.json").read_text())
    (out / "seed-0" / "results.json").unlink()
    records = {0: record, 3: _shifted_record(record, 3, 0.25)}
    for seed, value in records.items():
        (out / f"seed-{seed}.json").write_text(json.dumps(value))
    assert seeds_mod.main(["--seeds", "0,3", "--out", str(out), "--aggregate"]) == 0
    assert "seed 3: no model directory in seed-3, nothing folded" in capsys.readouterr().out
    summary = json.loads((out / seeds_mod.AGGREGATE_JSON).read_text())
    _check_against_statistics(summary, records)
    folded = artifacts.read_model_json(out / "seed-0")["training"][seeds_mod.HELDOUT_SEEDS]
    assert folded["seeds"] == [0, 3]
    assert not (out / "seed-3").exists()


def _part(command: str, *models: str) -> dict[str, Any]:
    """A run's record with the fields :func:`merge_records` reads: ``models`` trained by
    ``command``."""
    return {
        "command": command,
        "steps": {"steps": 4, "schedule_steps": 4},
        "models": {m: {"losses": {"heldout": 2.0}} for m in models},
        "where_it_wins": {},
        "memory_sweep": [],
    }


@pytest.mark.parametrize(
    "engram_flags",
    ["--buckets 12,8,4", "--unseen-rate 0.1", "--short-conv 4 --short-conv-dilation 2"],
)
def test_a_run_of_baselines_merges_whatever_the_engram_only_flags(engram_flags: str) -> None:
    """The baselines train the same whatever the Engram-only flags say, so a
    run of them merges with an Engram run that sets them, and the merged command is the
    Engram run's. Controls: two Engram runs that differ in them, and a run of baselines
    that differs in another flag, are refused."""
    engram = _part(f"train --steps 4 {engram_flags} --models engram", "engram")
    baselines = _part(
        "train --steps 4 --models baseline,baseline_wide", "baseline", "baseline_wide"
    )
    merged = seeds_mod.merge_records([baselines, engram])
    assert merged["command"] == f"train --steps 4 {engram_flags}"
    assert set(merged["models"]) == {"engram", "baseline", "baseline_wide"}
    sweep = _part("train --steps 4 --models sweep --memory-sweep 1", "engram_x1")
    with pytest.raises(ValueError, match="expected the same settings"):
        seeds_mod.merge_records([baselines, engram, sweep])  # Engram runs that differ
    other = _part("train --steps 4 --lr 0.01 --models baseline", "baseline")
    with pytest.raises(ValueError, match=r"--lr 0\.01"):
        seeds_mod.merge_records([other, engram])


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: r.update(command=r["command"] + " --steps 9"), "expected the same settings"),
        (lambda r: r.update(command=r["command"].replace("--seed 3", "--seed 4")), "--seed 4"),
    ],
)
def test_aggregate_refuses_records_not_trained_alike(
    trained_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit, needle
) -> None:
    record = json.loads((trained_dir / "results.json").read_text())
    other = _shifted_record(record, 3, 0.25)
    edit(other)
    out = tmp_path / "runs"
    out.mkdir()
    (out / "seed-0.json").write_text(json.dumps(record))
    (out / "seed-3.json").write_text(json.dumps(other))
    assert seeds_mod.main(["--seeds", "0,3", "--out", str(out), "--aggregate"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "no aggregate written" in err, err
    assert not (out / seeds_mod.AGGREGATE_JSON).exists()
    # The control: the same records, unedited, aggregate.
    (out / "seed-3.json").write_text(json.dumps(_shifted_record(record, 3, 0.25)))
    assert seeds_mod.main(["--seeds", "0,3", "--out", str(out), "--aggregate"]) == 0


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ([], "seed-1.json' is missing"),
        (["--steps", "4"], "takes no training flag; got '--steps'"),
    ],
)
def test_aggregate_flags_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, needle
) -> None:
    out = tmp_path / "runs"
    out.mkdir()
    (out / "seed-0.json").write_text("{}")
    if flags:
        (out / "seed-1.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        seeds_mod.main(["--seeds", "0,1", "--out", str(out), "--aggregate", *flags])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (out / seeds_mod.AGGREGATE_JSON).exists()


def test_aggregate_of_runs_stopped_early() -> None:
    """A record of a run stopped after some models (no held-out summary, no
    ``seconds_total``) gives each set's losses from its models, and is listed as stopped
    early; a finished record is not."""
    rng = np.random.default_rng(11)
    finished = {**_record(rng), "seconds_total": 1.0}
    stopped = {
        "steps": {"steps": 4},
        "models": {
            m: {"losses": {"heldout": float(rng.uniform(1.5, 2.5)), "sample": 9.0}}
            for m in ("engram", "baseline")
        },
    }
    summary = seeds_mod.aggregate({0: finished, 5: stopped})
    assert summary["stopped_early"] == [5]
    assert set(summary["heldout_loss"]) == {"heldout"}  # the stopped run has no package set
    for model in ("engram", "baseline"):
        values = [
            finished["heldout"]["losses"][model],
            stopped["models"][model]["losses"]["heldout"],
        ]
        assert abs(summary["heldout_loss"]["heldout"][model] - statistics.fmean(values)) < TOL
    assert "baseline_wide" not in summary["heldout_loss"]["heldout"]  # seed 5 lacks it
    assert "stopped before its end" in seeds_mod.markdown(summary)
    assert "stopped before" not in seeds_mod.markdown(
        seeds_mod.aggregate({0: finished, 1: finished})
    )


@pytest.mark.parametrize(
    ("text", "needle"), [("{", "not a readable JSON record"), ("[1]", "holds list")]
)
def test_aggregate_refuses_a_record_that_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    out = tmp_path / "runs"
    out.mkdir()
    (out / "seed-0.json").write_text("{}")
    (out / "seed-1.json").write_text(text)
    assert seeds_mod.main(["--seeds", "0,1", "--out", str(out), "--aggregate"]) == 2
    assert needle in capsys.readouterr().err
    assert not (out / seeds_mod.AGGREGATE_JSON).exists()


def test_runs_of_some_models_merge_into_the_whole_run(
    trained_dir: Path, tiny_sources: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    """Seeds 0 and 5 as three runs of ``--models`` into one DIR (the Engram model, the
    memory sweep's x1 point alone (``sweep``; its x8 point is the Engram model), then the
    two baselines): seed 0's merged record holds the models,
    losses, sweep and where-it-wins split of the whole run of seed 0 (``trained_dir``),
    value for value: a model of a run of some is the whole run's model. The aggregate is
    over the merged records. Controls: a run trained otherwise, or a model in two runs,
    is refused with the seed and what differs."""
    from engramrt_lab.models.train import MODEL_NAMES

    stdlib, site = tiny_sources
    out = tmp_path / "runs"
    args = ["--seeds", "0,5", "--out", str(out), *TRAIN_ARGS, "--stdlib-root", str(stdlib)]
    args += ["--site-dirs", str(site)]
    assert seeds_mod.main([*args, "--models", "engram"]) == 0
    assert seeds_mod.main([*args, "--models", "sweep", "--memory-sweep", "1,8"]) == 0
    assert seeds_mod.main([*args, "--models", "baseline_wide,baseline"]) == 0
    both = [
        "seed-{}-baseline+baseline_wide.json",
        "seed-{}-engram.json",
        "seed-{}-sweep+x1+x8.json",
    ]
    assert sorted(p.name for p in out.glob("seed-*.json")) == [
        name.format(seed) for seed in (0, 5) for name in both
    ]
    assert not list(out.glob("seed-*/")), "a run of some models writes no model directory"
    whole = json.loads((trained_dir / "results.json").read_text())
    parts = [json.loads((out / name.format(0)).read_text()) for name in both]
    assert set(parts[2]["models"]) == {"engram_x1"}, "a sweep run trains only its points"
    merged = seeds_mod.merge_records(parts)
    assert set(merged["models"]) == set(whole["models"]) == {*MODEL_NAMES, "engram_x1"}
    for name, model in whole["models"].items():
        assert merged["models"][name]["losses"] == model["losses"], name
    assert merged["where_it_wins"] == whole["where_it_wins"]
    assert [(p["name"], p["losses"]) for p in merged["memory_sweep"]] == [
        (p["name"], p["losses"]) for p in whole["memory_sweep"]
    ]
    summary = json.loads((out / seeds_mod.AGGREGATE_JSON).read_text())
    assert summary["records"]["0"] == [name.format(0) for name in both]
    for split in ("heldout", "package_heldout"):
        for name in MODEL_NAMES:
            got = summary["heldout_spread"][split][name]["per_seed"][0]
            assert got == whole["models"][name]["losses"][split], (split, name)
    assert summary["stopped_early"] == []

    # Controls: seed 5's baselines trained with another learning rate; then the Engram
    # model in both of seed 5's runs.
    path = out / both[0].format(5)
    good = path.read_text()
    edited = json.loads(good)
    edited["command"] += " --lr 0.01"
    path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert seeds_mod.main(["--seeds", "0,5", "--out", str(out), "--aggregate"]) == 2
    err = capsys.readouterr().err
    assert "seed 5" in err and "--lr 0.01" in err and "expected the same settings" in err, err
    edited = json.loads(good)
    edited["models"]["engram"] = parts[1]["models"]["engram"]
    path.write_text(json.dumps(edited))
    assert seeds_mod.main(["--seeds", "0,5", "--out", str(out), "--aggregate"]) == 2
    assert "model 'engram' is in two runs of this seed" in capsys.readouterr().err
    path.write_text(good)
    assert seeds_mod.main(["--seeds", "0,5", "--out", str(out), "--aggregate"]) == 0


def test_one_seed_trains_into_the_layout_and_writes_no_aggregate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seeds S`` runs the training command for that seed into ``DIR/seed-S`` with its
    record ``DIR/seed-S.json`` (where ``--aggregate`` looks later) and aggregates nothing.
    Control: two seeds with the same stand-in training go on to the aggregate."""
    calls: list[tuple[list[int], list[list[str]]]] = []

    def stand_in(seeds, out, commands, jobs) -> int:
        calls.append((list(seeds), [list(c) for c in commands]))
        return 0

    monkeypatch.setattr(seeds_mod, "_train_seeds", stand_in)
    out = tmp_path / "runs"
    assert (
        seeds_mod.main(["--seeds", "3", "--out", str(out), "--device", "cpu", "--steps", "2"]) == 0
    )
    [(seeds, [command])] = calls
    assert seeds == [3]
    for flag, value in (("--seed", "3"), ("--out", str(out / "seed-3"))):
        assert command[command.index(flag) + 1] == value
    assert command[command.index("--results") + 1] == str(out / "seed-3.json")
    assert "no aggregate" in capsys.readouterr().out
    assert not (out / seeds_mod.AGGREGATE_JSON).exists()

    # Control: two seeds go on to the aggregate, which stops at the first seed with no
    # record (the stand-in wrote none), naming it.
    status = seeds_mod.main(
        ["--seeds", "3,4", "--out", str(out), "--device", "cpu", "--steps", "2"]
    )
    assert len(calls) == 2 and calls[1][0] == [3, 4]
    printed = capsys.readouterr()
    assert status == 2 and "no aggregate:" not in printed.out
    assert "seed 3 has no record" in printed.err and "seed-3.json" in printed.err


def test_command_seeds_reads_both_forms_of_the_flag() -> None:
    """``--seed N`` and ``--seed=N`` both name a seed, and the other words stay in order;
    ``--seeds`` (the seeds command's own flag) and a bare trailing ``--seed`` do not."""
    words = ["train", "--seed", "3", "--steps", "4", "--seed=5", "--seeds", "0,1", "--seed"]
    assert seeds_mod.command_seeds(words) == (
        ["3", "5"],
        ["train", "--steps", "4", "--seeds", "0,1", "--seed"],
    )
    assert seeds_mod.command_seeds(["train", "--steps", "4"]) == ([], ["train", "--steps", "4"])
