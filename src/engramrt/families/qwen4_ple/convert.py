"""Convert a Qwen4-Exp checkpoint's PLE tables into per-rank files (``engramrt convert``).

Each output holds, per PLE layer, one tensor-parallel rank's values of every row
(:meth:`PleTableRegion.width_shard`) as bf16, copied bit for bit (no quantisation: the
tables are served in bf16), with the metadata of :mod:`engramrt.families.qwen4_ple.converted`
(family, fingerprint, layer, the rank's value range). ``tp=1`` writes ``ple.safetensors``
(or the ``.safetensors`` path given); ``tp=N`` writes ``ple-rank<r>-of-<N>.safetensors``
into a directory. The files are committed as the Engram converter's are
(:func:`engramrt.checkpoint.convert.commit_conversion`): staged, then the manifest, then
renamed, so they appear only once complete and an interrupted conversion leaves nothing a
loader reads. The source may itself be a conversion (a tp=4 set from a tp=1 one).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engramrt.checkpoint.conversion_set import is_output_name, kill_point
from engramrt.checkpoint.convert import CONVERSION_PLACEHOLDERS, commit_conversion, output_paths
from engramrt.checkpoint.reader import SafetensorsCheckpoint, open_checkpoint
from engramrt.checkpoint.safetensors_format import SafetensorsStreamWriter, TensorSpec
from engramrt.checkpoint.writer import FileLayout, tensor_bytes
from engramrt.errors import CheckpointError, ValidationError
from engramrt.families.qwen4_ple.converted import (
    STORED_DTYPE,
    PleRankRead,
    PleTableSlot,
    iter_ple_rank_blocks,
    plan_ple_rank_read,
    ple_file_metadata,
    ple_rank_region,
)
from engramrt.families.qwen4_ple.family import Qwen4PleFamily
from engramrt.families.qwen4_ple.loading import FamilySource, ple_family

__all__ = [
    "OUTPUT_STEM",
    "PleConversionPlan",
    "convert_ple_checkpoint",
    "plan_ple_conversion",
    "run_ple_conversion",
]

OUTPUT_STEM = "ple"
"""Converted files are ``ple.safetensors`` / ``ple-rank<r>-of-<N>.safetensors``."""


@dataclass(frozen=True)
class PleConversionPlan:
    """A checked conversion: per output file (one per rank), per PLE layer, what to read.

    Attributes:
        family: the family (config, constants, fingerprint) the files are written for.
        reads: ``reads[rank][k]``: rank ``rank``'s values of the ``k``-th PLE layer.
        files: the outputs, one per rank.
        tp: tensor-parallel size of the outputs.
        directory_set: the outputs are named by engramrt in the DST directory, which also
            gets the set's manifest.
    """

    family: Qwen4PleFamily
    reads: tuple[tuple[PleRankRead, ...], ...]
    files: tuple[FileLayout, ...]
    tp: int
    directory_set: bool

    @property
    def num_rows(self) -> int:
        """Rows written in all (the progress total: each table's rows once per file)."""
        return sum(read.region.num_rows for reads in self.reads for read in reads)

    @property
    def nbytes(self) -> int:
        """Bytes written in all."""
        return sum(f.nbytes for f in self.files)


def plan_ple_conversion(
    src: SafetensorsCheckpoint | str | os.PathLike[str],
    dst: str | os.PathLike[str],
    config: FamilySource,
    *,
    tp: int = 1,
    prefix: str | None = None,
) -> PleConversionPlan:
    """Locate and check every PLE table of ``src`` and lay out every output; writes nothing.

    Raises:
        CheckpointError: SRC is missing, a table is missing, malformed or not bf16 (see
            :func:`~engramrt.families.qwen4_ple.converted.plan_ple_rank_read`); DST is a
            source file.
        ValidationError: ``tp`` is not an int >= 1, or leaves a rank no value of a row.
    """
    family = ple_family(config)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValidationError(f"tp={tp!r}; expected a tensor-parallel size, an int >= 1")
    checkpoint = open_checkpoint(src)
    paths = output_paths(dst, tp, stem=OUTPUT_STEM)
    reads, files = [], []
    for rank, path in enumerate(paths):
        rank_reads = tuple(
            plan_ple_rank_read(
                checkpoint, family, index, ple_rank_region(family, index, tp, rank), prefix=prefix
            )
            for index in range(family.config.n_layers)
        )
        reads.append(rank_reads)
        files.append(_file_layout(path, family, rank_reads, tp, rank))
    sources = {file.absolute() for rank_reads in reads for r in rank_reads for file in r.files}
    for path in paths:
        if path.absolute() in sources:
            raise CheckpointError(f"DST {str(path)!r} is a source file; expected another path")
    directory_set = all(is_output_name(path.name) for path in paths) and not (
        Path(dst).suffix == ".safetensors" or Path(dst).is_file()
    )
    return PleConversionPlan(family, tuple(reads), tuple(files), tp, directory_set)


def _file_layout(
    path: Path, family: Qwen4PleFamily, reads: Sequence[PleRankRead], tp: int, rank: int
) -> FileLayout:
    """The tensors (one per PLE layer, ``[R, w]`` bf16) and metadata of rank ``rank``'s file."""
    width = family.config.table_width
    slots = [
        PleTableSlot(
            read.ple_index,
            read.layer_id,
            read.name,
            read.region.num_rows,
            width,
            read.region.value_begin,
            read.region.value_end,
        )
        for read in reads
    ]
    specs = tuple(TensorSpec(s.name, STORED_DTYPE, (s.rows, s.num_values)) for s in slots)
    metadata = {**ple_file_metadata(family, slots, tp=tp, rank=rank), **CONVERSION_PLACEHOLDERS}
    return FileLayout(path, (), specs, metadata, tp, rank)


def run_ple_conversion(
    plan: PleConversionPlan,
    *,
    block_rows: int | None = None,
    on_rows: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write what ``plan`` describes, as one conversion set; returns the files written.

    Args:
        plan: from :func:`plan_ple_conversion`.
        block_rows: rows copied per block (default: about ``DEFAULT_BLOCK_BYTES``).
        on_rows: called with the rows of each block (progress).

    Raises:
        CapacityError: the destination file system has too little free space.
        CheckpointError: a source block holds NaN or inf.
    """

    def fill(writers: Sequence[SafetensorsStreamWriter]) -> None:
        for rank_reads, writer in zip(plan.reads, writers, strict=True):
            for read in rank_reads:
                for _local_row, block in iter_ple_rank_blocks(read, block_rows=block_rows):
                    writer.append(read.name, tensor_bytes(block))  # bf16 bytes as stored
                    if on_rows is not None:
                        on_rows(block.shape[0])
                    kill_point("convert:block")

    return commit_conversion(plan.files, tp=plan.tp, directory_set=plan.directory_set, fill=fill)


def convert_ple_checkpoint(
    src: SafetensorsCheckpoint | str | os.PathLike[str],
    dst: str | os.PathLike[str],
    config: FamilySource,
    *,
    tp: int = 1,
    prefix: str | None = None,
    block_rows: int | None = None,
    on_rows: Callable[[int], None] | None = None,
) -> list[Path]:
    """:func:`plan_ple_conversion` then :func:`run_ple_conversion`; returns the files written."""
    plan = plan_ple_conversion(src, dst, config, tp=tp, prefix=prefix)
    return run_ple_conversion(plan, block_rows=block_rows, on_rows=on_rows)
