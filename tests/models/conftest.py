"""A model directory trained for a few steps on the CPU, shared by the model tests."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m engramrt.models.train`` (in process) on 12 stdlib files, 4 steps."""
    from engramrt.models.train import main

    out = tmp_path_factory.mktemp("tiny-lm")
    assert main(["--out", str(out), *TRAIN_ARGS]) == 0
    return out
