"""The training command refuses every bad flag up front (one line, exit 2, nothing
written), and a run whose loss is not finite writes no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BAD_FLAGS = [
    (["--minutes", "nan"], "--minutes=nan"),
    (["--minutes", "inf"], "--minutes=inf"),
    (["--minutes", "-1"], "--minutes=-1.0"),
    (["--steps", "0"], "--steps=0"),
    (["--eval-sequences", "0"], "--eval-sequences=0"),
    (["--val-sequences", "0"], "--val-sequences=0"),
    (["--sample-sequences", "0"], "--sample-sequences=0"),
    (["--seq-len", "0"], "--seq-len=0"),
    (["--seq-len", "4"], "--seq-len=4"),
    (["--batch-size", "0"], "--batch-size=0"),
    (["--dim", "0"], "--dim=0"),
    (["--n-blocks", "0"], "--n-blocks=0"),
    (["--n-blocks", "2"], "--engram-layers=1,2 names a block >= --n-blocks=2"),
    (["--mlp-dim", "0"], "--mlp-dim=0"),
    (["--vocab-k", "0"], "--vocab-k=0"),
    (["--max-files", "0"], "--max-files=0"),
    (["--max-train-chars", "0"], "--max-train-chars=0"),
    (["--eval-every", "0"], "--eval-every=0"),
    (["--lr", "nan"], "--lr=nan"),
    (["--lr", "-1"], "--lr=-1.0"),
    (["--lr", "0"], "--lr=0.0"),
    (["--table-lr", "inf"], "--table-lr=inf"),
    (["--weight-decay", "-1"], "--weight-decay=-1.0"),
    (["--weight-decay", "nan"], "--weight-decay=nan"),
    (["--table-init-std", "-0.5"], "--table-init-std=-0.5"),
    (["--table-init-std", "inf"], "--table-init-std=inf"),
    (["--table-init-std", "0"], "--table-init-std=0.0 must be a finite positive number"),
    (
        ["--engram-init", "rows-zero", "--table-init-std", "0.5"],
        "--table-init-std=0.5 with --engram-init=rows-zero",
    ),
    (["--engram-init", "zero"], "--engram-init: invalid choice: 'zero'"),
    (["--gate-slope-floor", "0"], "--gate-slope-floor=0.0 must be a finite number >= 1e-06"),
    (["--gate-slope-floor", "nan"], "--gate-slope-floor=nan"),
    (["--unseen-rate", "1"], "--unseen-rate=1.0 must be a number in [0, 1)"),
    (["--unseen-rate", "-0.1"], "--unseen-rate=-0.1 must be a number in [0, 1)"),
    (["--unseen-rate", "nan"], "--unseen-rate=nan"),
    (["--short-conv", "-1"], "--short-conv=-1 must be in [0, 64] (0: no convolution)"),
    (["--short-conv", "1000000000"], "--short-conv=1000000000 must be in [0, 64]"),
    (["--short-conv-dilation", "0"], "--short-conv-dilation=0 must be in [1, 16,384]"),
    (["--short-conv-dilation", "99999"], "--short-conv-dilation=99999 must be in [1, 16,384]"),
    (["--wkv-heads", "tied"], "--wkv-heads: invalid choice: 'tied'"),
    (["--seed", "-3"], "--seed=-3"),
    (["--head-dim", "48"], "--head-dim=48"),
    (["--engram-layers", "1,1"], "--engram-layers=1,1"),
    (["--engram-layers", "x"], "--engram-layers"),
    (["--buckets", "10,20"], "--buckets=10,20"),
    (["--memory-sweep", "1,nan"], "--memory-sweep holds nan"),
    (["--compare-layers", "1,9"], "--compare-layers=1,9"),
    (["--device", "tpu"], "--device='tpu'"),
    (["--device", "cuda:x"], "--device='cuda:x'"),
    (["--steps", "abc"], "--steps: invalid int value: 'abc'"),
    (["--stdlib-root", "/nonexistent/lib"], "--stdlib-root names '/nonexistent/lib'"),
    # Flags that size memory: refused with their bound before any work.
    (["--seq-len", "1000000000"], "--seq-len=1000000000 must be at most 16,384"),
    (["--batch-size", "4096"], "2,097,152 tokens per step; expected at most 262,144"),
    (["--dim", "2147483648"], "--dim=2147483648 must be at most 16,384"),
    (["--mlp-dim", "100000"], "--mlp-dim=100000 must be at most 16,384"),
    (["--n-blocks", "1000"], "--n-blocks=1000 must be at most 64"),
    (["--head-dim", "2048"], "--head-dim=2048 must be at most 1,024"),
    (["--dim", "16384"], "expected at most 48 GiB (MAX_ACTIVATION_BYTES)"),
    (
        ["--dim", "2048", "--mlp-dim", "16384", "--n-blocks", "64", "--batch-size", "1"],
        "dense parameters; expected at most 500,000,000",
    ),
    (["--buckets", "4611686018427387904,2,2"], "expected at most 16 GiB (MAX_TABLE_BYTES)"),
    (["--buckets", "400000000,2,2"], "expected at most 16 GiB (MAX_TABLE_BYTES)"),
    (["--memory-sweep", "1,100000"], "--memory-sweep 100000 gives Engram tables of 3,515.6 GiB"),
    (["--vocab-k", "10000000"], "--vocab-k=10000000 must be at most 129,280"),
    (["--eval-sequences", "1000000"], "--eval-sequences=1000000 must be at most 65,536"),
    (["--seed", str(2**64)], "--seed=18446744073709551616 must be in [0, 2**63 - 1]"),
]


@pytest.mark.parametrize(("args", "needle"), BAD_FLAGS)
def test_a_bad_flag_is_one_line_and_exit_2(capsys, tmp_path: Path, args, needle) -> None:
    from engramrt_lab.models.train import main

    out = tmp_path / "model"
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()  # refused before any work


def test_out_that_is_a_file_or_under_one(capsys, tmp_path: Path) -> None:
    from engramrt_lab.models.train import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, needle in ((afile, "exists and is not a directory"), (afile / "m", "is a file")):
        with pytest.raises(SystemExit) as info:
            main(["--out", str(out)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "m"), "--results", str(tmp_path)])
    assert info.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_cuda_without_cuda_is_refused(capsys, tmp_path: Path, monkeypatch) -> None:
    import torch

    from engramrt_lab.models.train import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "m"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "CUDA is not available" in err


def test_a_nan_loss_writes_no_model(capsys, tmp_path: Path, tiny_sources, monkeypatch) -> None:
    """The first model's loss is NaN (its embedding poisoned at initialisation): the
    command stops with one line and exit status 1, and no model file exists."""
    from engramrt_lab.models import lm
    from engramrt_lab.models.train import main

    from .conftest import TRAIN_ARGS

    real = lm.TinyLM.reset_parameters

    def poisoned(self, std: float = 0.02) -> None:
        real(self, std)
        self.embed.weight.data[:] = float("nan")

    monkeypatch.setattr(lm.TinyLM, "reset_parameters", poisoned)
    stdlib, site = tiny_sources
    out = tmp_path / "model"
    code = main(
        ["--out", str(out), *TRAIN_ARGS, "--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    )
    err = capsys.readouterr().err
    assert code == 1 and "the training loss is nan" in err and "no model is written" in err
    assert len(err.strip().splitlines()) == 1
    assert not any(out.glob("*.safetensors")) and not (out / "model.json").exists()


def test_a_failed_run_leaves_the_earlier_model_intact(
    capsys, tmp_path: Path, trained_dir: Path, tiny_sources, monkeypatch
) -> None:
    """A run into a directory holding a complete model dies after the tables and weights
    of the new one were written (a full disk at the held-out sample): the directory still
    holds the earlier model, byte for byte, and it loads with every checksum checked."""
    import shutil

    from engramrt.lookup.tiers import TablePlacement
    from engramrt_lab.models import artifacts
    from engramrt_lab.models.serve import load_model
    from engramrt_lab.models.train import main

    from .conftest import TRAIN_ARGS

    out = tmp_path / "model"
    shutil.copytree(trained_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    written = []
    real_save = artifacts.save_weights

    def save_then_count(path, model, *args):
        written.append(path)
        return real_save(path, model, *args)

    def full_disk(path, segments):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(artifacts, "save_weights", save_then_count)
    monkeypatch.setattr(artifacts, "save_sample", full_disk)
    stdlib, site = tiny_sources
    sources = ["--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    results = ["--seed", "7", "--results", str(out / "results.json")]
    code = main(["--out", str(out), *TRAIN_ARGS, *sources, *results])
    err = capsys.readouterr().err
    assert code == 1 and "No space left on device" in err and "left as it was" in err, err
    assert len(written) == 3  # the new weights were written (elsewhere) before the failure
    assert all(path.parent != out for path in written)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    before.pop("results.json")  # rewritten while the run went on: not part of the model
    after.pop("results.json")
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left
    model = load_model(out, TablePlacement("host", "cpu"), head_backend="reference")
    assert model.record == artifacts.read_model_json(out)["training"]


def test_out_holding_other_files_is_refused(capsys, tmp_path: Path) -> None:
    """The new model replaces --out whole: a directory holding anything but a model's
    files is refused before any work, and keeps its files."""
    from engramrt_lab.models.train import main

    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.tex").write_text("mine")
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "'thesis.tex'" in err and "replaces the directory" in err
    assert (out / "thesis.tex").read_text() == "mine"


def test_an_empty_stdlib_root_is_refused_up_front(capsys, tmp_path: Path) -> None:
    from engramrt_lab.models.train import main

    empty = tmp_path / "lib"
    (empty / "pkg").mkdir(parents=True)
    (empty / "pkg" / "README.txt").write_text("no sources")
    out = tmp_path / "model"
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), "--stdlib-root", str(empty)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "which holds no .py file" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def _one_split_root(base: Path, tiny_sources, split: str) -> Path:
    from engramrt_lab.models.corpus import split_of

    stdlib, _site = tiny_sources
    root = base / f"only-{split}"
    root.mkdir()
    for path in sorted(stdlib.rglob("*.py")):
        name = str(path.relative_to(stdlib))
        if split_of(name) == split:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(path.read_bytes())
    return root


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--vocab-k", "100000"], "--vocab-k=100000 but the training split holds"),
        (["--only-train"], "give no heldout file"),
    ],
    ids=["vocab-k above the corpus", "no held-out file"],
)
def test_flags_the_corpus_refuses_stop_before_training(
    capsys, tmp_path: Path, tiny_sources, args, needle
) -> None:
    """Known only once the corpus is read, still before any model: one line, exit 2
    (was: --vocab-k silently kept fewer ids; a sources tree without held-out files
    raised ZeroDivisionError after minutes)."""
    from engramrt_lab.models.train import main

    from .conftest import TRAIN_ARGS

    stdlib, site = tiny_sources
    if args == ["--only-train"]:
        stdlib, args = _one_split_root(tmp_path, tiny_sources, "train"), []
    out = tmp_path / "model"
    sources = ["--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    code = main(["--out", str(out), *TRAIN_ARGS, *sources, *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert not any(tmp_path.glob(".model.staging-*"))


def test_engram_init_round_trips_through_the_recorded_command(tmp_path: Path) -> None:
    """rows-zero implies rows at zero: --table-init-std defaults to 0 there (0.02 for
    value-zero), and the recorded command parses back to the same settings."""
    import shlex

    from engramrt_lab.models.train import parse_args, settings_record, training_command

    out = ["--out", str(tmp_path / "m")]
    rows_zero = parse_args([*out, "--engram-init", "rows-zero"])
    assert (rows_zero.engram_init, rows_zero.table_init_std) == ("rows-zero", 0.0)
    assert parse_args(out).table_init_std == 0.02
    words = shlex.split(training_command(rows_zero))
    assert words[words.index("--engram-init") + 1] == "rows-zero"
    again = parse_args([*words[3:], *out])
    assert settings_record(again) == settings_record(rows_zero)


def test_gate_slope_floor_reaches_every_engram_gate(
    tmp_path: Path, tiny_sources, monkeypatch
) -> None:
    """--gate-slope-floor is the floor every Engram layer's training gate is called with
    (the default's, 1e-6, when not given: the control that the recording reads the flag)."""
    from engramrt_lab.models import lm
    from engramrt_lab.models.train import main

    from .conftest import TRAIN_ARGS

    real = lm.engram_gate_train
    floors: list[float] = []

    def recording(inputs, *, slope_floor):
        floors.append(slope_floor)
        return real(inputs, slope_floor=slope_floor)

    monkeypatch.setattr(lm, "engram_gate_train", recording)
    stdlib, site = tiny_sources
    for given, want in ((["--gate-slope-floor", "0.25"], 0.25), ([], 1e-6)):
        floors.clear()
        args = [*TRAIN_ARGS, "--steps", "1", "--stdlib-root", str(stdlib), "--site-dirs", str(site)]
        # The Engram model alone: the baselines have no gate.
        results = ["--models", "engram", "--results", str(tmp_path / f"r{want}.json")]
        assert main([*results, *args, *given]) == 0
        assert floors and set(floors) == {want}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "--out is required: the model directory of the three models"),
        (["--models", "engram,mamba"], "--models=engram,mamba names 'mamba'; expected distinct"),
        (["--models", "baseline,baseline"], "--models=baseline,baseline is empty or repeats"),
        (["--models", "engram", "--out", "m"], "--out='m' with --models=engram: a run of fewer"),
        (["--models", "engram", "--steps", "4"], "--models=engram needs --results"),
        (["--models", "engram", "--results", "r.json"], "--models=engram needs --steps"),
        (
            ["--models", "baseline", "--steps", "4", "--results", "r.json", "--memory-sweep", "1"],
            "--memory-sweep with --models=baseline: the sweep's points are Engram models",
        ),
        (
            ["--models", "sweep", "--steps", "4", "--results", "r.json"],
            "--models=sweep trains only the Engram models of --memory-sweep",
        ),
        (
            ["--models", "sweep,engram", "--steps", "4", "--results", "r.json"],
            "--models=sweep,engram names 'sweep'; expected distinct",
        ),
    ],
)
def test_models_flag_is_checked(capsys, tmp_path: Path, monkeypatch, args, needle) -> None:
    """--models: which models, and what a run of some of them needs (one line, exit 2)."""
    from engramrt_lab.models.train import parse_args

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1


def test_models_round_trip_through_the_recorded_command(tmp_path: Path) -> None:
    """A run of some models records --models (in training order) and parses back to the
    same settings with --results; all three (the control) record no --models."""
    import shlex

    from engramrt_lab.models.train import MODEL_NAMES, parse_args, settings_record
    from engramrt_lab.models.train import training_command as command

    results = ["--results", str(tmp_path / "r.json")]
    some = parse_args(["--models", "baseline_wide,engram", "--steps", "9", *results])
    assert some.models == ("engram", "baseline_wide") and some.out is None
    words = shlex.split(command(some))
    assert words[words.index("--models") + 1] == "engram,baseline_wide"
    assert settings_record(parse_args([*words[3:], *results])) == settings_record(some)
    whole = parse_args(["--models", ",".join(MODEL_NAMES), "--out", str(tmp_path / "m")])
    assert whole.models == MODEL_NAMES and "--models" not in command(whole)


def test_unseen_rate_reaches_the_engram_training_steps(
    tmp_path: Path, tiny_sources, monkeypatch
) -> None:
    """--unseen-rate: every training step of the Engram model splits its batch's ids at that
    rate (:class:`UnseenNgrams`), and evaluation reads the plain ids; without the flag no
    step splits (the control that the recording reads the flag)."""
    from engramrt_lab.models import train as train_mod
    from engramrt_lab.models.train import main

    from .conftest import TRAIN_ARGS

    real = train_mod.UnseenNgrams.split
    rates: list[float] = []

    def recording(self, row_ids):
        rates.append(self.rate)
        return real(self, row_ids)

    monkeypatch.setattr(train_mod.UnseenNgrams, "split", recording)
    stdlib, site = tiny_sources
    for given, want in ((["--unseen-rate", "0.5"], [0.5, 0.5]), ([], [])):
        rates.clear()
        args = [*TRAIN_ARGS, "--steps", "2", "--stdlib-root", str(stdlib), "--site-dirs", str(site)]
        record = tmp_path / f"r{len(want)}.json"
        assert main(["--models", "engram", "--results", str(record), *args, *given]) == 0
        assert rates == want
        # The record's command says it (and only when used): runs of it merge and compare.
        assert ("--unseen-rate 0.5" in json.loads(record.read_text())["command"]) == bool(want)
