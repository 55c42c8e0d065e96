"""The model shipped with the package: the tiny Engram LM trained on Python sources.

``engramrt demo`` serves it by default. It was written by
``python -m engramrt_lab.models.train --out DIR --minutes 0.75 --device cuda
--memory-sweep 1,4,12 --compare-layers 1,3`` on one H200 (the record is in
its ``model.json`` and in BENCHMARKS.md, "The tiny Engram LM") and copied
into ``engramrt_lab/data/tiny-lm``: the fp8 Engram tables in the converted
checkpoint format, the three backbones (bf16: the Engram model, the
baseline and the FLOP-matched wide baseline), the trimmed vocabulary and
the held-out sample, 48.6 MB in all.
"""

from __future__ import annotations

from pathlib import Path

from engramrt.errors import ValidationError

__all__ = ["PACKAGED_MODEL", "packaged_model_dir"]

PACKAGED_MODEL = "tiny-lm"


def packaged_model_dir() -> Path:
    """The directory of the shipped model; an error naming it if the install lacks it."""
    from importlib.resources import files

    directory = Path(str(files("engramrt_lab"))) / "data" / PACKAGED_MODEL
    if not (directory / "model.json").is_file():
        raise ValidationError(
            f"the packaged model is missing: {str(directory)!r} holds no model.json; expected "
            f"the package data of engramrt-lab (reinstall it, or pass a model directory)"
        )
    return directory
