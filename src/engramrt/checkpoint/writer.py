"""Write fp8 Engram tables as safetensors, atomically and in bounded memory.

A file holds, per Engram layer in ``config.layer_ids`` order, the fp8
e4m3fn values ``[rows, E]`` (dtype ``F8_E4M3``) and then the ue8m0 scales
``[rows, E/32]`` (``U8`` by default, ``F8_E8M0`` with ``scale_dtype="e8m0"``;
the same bytes), under the weight/scale names of
:class:`~engramrt.checkpoint.names.TensorNames`, plus the metadata of
:mod:`engramrt.checkpoint.metadata`. ``rows`` is ``num_embeddings`` for a
full table, or a rank's row range for a tensor-parallel shard file.

Files are written through :func:`engramrt._io.atomic_writer` (a temporary
file beside the target, fsync, rename) by
:class:`~engramrt.checkpoint.safetensors_format.SafetensorsStreamWriter`,
which writes the header last: an interrupted write leaves no file at the
target and no temporary file that loads.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from engramrt._io import atomic_writer
from engramrt.checkpoint.metadata import LayerSlot, build_metadata
from engramrt.checkpoint.names import TensorNames
from engramrt.checkpoint.reader import ConfigSource, NamesSpec, check_block_rows
from engramrt.checkpoint.safetensors_format import (
    SafetensorsStreamWriter,
    TensorSpec,
    encode_header,
)
from engramrt.config import EngramConfig, load_config
from engramrt.errors import CapacityError, CheckpointError
from engramrt.layout import EngramLayout
from engramrt.packed import row_bytes_for

__all__ = [
    "SCALE_DTYPES",
    "FileLayout",
    "Table",
    "check_disk_space",
    "file_layout",
    "layer_slots",
    "save_tables",
    "scale_dtype_code",
    "tensor_bytes",
]

SCALE_DTYPES: dict[str, str] = {
    "uint8": "U8",
    "u8": "U8",
    "e8m0": "F8_E8M0",
    "float8_e8m0fnu": "F8_E8M0",
}
"""Accepted ``scale_dtype`` spellings -> safetensors dtype string."""

Table: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"
"""A packed ``[rows, E + E/32]`` uint8 table, or ``(values [rows, E], scales [rows, E/32])``."""


def scale_dtype_code(scale_dtype: str) -> str:
    """The safetensors dtype string of ``scale_dtype`` (``"uint8"`` or ``"e8m0"``)."""
    code = SCALE_DTYPES.get(str(scale_dtype).lower())
    if code is None:
        raise CheckpointError(f"scale_dtype = {scale_dtype!r}; expected 'uint8' or 'e8m0'")
    return code


def _scale_dtype_name(code: str) -> str:
    return "e8m0" if code == "F8_E8M0" else "uint8"


def layer_slots(
    config: EngramConfig,
    layout: EngramLayout,
    names: TensorNames,
    *,
    tp: int | None,
    rank: int = 0,
) -> list[LayerSlot]:
    """Per layer, the rows a file holds: the full table (``tp=None``) or rank ``rank``'s shard."""
    weights = names.per_layer("weight", config)
    scales = names.per_layer("scale", config)
    slots = []
    for index, layer_id in enumerate(config.layer_ids):
        if weights[index][0] == scales[index][0]:
            raise CheckpointError(
                f"layer {layer_id}: weight and scale are both named {weights[index][0]!r}"
            )
        num_embeddings = config.num_embeddings[index]
        if tp is None:
            rows, cols = (0, num_embeddings), (0, config.n_cols)
        else:
            shard = layout.column_shard(index, tp, rank)
            rows, cols = (shard.row_begin, shard.row_end), (shard.col_begin, shard.col_end)
        slots.append(
            LayerSlot(
                layer_index=index,
                layer_id=layer_id,
                weight=weights[index][0],
                scale=scales[index][0],
                num_embeddings=num_embeddings,
                row_begin=rows[0],
                row_end=rows[1],
                col_begin=cols[0],
                col_end=cols[1],
            )
        )
    return slots


@dataclass(frozen=True)
class FileLayout:
    """Everything about one output file except its data."""

    path: Path
    slots: tuple[LayerSlot, ...]
    specs: tuple[TensorSpec, ...]
    metadata: dict[str, str]
    tp: int
    rank: int

    @property
    def nbytes(self) -> int:
        """Size of the finished file: header plus data."""
        header, _ = encode_header(self.specs, self.metadata)
        return len(header) + sum(spec.nbytes for spec in self.specs)

    @property
    def num_rows(self) -> int:
        return sum(slot.num_rows for slot in self.slots)


def file_layout(
    path: str | os.PathLike[str],
    config: EngramConfig,
    slots: Sequence[LayerSlot],
    *,
    scale_dtype: str,
    tp: int,
    rank: int,
    extra_metadata: Mapping[str, str] | None = None,
) -> FileLayout:
    """The tensor specs (weight then scale, per layer) and metadata of a file holding ``slots``."""
    code = scale_dtype_code(scale_dtype)
    E = config.head_dim
    specs: list[TensorSpec] = []
    for slot in slots:
        specs.append(TensorSpec(slot.weight, "F8_E4M3", (slot.num_rows, E)))
        specs.append(TensorSpec(slot.scale, code, (slot.num_rows, E // 32)))
    metadata = build_metadata(
        config, slots, scale_dtype=_scale_dtype_name(code), tp=tp, rank=rank, extra=extra_metadata
    )
    return FileLayout(Path(path), tuple(slots), tuple(specs), metadata, tp, rank)


def disk_free_bytes(path: Path) -> int:
    """Free bytes (``shutil.disk_usage``) of the file system holding ``path`` or its nearest parent."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)


def check_disk_space(files: Sequence[FileLayout]) -> None:
    """Raise :class:`CapacityError` unless the files fit their file system(s) together."""
    need: dict[int, tuple[Path, int]] = {}
    for layout in files:
        probe = layout.path.absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        device = probe.stat().st_dev
        where, total = need.get(device, (probe, 0))
        need[device] = (where, total + layout.nbytes)
    for where, total in need.values():
        free = disk_free_bytes(where)
        if total > free:
            raise CapacityError(
                f"writing {len(files)} file(s) under {where} needs {total} bytes "
                f"({total / 2**30:.2f} GiB) but its file system has only {free} bytes "
                f"({free / 2**30:.2f} GiB) free"
            )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw row-major bytes of ``tensor`` (copied to the CPU and made contiguous if needed)."""
    flat = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
    return flat.numpy().data


def _split_table(table: Any, E: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [rows, E], scales [rows, E/32])`` views of a packed table or a pair."""
    if isinstance(table, torch.Tensor):
        if table.dtype != torch.uint8 or table.dim() != 2 or table.shape[1] != row_bytes_for(E):
            raise CheckpointError(
                f"{name} is {table.dtype} {list(table.shape)}; expected packed uint8 "
                f"[rows, {row_bytes_for(E)}] (E = {E} values + {E // 32} scale bytes)"
            )
        return table[:, :E], table[:, E:]
    if isinstance(table, (tuple, list)) and len(table) == 2:
        values, scales = table
        if not isinstance(values, torch.Tensor) or values.dtype not in (
            torch.float8_e4m3fn,
            torch.uint8,
        ):
            found = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise CheckpointError(f"{name} values have dtype {found}; expected float8_e4m3fn")
        if not isinstance(scales, torch.Tensor) or scales.dtype not in (
            torch.uint8,
            torch.float8_e8m0fnu,
        ):
            found = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise CheckpointError(
                f"{name} scales have dtype {found}; expected uint8 or float8_e8m0fnu"
            )
        if values.dim() != 2 or values.shape[1] != E:
            raise CheckpointError(
                f"{name} values have shape {list(values.shape)}; expected [rows, {E}]"
            )
        expected = [values.shape[0], E // 32]
        if list(scales.shape) != expected:
            raise CheckpointError(
                f"{name} scales have shape {list(scales.shape)}; expected {expected}"
            )
        return values, scales
    raise CheckpointError(
        f"{name} is a {type(table).__name__}; expected a packed uint8 tensor or a "
        f"(values, scales) pair"
    )


def save_tables(
    path: str | os.PathLike[str],
    tables: Sequence[Table] | Mapping[int, Table],
    config: ConfigSource,
    *,
    names: NamesSpec = None,
    scale_dtype: str = "uint8",
    tp: int | None = None,
    rank: int = 0,
    block_rows: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write fp8 tables to one safetensors file, atomically.

    Args:
        path: the file to write (replaced atomically if it exists).
        tables: one table per Engram layer, in ``config.layer_ids`` order, or
            a mapping from layer id to table. A table is packed rows
            ``[rows, E + E/32]`` uint8 or a pair ``(values [rows, E]
            float8_e4m3fn, scales [rows, E/32] uint8 | float8_e8m0fnu)``, on
            any device. ``rows`` is ``num_embeddings`` (``tp=None``) or the
            row count of rank ``rank``'s shard.
        config: the config (or preset name / path).
        names: tensor names; the first weight/scale name of each layer is used.
        scale_dtype: ``"uint8"`` (default) or ``"e8m0"`` (float8_e8m0fnu).
        tp, rank: write a tensor-parallel shard file (recorded in metadata);
            ``None`` writes full tables.
        block_rows: rows copied per write (default: about 64 MiB).
        metadata: extra ``__metadata__`` entries (str -> str).

    Returns:
        The path written.

    Raises:
        CheckpointError: a table's dtype or shape does not fit the config.
        CapacityError: the file system has less free space than the file needs.
    """
    cfg = load_config(config)
    layout = EngramLayout(cfg)
    tensor_names = TensorNames.from_spec(names)
    if isinstance(tables, Mapping):
        missing = [layer for layer in cfg.layer_ids if layer not in tables]
        if missing or len(tables) != cfg.n_layers:
            raise CheckpointError(
                f"tables has layers {sorted(tables)}; expected exactly {list(cfg.layer_ids)}"
            )
        ordered = [tables[layer] for layer in cfg.layer_ids]
    else:
        ordered = list(tables)
        if len(ordered) != cfg.n_layers:
            raise CheckpointError(
                f"tables has {len(ordered)} table(s); expected {cfg.n_layers} (layers "
                f"{list(cfg.layer_ids)})"
            )
    slots = layer_slots(cfg, layout, tensor_names, tp=tp, rank=rank)
    pairs = []
    for slot, table in zip(slots, ordered, strict=True):
        what = f"table of layer {slot.layer_id}"
        values, scales = _split_table(table, cfg.head_dim, what)
        if values.shape[0] != slot.num_rows:
            part = "the full table" if tp is None else f"rank {rank} of tp={tp}"
            raise CheckpointError(
                f"{what} has {values.shape[0]} rows; expected {slot.num_rows} ({part}: rows "
                f"[{slot.row_begin}, {slot.row_end}))"
            )
        pairs.append((values, scales))
    target = file_layout(
        path,
        cfg,
        slots,
        scale_dtype=scale_dtype,
        tp=1 if tp is None else tp,
        rank=0 if tp is None else rank,
        extra_metadata=metadata,
    )
    check_disk_space([target])
    rows_per_block = check_block_rows(block_rows, row_bytes_for(cfg.head_dim))
    with atomic_writer(target.path) as handle:
        writer = SafetensorsStreamWriter(handle, target.specs, target.metadata)
        for slot, (values, scales) in zip(slots, pairs, strict=True):
            for begin in range(0, slot.num_rows, rows_per_block):
                end = min(begin + rows_per_block, slot.num_rows)
                writer.append(slot.weight, tensor_bytes(values[begin:end]))
                writer.append(slot.scale, tensor_bytes(scales[begin:end]))
        writer.finish()
    return target.path
