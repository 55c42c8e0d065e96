"""Where a tensor-parallel rank's part of a PLE table comes from: the model's own checkpoint,
or the per-rank files ``engramrt convert`` writes for Qwen4-Exp, and the format of those.

A converted file (:func:`ple_file_metadata`) holds, per PLE layer, one bf16 tensor under the
runtime parameter's name ``<P>layers.<i>.ple.ple_embedding.ngram_embedding.weight``: every
row of the ``[R, d]`` table and of each row the values ``[value_begin, value_end)`` of one
rank (:meth:`PleTableRegion.width_shard`, the TP plan ``embedding_colwise``). Its
``__metadata__`` (all strings) records:

==========================  =============================================================
key                         value
==========================  =============================================================
``engramrt_family``         ``"qwen4-ple"``
``engramrt_fingerprint``    :meth:`Qwen4PleFamily.fingerprint` of the config converted with
``engramrt_tp``             tensor-parallel size of the conversion (``"1"``: whole rows)
``engramrt_rank``           the rank whose values the file holds
``engramrt_config_json``    the text config, JSON (:meth:`PleConfig.to_hf_dict`)
``engramrt_ple_tables``     JSON list, one object per PLE layer: ``ple_index``, ``layer``
                            (the one-indexed ``ple_layer_ids`` entry), ``name`` (the
                            tensor), ``rows`` (``R``), ``width`` (``d``), ``value_begin``,
                            ``value_end`` (:class:`PleTableSlot`)
==========================  =============================================================

plus the conversion id and content digest every conversion writes
(:mod:`engramrt.checkpoint.conversion_set`). A loader reads a rank's values from whichever
converted files hold them (a tp=2 rank from a tp=4 or a tp=1 conversion), after refusing a
file of another family or fingerprint, and a file whose tensor disagrees with its metadata.
When a checkpoint holds converted PLE files, only those are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engramrt.checkpoint.metadata import (
    META_CONFIG_JSON,
    META_FAMILY,
    META_RANK,
    META_TP,
    check_family,
    family_metadata,
)
from engramrt.checkpoint.reader import (
    SafetensorsCheckpoint,
    TensorLocation,
    check_block_rows,
    safe_slice,
)
from engramrt.errors import CheckpointError, ValidationError
from engramrt.families.qwen4_ple.checkpoint import (
    PleTablePlan,
    PleTableRegion,
    iter_ple_table_blocks,
    plan_ple_table,
)
from engramrt.families.qwen4_ple.family import Qwen4PleFamily

__all__ = [
    "META_PLE_TABLES",
    "PleConvertedPiece",
    "PleRankRead",
    "PleTableSlot",
    "converted_ple_files",
    "iter_ple_rank_blocks",
    "plan_ple_rank_read",
    "ple_file_metadata",
    "ple_rank_region",
    "read_ple_slots",
]

META_PLE_TABLES = "engramrt_ple_tables"
STORED_DTYPE = "BF16"
"""The dtype of converted tables, and the only one a bf16 store is filled from (a wider
source would be rounded on the way in: refused instead)."""


@dataclass(frozen=True)
class PleTableSlot:
    """The part of PLE layer ``ple_index``'s ``[rows, width]`` table that one converted file
    holds under ``name``: every row, values ``[value_begin, value_end)`` of each."""

    ple_index: int
    layer_id: int
    name: str
    rows: int
    width: int
    value_begin: int
    value_end: int

    @property
    def num_values(self) -> int:
        return self.value_end - self.value_begin

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["layer"] = record.pop("layer_id")
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> PleTableSlot:
        ints = ("ple_index", "layer", "rows", "width", "value_begin", "value_end")
        if not isinstance(record, Mapping) or not isinstance(record.get("name"), str):
            raise ValueError(f"entry {record!r} has no tensor name")
        values = {key: record[key] for key in ints}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values.values()):
            raise ValueError(f"entry {dict(record)!r}: expected ints for {', '.join(ints)}")
        slot = cls(
            values["ple_index"],
            values["layer"],
            record["name"],
            values["rows"],
            values["width"],
            values["value_begin"],
            values["value_end"],
        )
        if not 0 <= slot.value_begin < slot.value_end <= slot.width or slot.rows < 0:
            raise ValueError(
                f"entry for {slot.name!r}: values [{slot.value_begin}, {slot.value_end}) of "
                f"width {slot.width}, {slot.rows} rows"
            )
        return slot


def ple_file_metadata(
    family: Qwen4PleFamily, slots: list[PleTableSlot], *, tp: int, rank: int
) -> dict[str, str]:
    """The ``__metadata__`` of a converted file holding ``slots`` (see the module doc)."""
    metadata = family_metadata(family.name, family.fingerprint(), tp=tp, rank=rank)
    metadata[META_CONFIG_JSON] = json.dumps(family.config.to_hf_dict(), separators=(",", ":"))
    metadata[META_PLE_TABLES] = json.dumps([s.to_dict() for s in slots], separators=(",", ":"))
    return metadata


def read_ple_slots(metadata: Mapping[str, str], file: object) -> list[PleTableSlot]:
    """The :class:`PleTableSlot` entries a converted file records.

    Raises:
        CheckpointError: ``engramrt_ple_tables`` is missing or malformed (naming the file).
    """
    raw = metadata.get(META_PLE_TABLES)
    if raw is None:
        raise CheckpointError(
            f"{file} records {META_FAMILY}={metadata.get(META_FAMILY)!r} but no "
            f"{META_PLE_TABLES}; expected the PLE tables it holds (convert again)"
        )
    try:
        records = json.loads(raw)
        if not isinstance(records, list):
            raise ValueError("not a list")
        return [PleTableSlot.from_dict(record) for record in records]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file}: metadata {META_PLE_TABLES} is malformed: {exc}") from exc


def converted_ple_files(ckpt: SafetensorsCheckpoint) -> dict[Path, Mapping[str, str]]:
    """The checkpoint's files that engramrt converted for a memory family (those recording
    ``engramrt_family`` or ``engramrt_ple_tables``), with their metadata."""
    found: dict[Path, Mapping[str, str]] = {}
    for file in ckpt.files:
        metadata = ckpt.header(file).metadata
        if META_FAMILY in metadata or META_PLE_TABLES in metadata:
            found[file] = metadata
    return found


def ple_rank_region(family: Qwen4PleFamily, ple_index: int, tp: int, rank: int) -> PleTableRegion:
    """Rank ``rank`` of ``tp``'s part of PLE layer ``ple_index``'s table
    (:meth:`PleTableRegion.width_shard`), refused when it holds no value (a store row holds
    at least one)."""
    rows, width = family.constants.table_rows[ple_index], family.config.table_width
    region = PleTableRegion.width_shard(rows, width, tp, rank)
    if region.num_values == 0:
        raise ValidationError(
            f"tp={tp} leaves rank {rank} no value of the PLE table rows (d = ple_embed_dim / C "
            f"= {width}, split in pieces of ceil(d / tp) = {-(-width // tp)}); expected a tp "
            f"that gives every rank at least one value: one of {_valid_tps(width)}"
        )
    return region


def _valid_tps(width: int) -> str:
    """The tp values whose every rank gets values of a ``width``-value row under torch.chunk."""
    valid = [str(tp) for tp in range(1, width + 1) if -(-width // tp) * (tp - 1) < width]
    return ", ".join(valid[:8]) + (f", ... {valid[-1]}" if len(valid) > 8 else "")


# -- a rank's read ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PleConvertedPiece:
    """Global values ``[value_begin, value_end)`` of every row, read from a converted file."""

    slot: PleTableSlot
    location: TensorLocation
    value_begin: int
    value_end: int


@dataclass(frozen=True)
class PleRankRead:
    """A checked plan to read ``region`` of PLE layer ``ple_index``'s table: from the model's
    checkpoint (``source``) or from converted files (``pieces``, in value order)."""

    ple_index: int
    layer_id: int
    name: str
    """The table's runtime name, which converted files store it under."""
    region: PleTableRegion
    source: PleTablePlan | None
    pieces: tuple[PleConvertedPiece, ...]

    @property
    def files(self) -> list[Path]:
        """The files the rows come from."""
        if self.source is not None:
            return sorted({p.location.file for p in self.source.pieces})
        return sorted({p.location.file for p in self.pieces})


def plan_ple_rank_read(
    ckpt: SafetensorsCheckpoint,
    family: Qwen4PleFamily,
    ple_index: int,
    region: PleTableRegion,
    *,
    prefix: str | None = None,
) -> PleRankRead:
    """Locate and check ``region`` of PLE layer ``ple_index``'s table, reading no rows.

    From converted files when the checkpoint holds any (:func:`converted_ple_files`), else
    from the model's tensors (:func:`plan_ple_table`, whose checks apply), which must be
    stored in bf16 (the store's format; a wider dtype would be rounded).

    Raises:
        CheckpointError: a converted file of another family or fingerprint, one whose
            tensor does not match its metadata, values of the region no file holds; a table
            not stored in bf16; every refusal of :func:`plan_ple_table`.
    """
    cfg = family.config
    layer_id = cfg.ple_layer_ids[ple_index]
    converted = converted_ple_files(ckpt)
    if not converted:
        plan = plan_ple_table(ckpt, cfg, ple_index, prefix=prefix)
        if plan.dtype != torch.bfloat16:
            raise CheckpointError(
                f"the PLE table {plan.pieces[0].name!r} (layer {layer_id}) is stored in "
                f"{plan.dtype}; expected torch.bfloat16, the format of its rows in a store "
                f"(reading it into bf16 would round it)"
            )
        name = f"{plan.prefix}layers.{plan.decoder_layer}.ple.ple_embedding.ngram_embedding.weight"
        return PleRankRead(ple_index, layer_id, name, region, plan, ())
    pieces = _converted_pieces(ckpt, family, ple_index, converted)
    return PleRankRead(
        ple_index, layer_id, pieces[0].slot.name, region, None, _cover(pieces, region, layer_id)
    )


def _converted_pieces(
    ckpt: SafetensorsCheckpoint,
    family: Qwen4PleFamily,
    ple_index: int,
    converted: Mapping[Path, Mapping[str, str]],
) -> list[PleConvertedPiece]:
    """Every converted file's part of layer ``ple_index``, each checked against the config."""
    rows, width = family.constants.table_rows[ple_index], family.config.table_width
    layer_id = family.config.ple_layer_ids[ple_index]
    fingerprint = family.fingerprint()
    found = []
    for file, metadata in sorted(converted.items()):
        check_family(metadata, file, family.name, fingerprint)
        for slot in read_ple_slots(metadata, file):
            if slot.ple_index != ple_index:
                continue
            where = f"{file}: PLE table {slot.name!r}"
            if (slot.layer_id, slot.rows, slot.width) != (layer_id, rows, width):
                raise CheckpointError(
                    f"{where} records layer {slot.layer_id}, {slot.rows} rows of width "
                    f"{slot.width}; expected PLE index {ple_index} = layer {layer_id}, R = {rows} "
                    f"rows of d = {width} (the config's)"
                )
            entry = ckpt.header(file).tensors.get(slot.name)
            expected = (rows, slot.num_values)
            if entry is None or entry.dtype != STORED_DTYPE or tuple(entry.shape) != expected:
                got = "is missing" if entry is None else f"is {entry.dtype} {list(entry.shape)}"
                raise CheckpointError(
                    f"{where} {got}; expected {STORED_DTYPE} {list(expected)} (its metadata says "
                    f"it holds values [{slot.value_begin}, {slot.value_end}) of every row)"
                )
            location = TensorLocation(slot.name, file, entry, None, ckpt)
            found.append(PleConvertedPiece(slot, location, slot.value_begin, slot.value_end))
    if not found:
        files = ", ".join(file.name for file in sorted(converted))
        raise CheckpointError(
            f"the converted files {files} hold no table of PLE layer {layer_id} (index "
            f"{ple_index}); expected a conversion of every PLE layer of the config"
        )
    return found


def _cover(
    pieces: list[PleConvertedPiece], region: PleTableRegion, layer_id: int
) -> tuple[PleConvertedPiece, ...]:
    """Greedy cover of the region's values by the files' value ranges (widest reach first)."""
    chosen: list[PleConvertedPiece] = []
    cursor = region.value_begin
    while cursor < region.value_end:
        usable = [p for p in pieces if p.value_begin <= cursor < p.value_end]
        if not usable:
            held = "; ".join(
                f"{p.location.file.name} ({_rank_of(p)}): [{p.value_begin}, {p.value_end})"
                for p in sorted(pieces, key=lambda p: p.value_begin)
            )
            raise CheckpointError(
                f"no converted file holds value {cursor} of PLE layer {layer_id}'s rows: this "
                f"rank needs values [{region.value_begin}, {region.value_end}) and the files "
                f"hold {held}; expected the files of a conversion covering this rank (convert "
                f"with --tp equal to the load's, or a divisor of it)"
            )
        best = max(usable, key=lambda p: p.value_end)
        end = min(best.value_end, region.value_end)
        chosen.append(PleConvertedPiece(best.slot, best.location, cursor, end))
        cursor = end
    return tuple(chosen)


def _rank_of(piece: PleConvertedPiece) -> str:
    """``"rank r of tp=N"`` as the piece's file records it."""
    assert piece.location.checkpoint is not None
    metadata = piece.location.checkpoint.header(piece.location.file).metadata
    return f"rank {metadata.get(META_RANK)} of tp={metadata.get(META_TP)}"


def iter_ple_rank_blocks(
    read: PleRankRead, *, block_rows: int | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Stream a plan's rows: ``(local_row, block [n, region values] bf16)``, ``n <=
    block_rows`` (default: about ``DEFAULT_BLOCK_BYTES``), in row order, local rows counted
    from ``region.row_begin``; each block refused when it holds NaN or inf."""
    region = read.region
    if read.source is not None:
        return iter_ple_table_blocks(read.source, region, block_rows=block_rows)
    rows_per_block = check_block_rows(block_rows, 2 * max(1, region.num_values))
    return _iter_converted(read, rows_per_block)


def _iter_converted(read: PleRankRead, block_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    region = read.region
    if region.num_rows == 0 or region.num_values == 0:
        return
    slices = [
        safe_slice(p.location.file, p.location.name, p.location.open_path) for p in read.pieces
    ]
    for begin in range(region.row_begin, region.row_end, block_rows):
        end = min(begin + block_rows, region.row_end)
        parts = []
        for piece, stored in zip(read.pieces, slices, strict=True):
            offset = piece.slot.value_begin
            try:
                part = stored[begin:end, piece.value_begin - offset : piece.value_end - offset]
            except Exception as exc:  # safetensors raises its own error types here
                raise CheckpointError(
                    f"{piece.location.file}: reading rows [{begin}, {end}) of "
                    f"{piece.location.name!r} failed: {exc}"
                ) from exc
            _check_finite(part, piece, begin)
            parts.append(part)
        block = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [n, region values]
        yield begin - region.row_begin, block


def _check_finite(part: torch.Tensor, piece: PleConvertedPiece, row_begin: int) -> None:
    bad = ~torch.isfinite(part)
    if bool(bad.any()):
        row, col = (int(v) for v in torch.nonzero(bad)[0])
        raise CheckpointError(
            f"{piece.location.file}: tensor {piece.location.name!r} holds {float(part[row, col])} "
            f"at row {row_begin + row} value {piece.value_begin + col}; expected finite values"
        )
