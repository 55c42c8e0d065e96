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
``engramrt_token_map``      the hash contract: the fingerprint of the token map
                            and layout the rows were hashed with, JSON of
                            :meth:`engramrt.tokenmap.TokenMapFingerprint.to_dict`
                            (written by ``engramrt convert``)
``engramrt_family``         the memory family whose tables the file holds, for
                            families other than DeepSeek Engram (``"qwen4-ple"``;
                            absent: DeepSeek Engram)
``engramrt_fingerprint``    that family's :meth:`~engramrt.family.MemoryFamily.fingerprint`
                            (:func:`check_family`)
==========================  ===================================================

A reader uses ``engramrt_layers`` to map a tensor's local row 0 to global
row ``row_begin``: that is how a rank's file of a ``--tp N`` conversion
serves its shard without the rest of the table. A tensor without such an
entry (any file engramrt did not write, e.g. DeepSeek's) holds the full
table, global row ``i`` at local row ``i``.

The hash contract (:func:`check_token_map`): rows are only meaningful under
the hash they were trained with, and a tokenizer revision can keep the
compressed vocabulary size while moving ids. A conversion records the
fingerprint of its token map (the one passed, else the DeepSeek-V4 map when
it fits the config); loading compares it with the map in use and refuses a
difference with a :class:`~engramrt.errors.TokenizerError` naming each
differing field. A converted file without a fingerprint (an older engramrt,
or a conversion no map fitted) loads with a :class:`TokenMapWarning`. Files
engramrt did not convert (DeepSeek's, :func:`save_tables` output) record
no hash contract and load as before.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError, TokenizerError
from engramrt.hashing.fingerprint import check_fingerprint
from engramrt.hashing.fingerprint import fingerprint as token_map_fingerprint
from engramrt.tokenmap import TokenMap, TokenMapFingerprint, TokenMapWarning, default_token_map

__all__ = [
    "META_CONFIG",
    "META_CONFIG_JSON",
    "META_FAMILY",
    "META_FINGERPRINT",
    "META_LAYERS",
    "META_RANK",
    "META_SCALES",
    "META_TOKEN_MAP",
    "META_TP",
    "META_VERSION",
    "LayerSlot",
    "RowRange",
    "build_metadata",
    "check_family",
    "check_token_map",
    "family_metadata",
    "read_token_map_fingerprint",
    "tensor_row_ranges",
    "token_map_metadata",
]

META_VERSION = "engramrt_version"
META_CONFIG = "engramrt_config"
META_CONFIG_JSON = "engramrt_config_json"
META_TP = "engramrt_tp"
META_RANK = "engramrt_rank"
META_SCALES = "engramrt_scale_dtype"
META_LAYERS = "engramrt_layers"
META_TOKEN_MAP = "engramrt_token_map"
META_FAMILY = "engramrt_family"
META_FINGERPRINT = "engramrt_fingerprint"
# Written by every conversion (see engramrt.checkpoint.conversion_set); repeated
# here so that this module does not import the conversion machinery.
_META_CONVERSION_ID = "engramrt_conversion_id"


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


def token_map_metadata(config: EngramConfig, token_map: TokenMap | None) -> dict[str, str]:
    """The ``engramrt_token_map`` entry a conversion records, or ``{}`` with a warning.

    ``token_map`` None means the DeepSeek-V4 map, recorded when it fits the
    config; when it does not, nothing can be recorded and a
    :class:`TokenMapWarning` says so (pass the tokenizer the model uses).

    Raises:
        TokenizerError: ``token_map`` was given and does not fit ``config``.
    """
    if token_map is None:
        default = default_token_map()
        if default.num_compressed != config.compressed_vocab_size:
            warnings.warn(
                f"no token map fingerprint recorded: the DeepSeek-V4 tokenizer compresses to "
                f"{default.num_compressed:,} ids but engram_compressed_vocab_size="
                f"{config.compressed_vocab_size:,}; pass token_map= (the model's tokenizer) so "
                f"that loading can refuse rows hashed with another map",
                TokenMapWarning,
                stacklevel=3,
            )
            return {}
        token_map = default
    fingerprint = token_map_fingerprint(token_map, config)
    return {META_TOKEN_MAP: json.dumps(fingerprint.to_dict(), separators=(",", ":"))}


def read_token_map_fingerprint(
    metadata: Mapping[str, str], file: object
) -> TokenMapFingerprint | None:
    """The fingerprint a file records (``None`` if it records none)."""
    raw = metadata.get(META_TOKEN_MAP)
    if raw is None:
        return None
    try:
        return TokenMapFingerprint.from_dict(json.loads(raw))
    except (json.JSONDecodeError, TokenizerError) as exc:
        raise CheckpointError(f"{file}: metadata {META_TOKEN_MAP} is malformed: {exc}") from exc


def check_token_map(
    metadata_by_file: Mapping[Path, Mapping[str, str]],
    config: EngramConfig,
    token_map: TokenMap | None,
) -> None:
    """Refuse files whose rows were hashed with another token map than ``token_map``.

    Args:
        metadata_by_file: the ``__metadata__`` of each file rows are read from.
        config: the config the rows are served with.
        token_map: the map in use; None: the DeepSeek-V4 map (built only if
            some file records a fingerprint).

    Raises:
        TokenizerError: a file's fingerprint differs from the map in use
            (every differing field named, both values).
        CheckpointError: a recorded fingerprint is malformed.

    Warns:
        TokenMapWarning: a converted file records no fingerprint.
    """
    for file, metadata in metadata_by_file.items():
        recorded = read_token_map_fingerprint(metadata, file)
        if recorded is None:
            if _META_CONVERSION_ID in metadata:
                warnings.warn(
                    f"{file} records no token map fingerprint (converted by an older engramrt, "
                    f"or without a token map that fits its config): the rows are served without "
                    f"checking that they were hashed with the token map in use; convert it "
                    f"again to record one",
                    TokenMapWarning,
                    stacklevel=4,
                )
            continue
        if token_map is None:
            token_map = default_token_map()
        check_fingerprint(token_map, recorded, config, where=str(file))


def family_metadata(family: str, fingerprint: str, *, tp: int, rank: int) -> dict[str, str]:
    """The ``__metadata__`` entries of a file of family ``family``'s tables: the format, the
    engramrt version, the family and its fingerprint, and the rank of ``tp`` it serves."""
    from engramrt import __version__

    return {
        "format": "pt",
        META_VERSION: __version__,
        META_FAMILY: family,
        META_FINGERPRINT: fingerprint,
        META_TP: str(tp),
        META_RANK: str(rank),
    }


def check_family(metadata: Mapping[str, str], file: object, family: str, fingerprint: str) -> None:
    """Refuse a file written for another family, or for the family hashed otherwise.

    The fingerprint covers everything that decides which row a token reads (for Qwen4-Exp
    PLE: the hash constants, EOS, N and H): rows written under another one are other rows.

    Raises:
        CheckpointError: naming the file, the field, the value it records and the one
            expected.
    """
    recorded = metadata.get(META_FAMILY)
    if recorded != family:
        raise CheckpointError(
            f"{file} records {META_FAMILY}={recorded!r}; expected {family!r} (a file converted "
            f"for the family being loaded)"
        )
    recorded = metadata.get(META_FINGERPRINT)
    if recorded != fingerprint:
        raise CheckpointError(
            f"{file} records {META_FINGERPRINT}={recorded!r}; the config gives {fingerprint!r}: "
            f"its rows were hashed with other constants (another seed, EOS, vocab size or "
            f"layer list); convert again with this config"
        )
