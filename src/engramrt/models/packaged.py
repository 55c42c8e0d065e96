"""The model shipped with the package: the tiny Engram LM trained on CPython's stdlib.

``engramrt demo`` serves it by default. It was written by
``python -m engramrt.models.train --out DIR --minutes 1.0 --device cuda`` on
one H200 (the record is in its ``model.json`` and in BENCHMARKS.md, "The
tiny Engram LM") and copied into ``engramrt/data/tiny-lm`` whole: the fp8
Engram tables in the converted checkpoint format, both backbones (bf16),
the trimmed vocabulary and the held-out sample, 23 MB in all.
"""

from __future__ import annotations

from pathlib import Path

from engramrt.errors import ValidationError

__all__ = ["PACKAGED_MODEL", "packaged_model_dir"]

PACKAGED_MODEL = "tiny-lm"


def packaged_model_dir() -> Path:
    """The directory of the shipped model; an error naming it if the install lacks it."""
    from importlib.resources import files

    directory = Path(str(files("engramrt"))) / "data" / PACKAGED_MODEL
    if not (directory / "model.json").is_file():
        raise ValidationError(
            f"the packaged model is missing: {str(directory)!r} holds no model.json; expected "
            f"the package data of engramrt (reinstall it, or pass a model directory)"
        )
    return directory
