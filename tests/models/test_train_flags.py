"""The training command refuses every bad flag up front (one line, exit 2, nothing
written), and a run whose loss is not finite writes no model."""

from __future__ import annotations

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
]


@pytest.mark.parametrize(("args", "needle"), BAD_FLAGS)
def test_a_bad_flag_is_one_line_and_exit_2(capsys, tmp_path: Path, args, needle) -> None:
    from engramrt.models.train import main

    out = tmp_path / "model"
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()  # refused before any work


def test_out_that_is_a_file_or_under_one(capsys, tmp_path: Path) -> None:
    from engramrt.models.train import main

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

    from engramrt.models.train import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "m"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "CUDA is not available" in err


def test_a_nan_loss_writes_no_model(capsys, tmp_path: Path, tiny_sources, monkeypatch) -> None:
    """The first model's loss is NaN (its embedding poisoned at initialisation): the
    command stops with one line and exit status 1, and no model file exists."""
    from engramrt.models import lm
    from engramrt.models.train import main

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
