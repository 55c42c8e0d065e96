"""What engramrt records in the ``__metadata__`` of the files it writes.

Every value is a string (the safetensors format allows nothing else):

==========================  ===================================================
key                         value
==========================  ===================================================
``format``                  ``"pt"`` (what Hugging Face loaders expect)
``engramrt_version``        the engramrt version that wrote the file
``engramrt_config``         the config's name (``"tiny"``, a path, ...)
``engramrt_config_json``    the config's HF fields, JSON
``engramrt_tp``             tensor-parallel size of the file (``"1"``: full tables)
``engramrt_rank``           the rank whose rows the file holds
``engramrt_scale_dtype``    ``"uint8"`` or ``"e8m0"``
``engramrt_conversion_id``  the conversion that wrote the file (a uuid4 hex,
                            the same in every file of one ``engramrt convert``;
                            see :mod:`engramrt.checkpoint.conversion_set`)
``engramrt_layers``         JSON list, one object per Engram layer: ``layer``,
                            ``layer_index``, ``weight``, ``scale`` (tensor
                            names), ``num_embeddings`` (rows of the full
                            table), ``row_begin``, ``row_end`` (the global rows
                            this file's tensors hold), ``col_begin``,
                            ``col_end`` (the hash columns they serve)
==========================  ===================================================

A reader uses ``engramrt_layers`` to map a tensor's local row 0 to global
row ``row_begin``: that is how a rank's file of a ``--tp N`` conversion
serves its shard without the rest of the table. A tensor without such an
entry (any file engramrt did not write, e.g. DeepSeek's) holds the full
table, global row ``i`` at local row ``i``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError

__all__ = [
    "META_CONFIG",
    "META_CONFIG_JSON",
    "META_LAYERS",
    "META_RANK",
    "META_SCALES",
    "META_TP",
    "META_VERSION",
    "LayerSlot",
    "RowRange",
    "build_metadata",
    "tensor_row_ranges",
]

META_VERSION = "engramrt_version"
META_CONFIG = "engramrt_config"
META_CONFIG_JSON = "engramrt_config_json"
META_TP = "engramrt_tp"
META_RANK = "engramrt_rank"
META_SCALES = "engramrt_scale_dtype"
META_LAYERS = "engramrt_layers"


@dataclass(frozen=True)
class LayerSlot:
    """The rows of one Engram layer that one file holds, and under which names."""

    layer_index: int
    layer_id: int
    weight: str
    scale: str
    num_embeddings: int
    row_begin: int
    row_end: int
    col_begin: int
    col_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_begin

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer_id,
            "layer_index": self.layer_index,
            **{k: v for k, v in asdict(self).items() if k not in ("layer_id", "layer_index")},
        }


@dataclass(frozen=True)
class RowRange:
    """Global rows ``[row_begin, row_end)`` of a full table of ``num_embeddings`` rows."""

    row_begin: int
    row_end: int
    num_embeddings: int
    layer_id: int
    tp: int | None
    rank: int | None


def build_metadata(
    config: EngramConfig,
    slots: Sequence[LayerSlot],
    *,
    scale_dtype: str,
    tp: int,
    rank: int,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``__metadata__`` of a file holding ``slots``; ``extra`` keys are added first."""
    from engramrt import __version__

    metadata: dict[str, str] = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata[{key!r}] = {value!r}; expected str -> str")
        if key.startswith("engramrt_") or key == "format":
            raise CheckpointError(f"metadata key {key!r} is reserved for engramrt")
        metadata[key] = value
    metadata.update(
        {
            "format": "pt",
            META_VERSION: __version__,
            META_CONFIG: config.name,
            META_CONFIG_JSON: json.dumps(config.to_hf_dict(), separators=(",", ":")),
            META_TP: str(tp),
            META_RANK: str(rank),
            META_SCALES: scale_dtype,
            META_LAYERS: json.dumps([s.to_dict() for s in slots], separators=(",", ":")),
        }
    )
    return metadata


def tensor_row_ranges(metadata: Mapping[str, str], file: object) -> dict[str, RowRange]:
    """Tensor name -> the global rows it holds, from a file's ``engramrt_layers`` (if any)."""
    raw = metadata.get(META_LAYERS)
    if raw is None:
        return {}
    try:
        layers = json.loads(raw)
        tp = int(metadata[META_TP]) if META_TP in metadata else None
        rank = int(metadata[META_RANK]) if META_RANK in metadata else None
        ranges: dict[str, RowRange] = {}
        for layer in layers:
            row_range = RowRange(
                int(layer["row_begin"]),
                int(layer["row_end"]),
                int(layer["num_embeddings"]),
                int(layer["layer"]),
                tp,
                rank,
            )
            if not 0 <= row_range.row_begin <= row_range.row_end <= row_range.num_embeddings:
                raise ValueError(f"rows [{row_range.row_begin}, {row_range.row_end}) out of range")
            ranges[str(layer["weight"])] = row_range
            ranges[str(layer["scale"])] = row_range
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file}: metadata {META_LAYERS} is malformed: {exc}") from exc
    return ranges
