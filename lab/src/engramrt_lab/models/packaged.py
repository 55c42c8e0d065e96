"""The model shipped with the package: the tiny Engram LM trained on Python sources.

``engramrt demo`` serves it by default. It was written by
``python -m engramrt_lab.models.train --out DIR --steps 1321 --device cuda
--eval-sequences 4096 --val-sequences 256 --engram-layers 1,3 --buckets
12288,8192,4096`` on one H100 (the record is in its ``model.json`` and in
BENCHMARKS.md, "The shipped model: ×2 tables, one full pass") and copied
into ``engramrt_lab/data/tiny-lm``: the fp8 Engram tables in the converted
checkpoint format, the three backbones (bf16: the Engram model, the
baseline and the FLOP-matched wide baseline), the trimmed vocabulary and
the held-out sample, 29.2 MB in all.
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
