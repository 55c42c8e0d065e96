"""A memory family as a value: what one model's hashed n-gram memory is made of.

A *family* (DeepSeek's Engram, Qwen4-Exp's per-layer n-gram embeddings) is described by
small frozen values that the runtime's pieces (memory plans, tiers, loaders, kernels)
can read without knowing which model it is:

- :class:`RowFormat`: how one table row is stored (fp8 values with ue8m0 scales per 32,
  or bf16), with the integer :attr:`RowFormat.kernel_id` kernels take as a constexpr;
- :class:`TableSpec`: one layer's table (rows, the width of a row, its format, the hash
  columns and the row range each owns, how tensor parallelism splits it);
- :class:`TensorRole`: a checkpoint tensor the family reads (role, name, dtype, shape);
- :class:`MemoryFamily`: the family itself (its name, layer ids, tables, tensor roles,
  the id history a request carries between steps, and a fingerprint of its hashing).

Families are registered by name and resolved lazily (:func:`register_family`,
:func:`resolve_family`): the registry holds ``"module:attribute"`` strings, so naming a
family imports nothing until it is resolved. A family outside engramrt registers itself
from its own distribution through an ``engramrt.families`` entry point (a function that
calls :func:`register_family`), read the first time the registry is asked, and names the
module of its command-line hooks (:func:`command_line_hooks`), so that ``engramrt hash``,
``plan`` and ``inspect`` take its configs without an edit to engramrt. Each registration may also say what marks
an HF ``config.json`` as the family's (its ``model_type`` values, fields only it has), so
:func:`family_of_config` names the family of a config without importing any family.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engramrt.errors import ValidationError

__all__ = [
    "BF16",
    "FP8_UE8M0",
    "ROW_FORMATS",
    "ConfigMarkers",
    "MemoryFamily",
    "RowFormat",
    "TableSpec",
    "TensorRole",
    "command_line_hooks",
    "family_names",
    "family_of_config",
    "layer_tables",
    "register_family",
    "resolve_family",
    "unregister_family",
]

SHARD_RULES = ("columns", "width")
"""How tensor parallelism splits a table: ``"columns"``, each rank owns a contiguous run
of hash columns and so a contiguous range of rows (DeepSeek Engram); ``"width"``, each
rank owns a slice of every row's values (Qwen4-Exp PLE's ``embedding_colwise``)."""


@dataclass(frozen=True)
class RowFormat:
    """How one row of ``width`` values is stored.

    Attributes:
        name: ``"fp8-ue8m0-32"`` or ``"bf16"``.
        kernel_id: the constexpr kernels branch on (0 and 1).
        value_bytes: bytes per value.
        scale_block: values sharing one scale byte stored after them (0: no scales).
    """

    name: str
    kernel_id: int
    value_bytes: int
    scale_block: int = 0

    def row_bytes(self, width: int) -> int:
        """Bytes of one stored row of ``width`` values (264 for fp8 ``E = 256``; 320 for
        bf16 ``d = 160``)."""
        self.check_width(width)
        scales = width // self.scale_block if self.scale_block else 0
        return width * self.value_bytes + scales

    def width_for(self, row_bytes: int) -> int:
        """Values in one stored row of ``row_bytes`` bytes (the inverse of :meth:`row_bytes`:
        256 for fp8 rows of 264 B; 160 for bf16 rows of 320 B)."""
        block = self.scale_block or 1  # values per scale byte, or a lone value
        block_bytes = block * self.value_bytes + (1 if self.scale_block else 0)
        if isinstance(row_bytes, bool) or row_bytes <= 0 or row_bytes % block_bytes:
            raise ValidationError(
                f"rows of {row_bytes} bytes; expected {self.name} rows, a positive multiple "
                f"of {block_bytes} bytes ({block} value{'s' if block > 1 else ''} each)"
            )
        return row_bytes // block_bytes * block

    def describe(self, width: int) -> str:
        """``"bf16 rows of width 160"``: what a table of this format holds, for messages."""
        return f"{self.name} rows of width {width}"

    def check_width(self, width: int) -> None:
        """Refuse a row width this format cannot store."""
        if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
            raise ValidationError(f"width={width!r}; expected a positive int (values per row)")
        if self.scale_block and width % self.scale_block:
            raise ValidationError(
                f"width={width} for row format {self.name!r}; expected a multiple of "
                f"{self.scale_block} (one scale byte per {self.scale_block} values)"
            )


FP8_UE8M0 = RowFormat("fp8-ue8m0-32", kernel_id=0, value_bytes=1, scale_block=32)
"""fp8 e4m3fn values, then one ue8m0 scale byte per 32 (DeepSeek Engram)."""
BF16 = RowFormat("bf16", kernel_id=1, value_bytes=2)
"""bf16 values, no scales (Qwen4-Exp PLE)."""
ROW_FORMATS: dict[str, RowFormat] = {f.name: f for f in (FP8_UE8M0, BF16)}


@dataclass(frozen=True)
class TableSpec:
    """One layer's table.

    Attributes:
        layer_id: the model layer the table belongs to (the family's own numbering).
        rows: rows stored (at least the rows the columns address; padding included).
        width: values per row (one hash column's row).
        row_format: how a row is stored.
        col_offsets: ``[C]`` the first row of each hash column's range.
        col_rows: ``[C]`` rows in each column's range (the column's modulus).
        shard: how tensor parallelism splits the table (:data:`SHARD_RULES`).
    """

    layer_id: int
    rows: int
    width: int
    row_format: RowFormat
    col_offsets: tuple[int, ...]
    col_rows: tuple[int, ...]
    shard: str = "columns"

    def __post_init__(self) -> None:
        self.row_format.check_width(self.width)
        if len(self.col_offsets) != len(self.col_rows) or not self.col_rows:
            raise ValidationError(
                f"col_offsets has {len(self.col_offsets)} entries and col_rows "
                f"{len(self.col_rows)}; expected one per hash column, at least one"
            )
        end = max(o + n for o, n in zip(self.col_offsets, self.col_rows, strict=True))
        if self.rows < end:
            raise ValidationError(
                f"rows={self.rows:,} for layer {self.layer_id}; its hash columns address "
                f"rows up to {end:,}"
            )
        if self.shard not in SHARD_RULES:
            raise ValidationError(f"shard={self.shard!r}; expected one of {SHARD_RULES}")

    @property
    def num_cols(self) -> int:
        """``C``: hash columns (rows read per token)."""
        return len(self.col_rows)

    @property
    def row_bytes(self) -> int:
        return self.row_format.row_bytes(self.width)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole table as stored."""
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class TensorRole:
    """A checkpoint tensor a family reads.

    Attributes:
        role: what it holds (``"table"``, ``"scale"``, ``"key_proj"``, ...).
        name: its checkpoint name (the first of the names tried).
        dtypes: the dtypes it may be stored in, as torch spells them (``"float8_e4m3fn"``,
            ``"bfloat16"``).
        shape: its shape.
        layer_id: the layer it belongs to.
        optional: whether a checkpoint may leave it out (a scale that only an fp8 form has).
    """

    role: str
    name: str
    dtypes: tuple[str, ...]
    shape: tuple[int, ...]
    layer_id: int
    optional: bool = False


@runtime_checkable
class MemoryFamily(Protocol):
    """One model's hashed n-gram memory.

    Attributes:
        name: the registered name (``"deepseek-engram"``, ``"qwen4-ple"``).
        layer_ids: the model layers with a memory layer, in the order row ids list them.
        history_window: earlier ids of its request a token's row ids read (``N - 1``).
    """

    name: str
    layer_ids: tuple[int, ...]
    history_window: int

    def tables(self) -> list[TableSpec]:
        """Every memory layer's table, in :attr:`layer_ids` order."""
        ...

    def tensor_roles(self) -> list[TensorRole]:
        """The checkpoint tensors of every memory layer (tables and the layer's weights)."""
        ...

    def fingerprint(self) -> str:
        """A hex digest of everything that decides which row a token reads: tables built
        for another fingerprint hold other rows."""
        ...


@dataclass(frozen=True)
class ConfigMarkers:
    """What marks an HF ``config.json`` as one family's (see :func:`family_of_config`).

    Attributes:
        model_types: ``model_type`` values of the family's configs (top level or
            ``text_config``).
        fields: fields only the family's configs have (top level or ``text_config``).
    """

    model_types: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()


_REGISTRY: dict[str, str] = {
    "deepseek-engram": "engramrt.families.deepseek_engram.family:DeepSeekEngramFamily",
    "qwen4-ple": "engramrt.families.qwen4_ple.family:Qwen4PleFamily",
}
_MARKERS: dict[str, ConfigMarkers] = {
    # DeepSeek-V4 configs carry the engram_* fields; their model_type is not the family's own.
    "deepseek-engram": ConfigMarkers(fields=("engram_layer_ids",)),
    "qwen4-ple": ConfigMarkers(
        model_types=("qwen4_exp", "qwen4_exp_text"), fields=("ple_layer_ids", "ple_embed_dim")
    ),
}
_COMMAND_LINE: dict[str, str] = {}
"""Per family registered with one, the module of its command-line hooks (engramrt's own
families' hooks live in its command line)."""

ENTRY_POINT_GROUP = "engramrt.families"
"""The entry-point group of families registered by other distributions: each entry is a
function of no arguments that calls :func:`register_family`."""
_entry_points_loaded = False


def _load_entry_points() -> None:
    """Run every ``engramrt.families`` entry point once (a failing one names itself)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()()
        except Exception as error:
            raise ValidationError(
                f"the {ENTRY_POINT_GROUP} entry point {point.name!r} ({point.value}) failed to "
                f"register its family: {error}"
            ) from error


def register_family(
    name: str,
    target: str,
    *,
    model_types: Sequence[str] = (),
    config_fields: Sequence[str] = (),
    command_line: str | None = None,
) -> None:
    """Register the family class ``target`` (``"package.module:Class"``) under ``name``.
    Nothing is imported until :func:`resolve_family` is called. ``model_types`` and
    ``config_fields`` mark its HF configs for :func:`family_of_config`; ``command_line``
    names the module of its command-line hooks (:func:`command_line_hooks`)."""
    if not isinstance(name, str) or not name:
        raise ValidationError(f"name={name!r}; expected a non-empty family name")
    module, sep, attr = str(target).partition(":")
    if not sep or not module or not attr:
        raise ValidationError(
            f"target={target!r} for family {name!r}; expected 'package.module:Class'"
        )
    for option, values in (("model_types", model_types), ("config_fields", config_fields)):
        if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
            raise ValidationError(
                f"{option}={values!r} for family {name!r}; expected a list of non-empty strings"
            )
    if command_line is not None and (not isinstance(command_line, str) or not command_line):
        raise ValidationError(
            f"command_line={command_line!r} for family {name!r}; expected a module name"
        )
    _REGISTRY[name] = target
    _MARKERS[name] = ConfigMarkers(tuple(model_types), tuple(config_fields))
    if command_line is None:
        _COMMAND_LINE.pop(name, None)
    else:
        _COMMAND_LINE[name] = command_line


def unregister_family(name: str) -> None:
    """Forget family ``name`` (a test's, or one registered by mistake)."""
    for table in (_REGISTRY, _MARKERS, _COMMAND_LINE):
        table.pop(name, None)


def family_names() -> list[str]:
    """The registered family names."""
    _load_entry_points()
    return sorted(_REGISTRY)


def command_line_hooks(name: str) -> Any:
    """The module of family ``name``'s command-line hooks (imported now), or None.

    The hooks, each optional (a command the family does not serve says so):
    ``read_config(loaded) -> config`` (what the family class takes, from the
    ``--config`` value: ``loaded.text``, ``loaded.data``, the parsed config.json),
    ``hash_run(run, loaded) -> bool`` (``engramrt hash``: print or save the row ids of
    ``run.token_ids()`` streamed in ``run.chunk_sizes``; whether they equal one-shot
    hashing), ``inspect_report(loaded, tp) -> dict`` and ``print_inspect(report)``
    (``engramrt inspect -c``).
    """
    _load_entry_points()
    module = _COMMAND_LINE.get(name)
    if module is None:
        return None
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ValidationError(
            f"family {name!r} names {module!r} for its command-line hooks, which cannot be "
            f"imported: {error}"
        ) from error


def resolve_family(name: str) -> Any:
    """The family class registered under ``name`` (imported now)."""
    _load_entry_points()
    target = _REGISTRY.get(name)
    if target is None:
        raise ValidationError(f"family={name!r}; expected one of {', '.join(family_names())}")
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise ValidationError(
            f"family {name!r} is registered as {target!r}, which cannot be imported: {error}"
        ) from error


def family_of_config(config: Mapping[str, Any], *, what: str = "config") -> str | None:
    """The registered family an HF ``config.json`` object describes, or None when no
    family's markers (:class:`ConfigMarkers`) are in it.

    A ``model_type`` (of the config or of its ``text_config``, where a composite config
    keeps the language model's fields) decides first; without one a family claims, fields
    only one family has decide. Imports no family. ``what`` names the config in errors.

    Raises:
        ValidationError: ``config`` is not an object, or it carries two families' marks.
    """
    if not isinstance(config, Mapping):
        raise ValidationError(f"{what} is a {type(config).__name__}; expected a JSON object")
    _load_entry_points()
    text_config = config.get("text_config")
    parts = [config, *([text_config] if isinstance(text_config, Mapping) else [])]
    model_types = {t for part in parts if isinstance(t := part.get("model_type"), str)}
    by_type = {n: m for n, m in _MARKERS.items() if model_types & set(m.model_types)}
    if len(by_type) == 1:
        return next(iter(by_type))
    if len(by_type) > 1:
        raise ValidationError(
            f"{what} has model_type {sorted(model_types)}, claimed by the families "
            f"{sorted(by_type)}; expected a config of one family"
        )
    by_field = {
        name: sorted({f for f in markers.fields for part in parts if f in part})
        for name, markers in _MARKERS.items()
    }
    found = {name: fields for name, fields in by_field.items() if fields}
    if len(found) > 1:
        listed = "; ".join(f"{name}: {', '.join(fields)}" for name, fields in sorted(found.items()))
        raise ValidationError(
            f"{what} has the fields of several memory families ({listed}); expected the "
            f"fields of one"
        )
    return next(iter(found), None)


def column_ranges(offsets: Sequence[int], rows: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``(col_offsets, col_rows)`` as tuples of Python ints (from numpy rows or lists)."""
    return tuple(int(v) for v in offsets), tuple(int(v) for v in rows)


def layer_tables(
    layer_ids: Sequence[int],
    rows: Sequence[int],
    width: int,
    row_format: RowFormat,
    offsets: Any,
    col_rows: Any,
    shard: str,
) -> list[TableSpec]:
    """One :class:`TableSpec` per layer of ``layer_ids``, in order: layer ``i``'s table holds
    ``rows[i]`` rows of ``width`` values stored as ``row_format``, its hash columns' ranges
    start at ``offsets[i]`` and hold ``col_rows[i]`` rows (``[L, C]``, numpy or lists), and
    tensor parallelism splits it by ``shard``: what every family's ``tables()`` returns."""
    tables = []
    for index, layer in enumerate(layer_ids):
        col_offsets, rows_per_col = column_ranges(offsets[index], col_rows[index])
        tables.append(
            TableSpec(
                layer_id=layer,
                rows=rows[index],
                width=width,
                row_format=row_format,
                col_offsets=col_offsets,
                col_rows=rows_per_col,
                shard=shard,
            )
        )
    return tables
