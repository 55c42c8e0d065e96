"""Quantise float Engram tables into fp8 + ue8m0 safetensors files.

The source is a safetensors checkpoint (file or directory, see
:class:`~engramrt.checkpoint.reader.SafetensorsCheckpoint`) holding, per
Engram layer, a float table ``[num_embeddings, E]`` (bf16, fp16 or fp32):
what a model trained with DeepSeek's demo code saves for its
``nn.Embedding``. The role ``source`` of
:class:`~engramrt.checkpoint.names.TensorNames` names it.

The destination is one file of full tables (``tp=1``) or one file per
tensor-parallel rank holding only that rank's rows (``tp=N``), named by
:func:`output_paths`. Rows go through
:func:`engramrt.quant.quantize_rows` (SPEC §6, bit for bit) one block at a
time: a block of ``block_rows`` source rows is read with ``get_slice``,
quantised and appended to the output, so memory stays bounded by a few
blocks whatever the table size. All outputs of one conversion carry one
conversion id and are committed together (staged files, then the manifest,
then renames): see :mod:`engramrt.checkpoint.conversion_set`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engramrt._io import atomic_write_bytes, fsync_directory
from engramrt.checkpoint.conversion_set import (
    MANIFEST_NAME,
    META_CONVERSION_ID,
    OUTPUT_STEMS,
    ConversionManifest,
    conversion_lock,
    file_conversion_id,
    is_output_name,
    kill_point,
    remove_stale_temporaries,
    staged_path,
)
from engramrt.checkpoint.metadata import token_map_metadata
from engramrt.checkpoint.names import TensorNames
from engramrt.checkpoint.reader import (
    SOURCE_DTYPES,
    ConfigSource,
    NamesSpec,
    SafetensorsCheckpoint,
    TensorPiece,
    check_block_rows,
    check_table_tensor,
    open_checkpoint,
    read_rows,
    safe_slice,
)
from engramrt.checkpoint.safetensors_format import (
    DIGEST_PLACEHOLDER,
    META_DATA_SHA256,
    SafetensorsStreamWriter,
)
from engramrt.checkpoint.writer import (
    FileLayout,
    check_disk_space,
    file_layout,
    layer_slots,
    tensor_bytes,
)
from engramrt.config import EngramConfig, load_config
from engramrt.errors import CheckpointError
from engramrt.layout import EngramLayout
from engramrt.quant import quantize_rows
from engramrt.tokenmap import TokenMap

__all__ = [
    "ConversionPlan",
    "commit_conversion",
    "convert_checkpoint",
    "output_paths",
    "plan_conversion",
    "run_conversion",
]

SINGLE_FILE_NAME = "engram.safetensors"
_ID_LENGTH = len(uuid.uuid4().hex)
CONVERSION_PLACEHOLDERS = {
    META_CONVERSION_ID: "0" * _ID_LENGTH,
    META_DATA_SHA256: DIGEST_PLACEHOLDER,
}
"""Metadata a planned output carries until it is written: placeholders of the conversion id
and the content digest, of their final lengths, so that a plan's ``nbytes`` is already exact
(:func:`commit_conversion` sets the id, the writer the digest)."""


def output_paths(dst: str | os.PathLike[str], tp: int, *, stem: str = "engram") -> list[Path]:
    """Where a conversion writes.

    ``tp=1``: ``dst`` itself when it ends in ``.safetensors`` or is an
    existing file, else ``dst/<stem>.safetensors``. ``tp=N``: one file per
    rank, ``dst/<stem>-rank<r>-of-<N>.safetensors`` (``dst`` is a directory).
    ``stem``: one of :data:`~engramrt.checkpoint.conversion_set.OUTPUT_STEMS`
    (``"engram"``, ``"ple"``), so a loader recognises the files as a set.
    """
    if stem not in OUTPUT_STEMS:
        raise CheckpointError(f"stem={stem!r}; expected one of {OUTPUT_STEMS}")
    target = Path(dst)
    if tp == 1:
        if target.suffix == ".safetensors" or target.is_file():
            return [target]
        return [target / f"{stem}.safetensors"]
    if target.suffix == ".safetensors" or target.is_file():
        raise CheckpointError(
            f"DST {str(target)!r} is a file; expected a directory for tp={tp} (one file per rank)"
        )
    return [target / f"{stem}-rank{rank}-of-{tp}.safetensors" for rank in range(tp)]


@dataclass(frozen=True)
class ConversionPlan:
    """A checked conversion: source pieces per layer and the files to write.

    Attributes:
        config: the config the tables follow.
        sources: per layer (``config.layer_ids`` order), the source tensor
            pieces covering every row an output needs.
        files: the output files, one per rank (one in all for ``tp=1``).
        tp: tensor-parallel size of the outputs.
        directory_set: the outputs are named by engramrt inside the DST
            directory, which then also gets the set's manifest.
    """

    config: EngramConfig
    sources: tuple[tuple[TensorPiece, ...], ...]
    files: tuple[FileLayout, ...]
    tp: int
    directory_set: bool = False

    @property
    def num_rows(self) -> int:
        """Rows quantised in all (the progress total)."""
        return sum(f.num_rows for f in self.files)

    @property
    def nbytes(self) -> int:
        """Bytes written in all."""
        return sum(f.nbytes for f in self.files)


def plan_conversion(
    src: SafetensorsCheckpoint | str | os.PathLike[str],
    dst: str | os.PathLike[str],
    config: ConfigSource,
    *,
    tp: int = 1,
    names: NamesSpec = None,
    scale_dtype: str = "uint8",
    token_map: TokenMap | None = None,
) -> ConversionPlan:
    """Locate and check every source tensor and lay out every output; writes nothing.

    Every output records the fingerprint of ``token_map`` (default: the
    DeepSeek-V4 map, when it fits the config), which loading checks: see
    :mod:`engramrt.checkpoint.metadata`.

    Raises:
        TokenizerError: ``token_map`` does not fit the config.
        CheckpointError: SRC is missing, a source tensor is missing, or its
            dtype or shape does not match the config.
        ShardingError: ``tp`` leaves a rank without a hash column.
    """
    cfg = load_config(config)
    layout = EngramLayout(cfg)
    if tp != 1:
        layout.cols_per_rank(tp)  # refuse a tp that leaves a rank without columns
    tensor_names = TensorNames.from_spec(names)
    checkpoint = open_checkpoint(src)
    paths = output_paths(dst, tp)
    files = []
    for rank, path in enumerate(paths):
        slots = layer_slots(cfg, layout, tensor_names, tp=None if tp == 1 else tp, rank=rank)
        planned = file_layout(path, cfg, slots, scale_dtype=scale_dtype, tp=tp, rank=rank)
        files.append(
            dataclasses.replace(planned, metadata={**planned.metadata, **CONVERSION_PLACEHOLDERS})
        )
    source_names = tensor_names.per_layer("source", cfg)
    sources = []
    for index, layer_id in enumerate(cfg.layer_ids):
        row_end = max(f.slots[index].row_end for f in files)
        pieces = checkpoint.find(
            source_names[index],
            role="source",
            layer_id=layer_id,
            row_begin=0,
            row_end=row_end,
            check=functools.partial(
                check_table_tensor,
                role="source",
                layer_id=layer_id,
                layer_index=index,
                dtypes=SOURCE_DTYPES,
                width=cfg.head_dim,
                width_note=f"engram_head_dim = {cfg.head_dim}",
                config=cfg,
                rows_needed=int(layout.rows_needed[index]),
            ),
        )
        sources.append(tuple(pieces))
    for path in paths:
        for piece in (p for layer in sources for p in layer):
            if path.absolute() == piece.location.file.absolute():
                raise CheckpointError(f"DST {str(path)!r} is a source file; expected another path")
    directory_set = all(is_output_name(path.name) for path in paths) and not (
        Path(dst).suffix == ".safetensors" or Path(dst).is_file()
    )
    # The hash contract: the token map the rows are hashed with, checked on load.
    recorded = token_map_metadata(cfg, token_map)
    files = [dataclasses.replace(f, metadata={**f.metadata, **recorded}) for f in files]
    return ConversionPlan(cfg, tuple(sources), tuple(files), tp, directory_set)


def _check_finite(block: torch.Tensor, name: str, layer_id: int, row_begin: int) -> None:
    finite = torch.isfinite(block)
    if not bool(finite.all()):
        row, col = (int(i) for i in torch.nonzero(~finite)[0].tolist())
        raise CheckpointError(
            f"source tensor {name!r} (layer {layer_id}) has {block[row, col].item()} at "
            f"[{row_begin + row}, {col}]; expected finite values (a block with inf/nan has no scale)"
        )


def run_conversion(
    plan: ConversionPlan,
    *,
    block_rows: int | None = None,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    on_rows: Callable[[int], None] | None = None,
) -> list[Path]:
    """Quantise and write what ``plan`` describes; returns the files written.

    Args:
        plan: from :func:`plan_conversion`.
        block_rows: source rows per block (default: about 64 MiB of fp32).
        device: where blocks are quantised (``"cuda"`` to use a GPU).
        backend: ``quantize_rows`` backend; default the Triton kernel on a
            CUDA device and the reference on the CPU (both give the same bytes).
        on_rows: called with the row count after each block (progress).

    Raises:
        CapacityError: the destination file system has too little free space.
        CheckpointError: a source block holds inf or nan.
    """
    cfg = plan.config
    compute_device = torch.device(device)
    if backend is None:
        backend = "reference" if compute_device.type == "cpu" else "auto"
    rows_per_block = check_block_rows(block_rows, 4 * cfg.head_dim)

    def fill(writers: Sequence[SafetensorsStreamWriter]) -> None:
        _quantise_into(plan, writers, rows_per_block, compute_device, backend, on_rows)

    return commit_conversion(plan.files, tp=plan.tp, directory_set=plan.directory_set, fill=fill)


def commit_conversion(
    files: Sequence[FileLayout],
    *,
    tp: int,
    directory_set: bool,
    fill: Callable[[Sequence[SafetensorsStreamWriter]], None],
) -> list[Path]:
    """Write ``files`` as one conversion set, committed together; returns their paths.

    The part every conversion shares (see :mod:`engramrt.checkpoint.conversion_set`): a new
    conversion id in every file's metadata, the directory's conversion lock, stale
    temporaries removed, the free space checked, each file streamed into its staged
    temporary, then (for a ``directory_set``) the manifest, the renames and the removal of
    the files it replaces. ``fill(writers)`` appends every tensor's bytes, in the order of
    each file's specs, to one :class:`SafetensorsStreamWriter` per file (``files`` order);
    when it raises, the staged files are removed and nothing appears.

    Args:
        files: the outputs (from a plan: their metadata holds :data:`CONVERSION_PLACEHOLDERS`).
        tp: tensor-parallel size of the set (recorded in the manifest).
        directory_set: the outputs are named by engramrt inside one directory, which then
            also gets the set's manifest.
        fill: writes the data.

    Raises:
        CapacityError: the destination file system has too little free space.
    """
    conversion_id = uuid.uuid4().hex
    files = tuple(
        dataclasses.replace(f, metadata={**f.metadata, META_CONVERSION_ID: conversion_id})
        for f in files
    )
    directory = files[0].path.parent
    with conversion_lock(directory):
        remove_stale_temporaries(directory, [f.path.name for f in files])
        check_disk_space(files)
        staged = [staged_path(f.path, conversion_id) for f in files]
        committed = False
        try:
            _write_staged(files, staged, fill)
            kill_point("convert:staged")
            replaced = _replaced_files(directory, files) if directory_set else []
            manifest = None
            if directory_set:
                manifest = ConversionManifest(
                    conversion_id,
                    tp,
                    tuple(f.path.name for f in files),
                    tuple((path.name, cid) for path, cid in replaced),
                )
                atomic_write_bytes(directory / MANIFEST_NAME, manifest.to_json())
            committed = True
            kill_point("convert:manifest")
            for index, (path, output) in enumerate(zip(staged, files, strict=True)):
                os.replace(path, output.path)
                kill_point(f"convert:renamed-{index + 1}")
            fsync_directory(directory)
            for path, _cid in replaced:
                path.unlink(missing_ok=True)
            kill_point("convert:cleaned")
            # From now on a replaced file that reappears is refused as stale.
            if manifest is not None and replaced:
                atomic_write_bytes(
                    directory / MANIFEST_NAME, dataclasses.replace(manifest, replaces=()).to_json()
                )
        except BaseException:
            if not committed:  # after the commit the staged files are the set
                for path in staged:
                    path.unlink(missing_ok=True)
            raise
    return [output.path for output in files]


def _write_staged(
    files: tuple[FileLayout, ...],
    staged: list[Path],
    fill: Callable[[Sequence[SafetensorsStreamWriter]], None],
) -> None:
    """Open the staged files, let ``fill`` write every tensor, finish and fsync them."""
    with contextlib.ExitStack() as stack:
        writers, handles = [], []
        for output, path in zip(files, staged, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            handle = stack.enter_context(os.fdopen(fd, "wb"))
            handles.append(handle)
            writers.append(SafetensorsStreamWriter(handle, output.specs, output.metadata))
        fill(writers)
        for index, writer in enumerate(writers):
            writer.finish()
            kill_point(f"convert:finished-{index + 1}")
        for handle in handles:
            handle.flush()
            os.fsync(handle.fileno())


def _quantise_into(
    plan: ConversionPlan,
    writers: Sequence[SafetensorsStreamWriter],
    rows_per_block: int,
    compute_device: torch.device,
    backend: str,
    on_rows: Callable[[int], None] | None,
) -> None:
    """Quantise every block of the plan's sources into the files' writers."""
    cfg = plan.config
    for index, pieces in enumerate(plan.sources):
        layer_id = cfg.layer_ids[index]
        for output, writer in zip(plan.files, writers, strict=True):
            slot = output.slots[index]
            for piece in pieces:
                begin = max(piece.row_begin, slot.row_begin)
                end = min(piece.row_end, slot.row_end)
                if begin >= end:
                    continue
                source = safe_slice(
                    piece.location.file, piece.location.name, piece.location.open_path
                )
                for block_begin in range(begin, end, rows_per_block):
                    block_end = min(block_begin + rows_per_block, end)
                    block = read_rows(piece, source, block_begin, block_end)  # [n, E] float
                    block = block.to(compute_device)
                    _check_finite(block, piece.location.name, layer_id, block_begin)
                    values, scales = quantize_rows(block, backend=backend, check_finite=False)
                    writer.append(slot.weight, tensor_bytes(values))
                    writer.append(slot.scale, tensor_bytes(scales))
                    if on_rows is not None:
                        on_rows(block_end - block_begin)
                    kill_point("convert:block")


def _replaced_files(
    directory: Path, files: tuple[FileLayout, ...]
) -> list[tuple[Path, str | None]]:
    """engramrt output files in ``directory`` that are not this conversion's (it removes them)."""
    names = {f.path.name for f in files}
    replaced = []
    for path in sorted(directory.glob("*.safetensors")):
        if is_output_name(path.name) and path.name not in names and path.is_file():
            ours, cid = file_conversion_id(path)
            if ours:
                replaced.append((path, cid))
    return replaced


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    config: ConfigSource,
    *,
    tp: int = 1,
    names: NamesSpec = None,
    scale_dtype: str = "uint8",
    block_rows: int | None = None,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    on_rows: Callable[[int], None] | None = None,
    token_map: TokenMap | None = None,
) -> list[Path]:
    """:func:`plan_conversion` then :func:`run_conversion`; returns the files written."""
    plan = plan_conversion(
        src, dst, config, tp=tp, names=names, scale_dtype=scale_dtype, token_map=token_map
    )
    return run_conversion(
        plan, block_rows=block_rows, device=device, backend=backend, on_rows=on_rows
    )
