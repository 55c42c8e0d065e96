"""Files of a trained model directory, and how they are written and read.

=============================  =====================================================
file                           content
=============================  =====================================================
``model.json``                 configs (backbone, Engram), trimmed vocab, training record
``config.json``                the Engram config as HF fields (``engramrt.load_config(DIR)``)
``engram.safetensors``         fp8 Engram tables, converted (``engramrt convert`` format)
``engram_model.safetensors``   the Engram model's backbone incl. its Engram heads, bf16
``baseline_model.safetensors`` the baseline's backbone, bf16
``baseline_wide_model.safetensors`` the FLOP-matched baseline (wider MLP), bf16
``heldout_sample.safetensors`` held-out sequences (:class:`~engramrt_lab.models.corpus.EvalSegments`)
``loss_curves.png``            training loss of both models
``train_log.json``             the full per-step losses and the printed log
=============================  =====================================================

Every file is written atomically (:mod:`engramrt._io`). ``model.json``
records a SHA-256 of every other file it names (``checksums``), checked
when the directory is loaded; its file names must be plain names inside
the directory. ``model.json`` itself is covered by ``model_json_sha256``:
the SHA-256 of its other fields in a canonical form (:func:`model_json_digest`:
sorted keys, no spaces), so an edit of any value (two vocabulary ids
swapped, a checksum deleted) is refused while a reformatting is not. A
directory without either field is refused unless the caller opts out
(``require_checksums=False``: loaded with a warning). Every way a directory
can be damaged is refused with a :class:`~engramrt.errors.CheckpointError`
naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engramrt._io import atomic_write_bytes, read_json
from engramrt.errors import CheckpointError
from engramrt_lab.models.corpus import EvalSegments

__all__ = [
    "BASELINE_WEIGHTS",
    "BASELINE_WIDE_WEIGHTS",
    "CONFIG_JSON",
    "ENGRAM_TABLES",
    "ENGRAM_WEIGHTS",
    "HELDOUT_SAMPLE",
    "LOSS_CURVES",
    "MODEL_JSON",
    "MODEL_JSON_SHA256",
    "SHIPPED_FILES",
    "TRAIN_LOG",
    "file_checksums",
    "load_sample",
    "load_weights",
    "model_file",
    "model_json_digest",
    "parse_field",
    "read_model_json",
    "save_sample",
    "save_weights",
    "seal_model_json",
    "verify_checksum",
    "write_json",
    "write_model_json",
]

MODEL_JSON = "model.json"
MODEL_JSON_SHA256 = "model_json_sha256"
"""The field of ``model.json`` holding the SHA-256 of its other fields
(:func:`model_json_digest`)."""
CONFIG_JSON = "config.json"
ENGRAM_TABLES = "engram.safetensors"
ENGRAM_WEIGHTS = "engram_model.safetensors"
BASELINE_WEIGHTS = "baseline_model.safetensors"
BASELINE_WIDE_WEIGHTS = "baseline_wide_model.safetensors"
HELDOUT_SAMPLE = "heldout_sample.safetensors"
LOSS_CURVES = "loss_curves.png"
TRAIN_LOG = "train_log.json"
SHIPPED_FILES = (
    MODEL_JSON,
    CONFIG_JSON,
    ENGRAM_TABLES,
    ENGRAM_WEIGHTS,
    BASELINE_WEIGHTS,
    BASELINE_WIDE_WEIGHTS,
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


def _safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise CheckpointError(f"{what} {str(path)!r} does not exist")
    try:
        return dict(load_file(str(path)))
    except Exception as exc:  # safetensors raises its own errors for damaged files
        raise CheckpointError(
            f"{what} {str(path)!r} is not a readable safetensors file "
            f"({type(exc).__name__}: {str(exc)[:120]})"
        ) from exc


def load_weights(path: Path, model: nn.Module) -> None:
    """Load a file of :func:`save_weights` into ``model`` (every tensor, cast to the
    model's dtype); refused when a tensor is missing, extra, of another shape or
    holds a non-finite value."""
    tensors = _safetensors(path, "weights file")
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
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(
                f"{str(path)!r}: tensor {name!r} holds {bad} non-finite value(s); expected "
                f"finite weights"
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


_SAMPLE_KEYS = ("tokens", "lengths", "lookback", "starts", "positions")


def load_sample(path: Path) -> EvalSegments:
    """Read a file of :func:`save_sample`; refused unless its tensors agree in shape
    and its lengths fit the sequences."""
    t = _safetensors(path, "held-out sample")
    missing = [k for k in _SAMPLE_KEYS if k not in t]
    if missing:
        raise CheckpointError(f"held-out sample {str(path)!r} lacks tensor(s) {missing}")
    tokens, lengths = t["tokens"], t["lengths"]
    count = tokens.shape[0] if tokens.dim() == 2 else -1
    if (
        count < 1
        or any(
            t[k].dim() != 1 or t[k].shape[0] != count for k in ("lengths", "starts", "positions")
        )
        or t["lookback"].dim() != 2
        or t["lookback"].shape[0] != count
        or int(lengths.min()) < 2
        or int(lengths.max()) > tokens.shape[1]
        or int(tokens.min()) < 0
    ):
        raise CheckpointError(
            f"held-out sample {str(path)!r}: tensors of inconsistent shapes or values "
            f"(tokens {list(tokens.shape)}, lengths {list(lengths.shape)}); expected [M, S] "
            f"tokens with M lengths in [2, S]"
        )
    return EvalSegments(
        tokens.numpy().astype(np.int64),
        lengths.numpy().astype(np.int64),
        t["lookback"].numpy().astype(np.int64),
        t["starts"].numpy().astype(np.int64),
        t["positions"].numpy().astype(np.int64),
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_checksums(directory: Path, files: Mapping[str, str]) -> dict[str, str]:
    """SHA-256 of each named file of a model directory (by file name)."""
    return {name: _sha256(Path(directory) / name) for name in sorted(set(files.values()))}


def model_file(directory: Path, data: Mapping[str, Any], key: str) -> Path:
    """The path of ``files[key]`` of a model.json, refused unless it is a plain file
    name of a file inside ``directory``."""
    where = str(Path(directory) / MODEL_JSON)
    files = data.get("files")
    if not isinstance(files, Mapping) or key not in files:
        raise CheckpointError(f"{where!r}: field files.{key} is missing")
    name = files[key]
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise CheckpointError(
            f"{where!r}: files.{key}={name!r}; expected a file name inside the model directory"
        )
    path = Path(directory) / name
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise CheckpointError(f"{where!r}: files.{key}={name!r} is not a regular file")
    if not path.is_file():
        raise CheckpointError(f"{where!r}: files.{key}={name!r} does not exist")
    return path


def parse_field(directory: Path, data: Mapping[str, Any], key: str, parse: Any) -> Any:
    """``parse(data[key])``, any error in it refused as a :class:`CheckpointError` naming
    the file and the field."""
    try:
        return parse(data[key])
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{str(Path(directory) / MODEL_JSON)!r}: field {key!r} is not valid: "
            f"{type(exc).__name__}: {str(exc)[:160]}"
        ) from exc


def verify_checksum(
    directory: Path, data: Mapping[str, Any], path: Path, *, required: bool = True
) -> None:
    """Refuse a file whose SHA-256 is not the one ``model.json`` records.

    A ``model.json`` without ``checksums`` (written before they were recorded,
    or with the field deleted) is refused unless ``required`` is False: then
    the file is used unchecked, with a warning.
    """
    sums = data.get("checksums")
    where = str(Path(directory) / MODEL_JSON)
    if sums is None:
        if required:
            raise CheckpointError(
                f"{where!r}: field 'checksums' is missing, so {path.name} cannot be checked; "
                f"expected a directory written by python -m engramrt_lab.models.train (train "
                f"again), or load it with require_checksums=False to use it unchecked"
            )
        warnings.warn(
            f"{where!r} records no checksums: {path.name} is used unchecked "
            f"(require_checksums=False)",
            stacklevel=2,
        )
        return
    if not isinstance(sums, Mapping) or not isinstance(sums.get(path.name), str):
        raise CheckpointError(f"{where!r}: field checksums.{path.name} is missing")
    if _sha256(path) != sums[path.name]:
        raise CheckpointError(
            f"{str(path)!r}: SHA-256 differs from checksums.{path.name} in {where!r} (the file "
            f"changed after training)"
        )


def write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode("utf-8"))


def model_json_digest(data: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a ``model.json`` object without its ``model_json_sha256`` field, in
    a canonical form: keys sorted, no spaces, UTF-8 (floats as Python writes them, which
    read back bit for bit). Layout and key order do not change it; any value does."""
    fields = {k: v for k, v in data.items() if k != MODEL_JSON_SHA256}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal_model_json(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with its ``model_json_sha256`` field (re)computed."""
    fields = {k: v for k, v in data.items() if k != MODEL_JSON_SHA256}
    return {**fields, MODEL_JSON_SHA256: model_json_digest(fields)}


def write_model_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write a ``model.json`` atomically, sealed by :func:`seal_model_json`."""
    write_json(path, seal_model_json(data))


_REQUIRED = {
    "format": str,
    "lm": dict,
    "baseline_lm": dict,
    "engram": dict,
    "vocab": dict,
    "files": dict,
    "training": dict,
}


def read_model_json(directory: Path, *, require_checksums: bool = True) -> dict[str, Any]:
    """``model.json`` of a model directory, refused (naming the field) unless it is a
    UTF-8 JSON object whose ``model_json_sha256`` matches its content, with every
    section the loader reads.

    ``require_checksums=False`` accepts a ``model.json`` that records no
    ``model_json_sha256`` (with a warning); a recorded one is always checked.
    """
    path = Path(directory) / MODEL_JSON
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} does not exist; expected a directory written by "
            f"python -m engramrt_lab.models.train"
        )
    data = read_json(path, CheckpointError, repr(str(path)))
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{str(path)!r} holds a JSON {type(data).__name__}; expected an object"
        )
    _check_own_checksum(path, data, require_checksums)
    for key, kind in _REQUIRED.items():
        if key not in data:
            raise CheckpointError(f"{str(path)!r}: field {key!r} is missing")
        if not isinstance(data[key], kind):
            raise CheckpointError(
                f"{str(path)!r}: field {key!r} is a {type(data[key]).__name__}; expected a "
                f"{'JSON object' if kind is dict else 'string'}"
            )
    _check_numbers(path, data["training"], "training")
    return data


def _check_own_checksum(path: Path, data: dict[str, Any], required: bool) -> None:
    recorded = data.get(MODEL_JSON_SHA256)
    if recorded is None:
        if required:
            raise CheckpointError(
                f"{str(path)!r}: field {MODEL_JSON_SHA256!r} is missing, so its content (the "
                f"vocabulary, the configs, the other files' checksums) cannot be checked; "
                f"expected a directory written by python -m engramrt_lab.models.train (train "
                f"again), or load it with require_checksums=False to use it unchecked"
            )
        warnings.warn(
            f"{str(path)!r} records no {MODEL_JSON_SHA256}: its content is used unchecked "
            f"(require_checksums=False)",
            stacklevel=3,
        )
        return
    found = model_json_digest(data)
    if recorded != found:
        raise CheckpointError(
            f"{str(path)!r}: its content gives SHA-256 {found} but field "
            f"{MODEL_JSON_SHA256!r} records {recorded!r}: model.json changed after training "
            f"(edited or corrupted); expected the file as training wrote it"
        )


def _check_numbers(path: Path, value: Any, where: str) -> None:
    """Refuse non-finite numbers in the record (the loss checks compare with them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"{str(path)!r}: field {where}={value}; expected a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("heldout", "package_heldout", "losses", "sample_losses") or isinstance(
                item, float
            ):
                _check_numbers(path, item, f"{where}.{key}")
