"""Read Qwen4-Exp PLE tables, hash buffers and layer weights out of safetensors checkpoints.

docs/families.md §5 and §7. A checkpoint is what :class:`SafetensorsCheckpoint` opens: one
``*.safetensors`` file or a directory of them, with or without a
``model.safetensors.index.json``. Everything of PLE layer ``l`` (PLE index, the position in
the sorted ``ple_layer_ids``) sits under ``<P>layers.<i>.ple.``, ``i = ple_layer_ids[l] - 1``,
``<P>`` = ``model.language_model.`` (composite ``qwen4_exp``) or ``model.`` (text-only):

- the table ``[R, d]`` (``R`` = ``PleConstants.table_rows[l]``, ``d = E / C``), stored as
  row shards ``ple_embedding.ngram_embedding.shard_<k>.weight`` concatenated in numeric
  ``k`` order (``shard_2`` before ``shard_11``), or whole as the runtime parameter
  ``ple_embedding.ngram_embedding.weight``. ``save_pretrained`` writes
  ``torch.chunk(table, split_ngram_parts)``: ``ceil(R/P)`` rows each, the last shorter,
  and fewer than ``P`` shards when ``ceil(R/P) * (P-1) >= R``; so the shards may be of any
  sizes, and what is checked is that ``k`` runs ``0, 1, 2, ...`` without a gap or a repeat,
  every shard is ``d`` wide in one dtype, and the rows add up to ``R``;
- the persistent int64 buffers ``ple_embedding.layer_multipliers [N]``,
  ``ngram_heads_vocab_sizes [C]`` and ``ngram_heads_offsets [C]``: optional, and when present
  they must equal what the config derives (the reference would use the checkpoint's values
  and so hash differently from the config; engramrt refuses instead);
- the layer weights ``key_proj``, ``value_proj``, ``norm_key``, ``norm_query``,
  ``norm_conv``, ``conv1d`` (:class:`PleLayerWeights`).

The table is read in blocks of rows (about ``engramrt.checkpoint.DEFAULT_BLOCK_BYTES``
each), each written into its destination as it arrives, so memory peaks at the destination
plus one block. A rank reads only its :class:`PleTableRegion`: a row range, and a range of
each row's ``d`` values (the TP plan ``embedding_colwise`` splits the values, not the rows:
:meth:`PleTableRegion.width_shard`). Every check runs before the first block is read
(:func:`plan_ple_table`); a table block holding NaN or inf is refused by tensor and row.

The fp8 form of the table (the reference's ``FP8Embedding``: float8_e4m3fn values with a
per-tensor ``weight_scale``) is not read: it is refused by name.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engramrt.checkpoint.finite import check_head_weight
from engramrt.checkpoint.reader import (
    SafetensorsCheckpoint,
    TensorLocation,
    check_block_rows,
    open_checkpoint,
    read_tensor,
    safe_slice,
)
from engramrt.errors import CheckpointError, ValidationError, describe_tensor
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.ids import PleConstants
from engramrt.families.qwen4_ple.layer import PLE_CHECKPOINT_PREFIXES, PleLayerWeights
from engramrt.plan import TableRegion, width_slice

__all__ = [
    "BUFFER_NAMES",
    "TABLE_DTYPES",
    "PleTablePiece",
    "PleTablePlan",
    "PleTableRegion",
    "check_ple_buffers",
    "find_ple_prefix",
    "iter_ple_table_blocks",
    "plan_ple_table",
    "read_ple_layer_weights",
    "read_ple_table",
]

Checkpoint = SafetensorsCheckpoint | str | os.PathLike[str]
ConfigSource = PleConfig | Mapping[str, Any] | str | Path

TABLE_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}
"""Safetensors dtypes a table (and a layer weight) may be stored in: the model dtypes."""

_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

_EXACT_WIDENING = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}
"""(stored, wanted) dtype pairs whose conversion keeps every value: a table stored in bf16
may be read into an fp32 model; nothing is ever rounded on the way in."""

BUFFER_NAMES = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
"""The persistent int64 buffers under ``ple_embedding.``, in the order they are checked."""

_SHARD = re.compile(r"shard_(\d+)\.weight")


# -- what to read ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PleTableRegion(TableRegion):
    """Table rows ``[row_begin, row_end)`` and, of each, values ``[value_begin, value_end)``
    (columns of the ``[R, d]`` table; not hash columns)."""

    row_begin: int
    row_end: int
    value_begin: int
    value_end: int

    @classmethod
    def whole(cls, rows: int, width: int) -> PleTableRegion:
        """Every row and every value of an ``[rows, width]`` table."""
        return cls(0, rows, 0, width)

    @classmethod
    def width_shard(cls, rows: int, width: int, tp: int, rank: int) -> PleTableRegion:
        """Rank ``rank`` of ``tp``'s part under the TP plan ``embedding_colwise``: every row,
        and the values :func:`engramrt.plan.width_slice` gives the rank (``torch.chunk``
        along the values, as a DTensor ``Shard(1)`` places them; when ``tp`` does not divide
        ``width`` the last ranks get fewer values, possibly none)."""
        for name, value in (("tp", tp), ("rank", rank), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValidationError(f"{name}={value!r}; expected an int")
        if tp < 1 or not 0 <= rank < tp:
            raise ValidationError(f"tp={tp}, rank={rank}; expected tp >= 1 and 0 <= rank < tp")
        return cls(0, rows, *width_slice(width, tp, rank))

    @property
    def shape(self) -> tuple[int, int]:
        """``[rows, values]`` of the part read."""
        return (self.num_rows, self.num_values)

    def check(self, rows: int, width: int) -> None:
        """Refuse a region that is not inside an ``[rows, width]`` table."""
        bounds = (self.row_begin, self.row_end, self.value_begin, self.value_end)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in bounds) or not (
            0 <= self.row_begin <= self.row_end <= rows
            and 0 <= self.value_begin <= self.value_end <= width
        ):
            raise ValidationError(
                f"region rows [{self.row_begin}, {self.row_end}) values [{self.value_begin}, "
                f"{self.value_end}); expected ints with 0 <= row_begin <= row_end <= R={rows} and "
                f"0 <= value_begin <= value_end <= d={width}"
            )


@dataclass(frozen=True)
class PleTablePiece:
    """One stored tensor of a table: table rows ``[row_begin, row_end)``."""

    name: str
    row_begin: int
    row_end: int
    location: TensorLocation


@dataclass(frozen=True)
class PleTablePlan:
    """A checked plan to read PLE layer ``ple_index``'s table (:func:`plan_ple_table`).

    Attributes:
        ple_index: ``l``. decoder_layer: ``i = ple_layer_ids[l] - 1``. prefix: ``<P>``.
        rows, width: ``R`` and ``d``. dtype: the dtype every piece is stored in.
        pieces: the stored tensors in row order; together exactly rows ``[0, R)``.
        buffers: the hash buffers the checkpoint holds (each checked equal to the config's).
    """

    ple_index: int
    decoder_layer: int
    prefix: str
    rows: int
    width: int
    dtype: torch.dtype
    pieces: tuple[PleTablePiece, ...]
    buffers: tuple[str, ...]

    @property
    def sharded(self) -> bool:
        """Whether the table is stored as ``shard_<k>`` pieces (else as one ``weight``)."""
        return not self.pieces[0].name.endswith(".ngram_embedding.weight")


# -- names -----------------------------------------------------------------------------------


def _resolve_config(config: ConfigSource) -> PleConfig:
    return config if isinstance(config, PleConfig) else PleConfig.from_hf(config)


def _decoder_layer(cfg: PleConfig, ple_index: int) -> int:
    if isinstance(ple_index, bool) or not isinstance(ple_index, int):
        raise ValidationError(f"ple_index={ple_index!r}; expected an int")
    if not 0 <= ple_index < cfg.n_layers:
        raise ValidationError(
            f"ple_index={ple_index}; expected 0 <= ple_index < {cfg.n_layers} (the position in "
            f"ple_layer_ids={list(cfg.ple_layer_ids)})"
        )
    return cfg.decoder_layer_indices[ple_index]


def _tensor_names(ckpt: SafetensorsCheckpoint) -> set[str]:
    """Every tensor name the checkpoint holds: its index's and its files' headers'."""
    names = set(ckpt.weight_map)
    for file in ckpt.files:
        names.update(ckpt.header(file).tensors)
    return names


def find_ple_prefix(checkpoint: Checkpoint, decoder_layer: int) -> str:
    """``<P>``: the one of :data:`PLE_CHECKPOINT_PREFIXES` whose ``<P>layers.<i>.ple.`` names
    the checkpoint holds for decoder layer ``decoder_layer`` (``i``).

    Raises:
        CheckpointError: it holds names under both prefixes, or under neither.
    """
    with _opened(checkpoint) as ckpt:
        names = _tensor_names(ckpt)
        found = [
            prefix
            for prefix in PLE_CHECKPOINT_PREFIXES
            if any(n.startswith(f"{prefix}layers.{decoder_layer}.ple.") for n in names)
        ]
        if len(found) == 1:
            return found[0]
        bases = " and ".join(f"{p}layers.{decoder_layer}.ple.*" for p in PLE_CHECKPOINT_PREFIXES)
        what = "both" if found else "neither"
        raise CheckpointError(
            f"{ckpt.describe()} holds tensors under {what} of {bases}; expected exactly one "
            f"(a composite qwen4_exp or a text-only checkpoint; pass prefix= to choose)"
        )


def _prefix(ckpt: SafetensorsCheckpoint, decoder_layer: int, prefix: str | None) -> str:
    if prefix is None:
        return find_ple_prefix(ckpt, decoder_layer)
    if prefix not in PLE_CHECKPOINT_PREFIXES:
        raise ValidationError(f"prefix={prefix!r}; expected one of {PLE_CHECKPOINT_PREFIXES}")
    return prefix


@contextlib.contextmanager
def _opened(checkpoint: Checkpoint) -> Iterator[SafetensorsCheckpoint]:
    """The checkpoint, closed afterwards when it was opened here (a caller's is left open)."""
    if isinstance(checkpoint, SafetensorsCheckpoint):
        yield checkpoint
        return
    with SafetensorsCheckpoint(checkpoint) as ckpt:
        yield ckpt


def _one_location(ckpt: SafetensorsCheckpoint, name: str) -> TensorLocation:
    found = ckpt.locations(name)
    if len(found) != 1:
        files = ", ".join(location.file.name for location in found) or "none"
        raise CheckpointError(
            f"tensor {name!r} is in {len(found)} files of {ckpt.path} ({files}); expected one"
        )
    return found[0]


def _fp8_refusal(name: str, found: str) -> CheckpointError:
    return CheckpointError(
        f"tensor {name!r} is {found}: the fp8 form of the PLE table (the reference's "
        f"FP8Embedding, float8_e4m3fn values with a per-tensor weight_scale), which engramrt "
        f"does not read; expected the table in bf16 or the model dtype (dequantise it first)"
    )


# -- the table -------------------------------------------------------------------------------


def _table_names(names: set[str], base: str, ckpt: SafetensorsCheckpoint) -> list[str]:
    """The table's stored names under ``base`` (``...ngram_embedding.``), in row order:
    ``[base + "weight"]`` or the shards sorted by ``k``, after the name checks."""
    whole = f"{base}weight"
    shards: dict[int, str] = {}
    for name in sorted(names):
        if not name.startswith(base) or name == whole:
            continue
        rest = name[len(base) :]
        if "scale" in rest:
            raise _fp8_refusal(name, "a scale")
        match = _SHARD.fullmatch(rest)
        if match is None:
            raise CheckpointError(
                f"tensor {name!r} is not a PLE table name; expected {whole!r} or "
                f"{base}shard_<k>.weight (k = 0, 1, 2, ...)"
            )
        k = int(match.group(1))
        if k in shards:
            raise CheckpointError(
                f"tensors {shards[k]!r} and {name!r} are both shard {k} of the PLE table; "
                f"expected one tensor per shard"
            )
        shards[k] = name
    if whole in names and shards:
        raise CheckpointError(
            f"{ckpt.describe()} holds both {whole!r} and {len(shards)} shard(s) "
            f"{base}shard_<k>.weight; expected the table in one of the two forms"
        )
    if whole in names:
        return [whole]
    if not shards:
        raise CheckpointError(
            f"no PLE table in {ckpt.describe()}: expected {base}shard_<k>.weight (k = 0, 1, ...) "
            f"or {whole!r}"
        )
    for k in range(len(shards)):
        if k not in shards:
            raise CheckpointError(
                f"PLE table shard {base}shard_{k}.weight is missing: the checkpoint holds shards "
                f"{_ranges(sorted(shards))}; expected shards 0..{max(shards)} without a gap"
            )
    return [shards[k] for k in range(len(shards))]


def _ranges(values: list[int]) -> str:
    """``0-5, 7, 9-11`` of sorted ints."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _table_pieces(
    ckpt: SafetensorsCheckpoint, table_names: list[str], rows: int, width: int, note: str
) -> tuple[torch.dtype, tuple[PleTablePiece, ...]]:
    """Locate and check each stored tensor; ``(dtype, pieces)`` with rows summing to ``rows``."""
    pieces: list[PleTablePiece] = []
    stored: tuple[str, str] | None = None  # (dtype, name) of the first piece
    cursor = 0
    for name in table_names:
        location = _one_location(ckpt, name)
        entry = location.entry
        where = f"tensor {name!r} in {location.file.name}"
        if entry.dtype in _FP8_DTYPES:
            raise _fp8_refusal(name, f"stored as {entry.dtype}")
        if entry.dtype not in TABLE_DTYPES:
            raise CheckpointError(
                f"{where} has dtype {entry.dtype}; expected one of {', '.join(TABLE_DTYPES)} "
                f"(bf16 or the model dtype)"
            )
        if stored is not None and entry.dtype != stored[0]:
            raise CheckpointError(
                f"{where} has dtype {entry.dtype} but {stored[1]!r} has {stored[0]}; expected "
                f"every piece of the table in one dtype"
            )
        stored = stored or (entry.dtype, name)
        if len(entry.shape) != 2 or entry.shape[1] != width:
            raise CheckpointError(
                f"{where} has shape {list(entry.shape)}; expected [rows, {width}] ({note})"
            )
        pieces.append(PleTablePiece(name, cursor, cursor + entry.shape[0], location))
        cursor += entry.shape[0]
    if cursor != rows:
        sizes = [p.row_end - p.row_begin for p in pieces]
        raise CheckpointError(
            f"the PLE table's {len(pieces)} piece(s) {table_names[0]!r} ... hold {cursor} rows "
            f"(sizes {_sizes(sizes)}); expected R = {rows} (table_rows of the config's hash "
            f"constants)"
        )
    assert stored is not None
    return TABLE_DTYPES[stored[0]], tuple(pieces)


def _sizes(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:3]))}, ..., {', '.join(map(str, sizes[-2:]))}]"


def plan_ple_table(
    checkpoint: Checkpoint,
    config: ConfigSource,
    ple_index: int,
    *,
    prefix: str | None = None,
) -> PleTablePlan:
    """Locate and check PLE layer ``ple_index``'s table and hash buffers, reading no rows.

    Args:
        checkpoint: a file, a directory, or an open checkpoint (the plan reads through it;
            pass an open one to close it when done).
        config: a :class:`PleConfig`, an HF config dict, or a ``config.json`` / model directory.
        ple_index: ``l``, the position in the sorted ``ple_layer_ids``.
        prefix: ``<P>``; None finds the one the checkpoint uses (:func:`find_ple_prefix`).

    Raises:
        CheckpointError: a buffer differs from the config's constants (:func:`check_ple_buffers`);
            the table is missing, in both forms, fp8, of another dtype, not ``d`` wide, or its
            shards have a gap, a repeat, mixed dtypes or do not add up to ``R`` rows.
        ValidationError: ``ple_index`` or ``prefix`` is out of range.
    """
    ckpt = open_checkpoint(checkpoint)
    cfg = _resolve_config(config)
    decoder_layer = _decoder_layer(cfg, ple_index)
    prefix = _prefix(ckpt, decoder_layer, prefix)
    consts = PleConstants.from_config(cfg)
    buffers = _check_buffers(ckpt, cfg, consts, ple_index, decoder_layer, prefix)
    rows, width = consts.table_rows[ple_index], cfg.table_width
    base = f"{prefix}layers.{decoder_layer}.ple.ple_embedding.ngram_embedding."
    table_names = _table_names(_tensor_names(ckpt), base, ckpt)
    note = f"d = ple_embed_dim / C = {cfg.embed_dim} / {cfg.n_cols} = {width}"
    dtype, pieces = _table_pieces(ckpt, table_names, rows, width, note)
    return PleTablePlan(ple_index, decoder_layer, prefix, rows, width, dtype, pieces, buffers)


def _check_block_finite(
    block: torch.Tensor, name: str, row_begin: int, value_begin: int, table_row: int
) -> None:
    bad = ~torch.isfinite(block)
    if bool(bad.any()):
        row, col = (int(v) for v in torch.nonzero(bad)[0])
        raise CheckpointError(
            f"tensor {name!r} holds {float(block[row, col])} at row {row_begin + row} value "
            f"{value_begin + col} (table row {table_row + row}); expected finite values"
        )


def iter_ple_table_blocks(
    plan: PleTablePlan, region: PleTableRegion | None = None, *, block_rows: int | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Stream a plan's rows: ``(local_row, block [n, region values])`` in the stored dtype,
    ``n <= block_rows``, ``local_row`` counted from ``region.row_begin``, in row order.

    A block never spans two stored tensors, so it is one strided read of one of them. Each
    block is refused when it holds NaN or inf (naming the tensor, its row and the value).

    Args:
        plan: from :func:`plan_ple_table` (its checkpoint must stay open while iterating).
        region: the part to read (default: the whole table); see :class:`PleTableRegion`.
        block_rows: rows per block (default: about ``DEFAULT_BLOCK_BYTES``).
    """
    region = PleTableRegion.whole(plan.rows, plan.width) if region is None else region
    region.check(plan.rows, plan.width)
    return _iter_blocks(plan, region, _block_rows(plan, region, block_rows))


def _block_rows(plan: PleTablePlan, region: PleTableRegion, block_rows: int | None) -> int:
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    return check_block_rows(block_rows, max(1, region.num_values) * itemsize)


def _iter_blocks(
    plan: PleTablePlan, region: PleTableRegion, block_rows: int
) -> Iterator[tuple[int, torch.Tensor]]:
    if region.num_rows == 0 or region.num_values == 0:
        return
    values = slice(region.value_begin, region.value_end)
    for piece in plan.pieces:
        begin, end = max(piece.row_begin, region.row_begin), min(piece.row_end, region.row_end)
        if begin >= end:
            continue
        location = piece.location
        stored = safe_slice(location.file, piece.name, location.open_path)
        for block_begin in range(begin, end, block_rows):
            block_end = min(block_begin + block_rows, end)
            local = slice(block_begin - piece.row_begin, block_end - piece.row_begin)
            try:
                block = stored[local, values]  # [n, region values]
            except Exception as exc:  # safetensors raises its own error types here
                raise CheckpointError(
                    f"{location.file}: reading rows [{local.start}, {local.stop}) of "
                    f"{piece.name!r} failed: {exc}"
                ) from exc
            _check_block_finite(block, piece.name, local.start, region.value_begin, block_begin)
            yield block_begin - region.row_begin, block


def _check_cast(what: str, stored: torch.dtype, dtype: torch.dtype) -> None:
    """Refuse reading values stored in ``stored`` as ``dtype`` unless every value survives."""
    if stored != dtype and (stored, dtype) not in _EXACT_WIDENING:
        raise ValidationError(
            f"{what} is stored in {stored}; reading it as {dtype} would round it: expected "
            f"dtype {stored} (or a wider float)"
        )


def _destination(
    plan: PleTablePlan,
    region: PleTableRegion,
    out: torch.Tensor | None,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, view)``: the caller's tensor (or a new CPU one) and its view the region fills."""
    what = f"the PLE table {plan.pieces[0].name!r}" + (" ..." if plan.sharded else "")
    if dtype is not None and dtype not in _MODEL_DTYPES:
        raise ValidationError(f"dtype={dtype}; expected one of {_MODEL_DTYPES}")
    if out is None:
        dtype = plan.dtype if dtype is None else dtype
        _check_cast(what, plan.dtype, dtype)
        out = torch.empty(region.shape, dtype=dtype)
        return out, out
    if not isinstance(out, torch.Tensor):
        raise ValidationError(f"out is a {type(out).__name__}; expected a tensor or None")
    if dtype is not None and out.dtype != dtype:
        raise ValidationError(f"out has {describe_tensor(out)}; expected dtype={dtype}")
    if out.dtype not in _MODEL_DTYPES:
        raise ValidationError(f"out has {describe_tensor(out)}; expected one of {_MODEL_DTYPES}")
    _check_cast(what, plan.dtype, out.dtype)
    full = (plan.rows, plan.width)
    if tuple(out.shape) == region.shape:
        return out, out
    if tuple(out.shape) == full:
        view = out[region.row_begin : region.row_end, region.value_begin : region.value_end]
        return out, view
    raise ValidationError(
        f"out has {describe_tensor(out)}; expected the region's shape {list(region.shape)} or "
        f"the whole table's {list(full)} (R, d)"
    )


def read_ple_table(
    checkpoint: Checkpoint,
    config: ConfigSource,
    ple_index: int,
    *,
    region: PleTableRegion | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    block_rows: int | None = None,
    prefix: str | None = None,
) -> torch.Tensor:
    """PLE layer ``ple_index``'s table, or the ``region`` of it, read in blocks.

    Checks everything first (:func:`plan_ple_table`: the hash buffers, the names, dtype,
    width and rows of the stored pieces), then writes each block into the destination as
    it arrives: memory peaks at the destination plus one block.

    Args:
        checkpoint: a ``.safetensors`` file, a directory of them, or an open checkpoint.
        config: a :class:`PleConfig`, an HF config dict, or a ``config.json`` / model directory.
        ple_index: ``l``, the position in the sorted ``ple_layer_ids``.
        region: rows and values to read (default: the whole ``[R, d]`` table); a rank's
            part under tensor parallelism is :meth:`PleTableRegion.width_shard`.
        out: where to write: a tensor of the region's shape (filled whole), or of the whole
            table's ``[R, d]`` (the region's rows and values at their places; the rest is not
            touched); any device. None: a new CPU tensor of the region's shape.
        dtype: the model dtype wanted (default: ``out``'s, else the stored dtype). The table
            must be stored in it or in a narrower float that converts exactly (bf16 into an
            fp32 model); anything that would round is refused.
        block_rows: rows per block (default: about ``DEFAULT_BLOCK_BYTES``).
        prefix: ``<P>``; None finds it (:func:`find_ple_prefix`).

    Returns:
        ``out`` (the caller's tensor, or the new one).

    Raises:
        CheckpointError: see :func:`plan_ple_table`; a block holding NaN or inf.
        ValidationError: ``region``, ``out`` or ``dtype`` does not fit the table.
    """
    with _opened(checkpoint) as ckpt:
        plan = plan_ple_table(ckpt, config, ple_index, prefix=prefix)
        region = PleTableRegion.whole(plan.rows, plan.width) if region is None else region
        region.check(plan.rows, plan.width)
        out, view = _destination(plan, region, out, dtype)
        for local_row, block in _iter_blocks(plan, region, _block_rows(plan, region, block_rows)):
            view[local_row : local_row + block.shape[0]].copy_(block)
    return out


# -- hash buffers ----------------------------------------------------------------------------


def _check_buffers(
    ckpt: SafetensorsCheckpoint,
    cfg: PleConfig,
    consts: PleConstants,
    ple_index: int,
    decoder_layer: int,
    prefix: str,
) -> tuple[str, ...]:
    expected = {
        "layer_multipliers": (consts.multipliers[ple_index], "m_i, splitmix64 of the seed"),
        "ngram_heads_vocab_sizes": (consts.head_sizes[ple_index], "p_c, the head primes"),
        "ngram_heads_offsets": (consts.offsets[ple_index], "off_c, running sums of p_c"),
    }
    found = []
    for buffer in BUFFER_NAMES:
        name = f"{prefix}layers.{decoder_layer}.ple.ple_embedding.{buffer}"
        read = read_tensor(ckpt, [name])
        if read is None:
            continue
        tensor = read[1]
        values, what = expected[buffer]
        wanted = [int(v) for v in values]
        if tensor.dtype != torch.int64 or list(tensor.shape) != [len(wanted)]:
            raise CheckpointError(
                f"tensor {name!r} has {describe_tensor(tensor)}; expected torch.int64 "
                f"[{len(wanted)}] ({what})"
            )
        stored = [int(v) for v in tensor.tolist()]
        for index, (have, want) in enumerate(zip(stored, wanted, strict=True)):
            if have != want:
                raise CheckpointError(
                    f"tensor {name!r} holds {have} at index {index}; the config gives {want} "
                    f"({what}; seed={cfg.seed}, vocab_size={cfg.vocab_size}, "
                    f"ngram_vocab_size_base={cfg.ngram_vocab_size_base}, PLE index {ple_index}): "
                    f"the checkpoint was hashed with other constants than the config's"
                )
        found.append(name)
    return tuple(found)


def check_ple_buffers(
    checkpoint: Checkpoint, config: ConfigSource, ple_index: int, *, prefix: str | None = None
) -> tuple[str, ...]:
    """Compare PLE layer ``ple_index``'s stored hash buffers with the config's constants.

    Each of :data:`BUFFER_NAMES` the checkpoint holds must be int64 of the right length and
    equal, element for element, to :meth:`PleConstants.from_config`'s; one it does not hold
    is fine (the constants are computed from the config).

    Returns:
        The names of the buffers found (all equal).

    Raises:
        CheckpointError: a buffer differs, naming the tensor, the first differing index and
            both values; or has another dtype or length.
    """
    cfg = _resolve_config(config)
    decoder_layer = _decoder_layer(cfg, ple_index)
    with _opened(checkpoint) as ckpt:
        prefix = _prefix(ckpt, decoder_layer, prefix)
        consts = PleConstants.from_config(cfg)
        return _check_buffers(ckpt, cfg, consts, ple_index, decoder_layer, prefix)


# -- layer weights ---------------------------------------------------------------------------


def read_ple_layer_weights(
    checkpoint: Checkpoint,
    config: ConfigSource,
    ple_index: int,
    *,
    dtype: torch.dtype | None = None,
    prefix: str | None = None,
) -> PleLayerWeights:
    """The six weights of PLE layer ``ple_index`` (:class:`PleLayerWeights`), on the CPU.

    Each is read whole, refused when it holds NaN or inf (naming it), and the six are checked
    against the config's ``hidden_size``, ``hc_count``, ``ple_embed_dim`` and
    ``ple_conv_kernel_size`` (:meth:`PleLayerWeights.from_state_dict`).

    Args:
        dtype: the model dtype wanted (default: the stored one); as in :func:`read_ple_table`,
            only a conversion that keeps every value is done.

    Raises:
        CheckpointError: a weight is missing, not a model dtype, not finite, or of the wrong
            shape (naming it).
        ValidationError: ``dtype`` would round the stored weights.
    """
    cfg = _resolve_config(config)
    decoder_layer = _decoder_layer(cfg, ple_index)
    if dtype is not None and dtype not in _MODEL_DTYPES:
        raise ValidationError(f"dtype={dtype}; expected one of {_MODEL_DTYPES}")
    with _opened(checkpoint) as ckpt:
        prefix = _prefix(ckpt, decoder_layer, prefix)
        state: dict[str, torch.Tensor] = {}
        for name in PleLayerWeights.checkpoint_names(decoder_layer, prefix).values():
            read = read_tensor(ckpt, [name])
            if read is None:
                continue  # from_state_dict names every missing one
            tensor = read[1]
            if tensor.dtype not in TABLE_DTYPES.values():
                raise CheckpointError(
                    f"tensor {name!r} has {describe_tensor(tensor)}; expected a model dtype "
                    f"({', '.join(str(d) for d in TABLE_DTYPES.values())})"
                )
            check_head_weight(tensor, name=name)
            if dtype is not None:
                _check_cast(f"tensor {name!r}", tensor.dtype, dtype)
                tensor = tensor.to(dtype)
            state[name] = tensor
    return PleLayerWeights.from_state_dict(
        state,
        decoder_layer,
        hidden_size=cfg.hidden_size,
        hc_count=cfg.hc_count,
        embed_dim=cfg.embed_dim,
        conv_kernel_size=cfg.ple_conv_kernel_size,
        prefix=prefix,
    )
