"""A tiny source tree and a model directory trained on it for a few steps on the CPU,
shared by the model tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

TRAIN_ARGS = [
    "--device",
    "cpu",
    "--max-files",
    "12",
    "--steps",
    "4",
    "--batch-size",
    "2",
    "--seq-len",
    "64",
    "--eval-sequences",
    "6",
    "--sample-sequences",
    "3",
]


def make_sources(base: Path) -> tuple[Path, Path]:
    """A fake stdlib (real stdlib files: 14 training, 2 held-out, 2 validation, each under
    40 kB) and a fake site directory: a package ``toolkit`` of 3 other stdlib files plus
    an exact copy of a training file and a near copy (lines reindented) of another, and
    a package ``click`` (held out) of 2 more."""
    from engramrt_lab.models.corpus import split_of, stdlib_files

    root, names = stdlib_files()
    small = [n for n in names if (root / n).stat().st_size < 40_000 and "/" not in n]
    by_split: dict[str, list[str]] = {"train": [], "heldout": [], "validation": []}
    for name in small:
        split = split_of(name)
        if split in by_split:
            by_split[split].append(name)
    stdlib, site = base / "stdlib", base / "site"
    chosen = by_split["train"][:14] + by_split["heldout"][:2] + by_split["validation"][:2]
    for name in chosen:
        (stdlib / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, stdlib / name)
    extra = by_split["train"][14:19]
    (site / "toolkit").mkdir(parents=True)
    (site / "click").mkdir(parents=True)
    for i, name in enumerate(extra[:3]):
        shutil.copy(root / name, site / "toolkit" / f"mod{i}.py")
    shutil.copy(root / chosen[0], site / "toolkit" / "copy.py")
    text = (root / chosen[1]).read_text(encoding="utf-8", errors="replace")
    (site / "toolkit" / "near.py").write_text(
        "\n".join("    " + line for line in text.splitlines()) + "\n", encoding="utf-8"
    )
    for i, name in enumerate(extra[3:5]):
        shutil.copy(root / name, site / "click" / f"part{i}.py")
    return stdlib, site


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory: pytest.TempPathFactory, tiny_sources) -> Path:
    """``python -m engramrt_lab.models.train`` (in process) on the tiny sources, 4 steps."""
    from engramrt_lab.models.train import main

    stdlib, site = tiny_sources
    out = tmp_path_factory.mktemp("tiny-lm")
    args = [*TRAIN_ARGS, "--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    # x8 is the default buckets' own size: the Engram model's point, not trained again.
    extra = ["--results", str(out / "results.json"), "--memory-sweep", "1,8"]
    assert main(["--out", str(out), *args, *extra]) == 0
    return out
