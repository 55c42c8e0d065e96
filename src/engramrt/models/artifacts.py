"""Files of a trained model directory, and how they are written and read.

=============================  =====================================================
file                           content
=============================  =====================================================
``model.json``                 configs (backbone, Engram), trimmed vocab, training record
``config.json``                the Engram config as HF fields (``engramrt.load_config(DIR)``)
``engram.safetensors``         fp8 Engram tables, converted (``engramrt convert`` format)
``engram_model.safetensors``   the Engram model's backbone incl. its Engram heads, bf16
``baseline_model.safetensors`` the baseline's backbone, bf16
``heldout_sample.safetensors`` held-out sequences (:class:`~engramrt.models.corpus.EvalSegments`)
``loss_curves.png``            training loss of both models
``train_log.json``             the full per-step losses and the printed log
=============================  =====================================================

Every file is written atomically (:mod:`engramrt._io`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engramrt._io import atomic_write_bytes
from engramrt.errors import CheckpointError
from engramrt.models.corpus import EvalSegments

__all__ = [
    "BASELINE_WEIGHTS",
    "CONFIG_JSON",
    "ENGRAM_TABLES",
    "ENGRAM_WEIGHTS",
    "HELDOUT_SAMPLE",
    "LOSS_CURVES",
    "MODEL_JSON",
    "SHIPPED_FILES",
    "TRAIN_LOG",
    "load_sample",
    "load_weights",
    "read_model_json",
    "save_sample",
    "save_weights",
    "write_json",
]

MODEL_JSON = "model.json"
CONFIG_JSON = "config.json"
ENGRAM_TABLES = "engram.safetensors"
ENGRAM_WEIGHTS = "engram_model.safetensors"
BASELINE_WEIGHTS = "baseline_model.safetensors"
HELDOUT_SAMPLE = "heldout_sample.safetensors"
LOSS_CURVES = "loss_curves.png"
TRAIN_LOG = "train_log.json"
SHIPPED_FILES = (
    MODEL_JSON,
    CONFIG_JSON,
    ENGRAM_TABLES,
    ENGRAM_WEIGHTS,
    BASELINE_WEIGHTS,
    HELDOUT_SAMPLE,
)
"""What the demo ships (the size budget counts these)."""


def save_weights(path: Path, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Write ``model``'s state dict as safetensors in ``dtype``; returns the bytes written."""
    from safetensors.torch import save

    tensors = {
        name: tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in model.state_dict().items()
    }
    data = save(tensors, metadata={"format": "pt"})
    atomic_write_bytes(path, data)
    return len(data)


def load_weights(path: Path, model: nn.Module) -> None:
    """Load a file of :func:`save_weights` into ``model`` (every tensor, cast to the model's dtype)."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise CheckpointError(f"weights file {str(path)!r} does not exist")
    tensors = load_file(str(path))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{str(path)!r} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{str(path)!r}: tensor {name!r} has shape {list(tensor.shape)}; expected "
                f"{list(expected[name].shape)}"
            )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})


def save_sample(path: Path, segments: EvalSegments) -> int:
    from safetensors.torch import save

    data = save(
        {
            "tokens": torch.from_numpy(segments.tokens.astype(np.int32)),
            "lengths": torch.from_numpy(segments.lengths.astype(np.int32)),
            "lookback": torch.from_numpy(segments.lookback.astype(np.int32)),
            "starts": torch.from_numpy(segments.starts.astype(np.int64)),
            "positions": torch.from_numpy(segments.positions.astype(np.int64)),
        },
        metadata={"format": "engramrt-heldout-sample/1"},
    )
    atomic_write_bytes(path, data)
    return len(data)


def load_sample(path: Path) -> EvalSegments:
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise CheckpointError(f"held-out sample {str(path)!r} does not exist")
    t = load_file(str(path))
    return EvalSegments(
        t["tokens"].numpy().astype(np.int64),
        t["lengths"].numpy().astype(np.int64),
        t["lookback"].numpy().astype(np.int64),
        t["starts"].numpy().astype(np.int64),
        t["positions"].numpy().astype(np.int64),
    )


def write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode("utf-8"))


def read_model_json(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MODEL_JSON
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} does not exist; expected a directory written by "
            f"python -m engramrt.models.train"
        )
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data
