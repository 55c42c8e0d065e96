"""Read Engram tables out of safetensors checkpoints, one rank's rows at a time.

A checkpoint is one ``*.safetensors`` file or a directory of them, with or
without a ``*.safetensors.index.json`` (Hugging Face's ``weight_map``:
tensor name -> file). A tensor named in the index is read from the file
the index names; any other is looked up in the headers of every file of
the directory (a header is one small read, no tensor data).

Loading a tensor-parallel rank reads only that rank's rows
(:meth:`EngramLayout.column_shard`), through ``safe_open(...).get_slice``
in blocks of ``block_rows`` rows, and writes each block into a
:class:`~engramrt.lookup.tiers.RowStore`: peak memory is the store plus one
block, never the table twice. The rows may come from one full tensor (a
DeepSeek checkpoint) or be stitched from several partial ones (the
per-rank files of ``engramrt convert --tp N``, which record the global
rows they hold in their metadata), so a tp=2 rank can load from a tp=4
conversion.

A checkpoint holds the files it resolved: each is opened once, when the
:class:`SafetensorsCheckpoint` is made, and every later read (headers,
tensors) goes through that open descriptor (``/proc/self/fd/<n>``), not
the path. A conversion committing into the directory meanwhile renames new
files over the old names; the descriptors keep the old inodes, so one load
reads one set, never layer 1 of one conversion and layer 3 of the next. The
set is checked once its files are open (every file of the manifest carries
the manifest's conversion id, read through the descriptor); a set that
changed between the manifest and the opens is resolved again, and one that
keeps changing is a :class:`CheckpointError`. Where ``/proc/self/fd`` is
missing, each read first checks that the path still names the held file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import torch

from engramrt.checkpoint.conversion_set import (
    META_CONVERSION_ID,
    ConversionManifest,
    is_output_name,
    read_manifest,
    resolve_directory,
)
from engramrt.checkpoint.finite import check_packed_rows_finite
from engramrt.checkpoint.metadata import RowRange, check_token_map, tensor_row_ranges
from engramrt.checkpoint.names import TensorNames
from engramrt.checkpoint.safetensors_format import (
    META_DATA_SHA256,
    SafetensorsHeader,
    TensorEntry,
    data_digest,
    read_header,
)
from engramrt.config import EngramConfig, load_config
from engramrt.errors import CheckpointError, ValidationError
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.packed import pack_rows, row_bytes_for
from engramrt.tokenmap import TokenMap

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "FP8_DTYPE",
    "SCALE_DTYPES_READ",
    "SOURCE_DTYPES",
    "ConfigSource",
    "NamesSpec",
    "SafetensorsCheckpoint",
    "TensorLocation",
    "TensorPiece",
    "default_block_rows",
    "iter_packed_rows",
    "open_checkpoint",
    "read_table",
    "read_tensor",
]

DEFAULT_BLOCK_BYTES = 64 * 2**20
"""Rows are streamed in blocks of about this many bytes (see :func:`default_block_rows`)."""

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES_READ = ("F8_E8M0", "U8")
SOURCE_DTYPES = ("BF16", "F16", "F32")

ConfigSource: TypeAlias = "EngramConfig | str | Path | Mapping[str, Any]"
"""A config, preset name, ``config.json`` / model directory, or HF dict (see ``load_config``)."""

NamesSpec: TypeAlias = "TensorNames | Mapping[str, Any] | str | os.PathLike[str] | None"
"""Tensor names: defaults (None), role overrides, or a JSON file of them."""

_TORCH_NAMES = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "U8": "uint8",
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
}

INDEX_SUFFIX = ".safetensors.index.json"
_LISTED_FILES = 6
_RESOLVE_ATTEMPTS = 5
"""Times a directory's set is resolved again when a conversion changed it meanwhile."""


def default_block_rows(row_bytes: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Rows per streamed block: ``block_bytes`` worth of rows of ``row_bytes`` bytes, at least 1."""
    return max(1, block_bytes // max(1, row_bytes))


def check_block_rows(block_rows: int | None, row_bytes: int) -> int:
    """``block_rows`` checked (a positive int), or the default for rows of ``row_bytes``."""
    if block_rows is None:
        return default_block_rows(row_bytes)
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValidationError(f"block_rows = {block_rows!r}; expected a positive integer")
    return block_rows


@dataclass(frozen=True)
class TensorLocation:
    """A tensor in one file, and the global table rows its local rows hold.

    ``row_range`` is ``None`` for a tensor that is a full table (local row
    ``i`` is global row ``i``), else the range its file's engramrt metadata
    records.
    """

    name: str
    file: Path
    entry: TensorEntry
    row_range: RowRange | None
    checkpoint: SafetensorsCheckpoint | None = field(default=None, compare=False, repr=False)
    """The checkpoint holding ``file`` open (kept alive by this reference), or None."""

    @property
    def open_path(self) -> str:
        """Where ``file``'s bytes are read from now: the checkpoint's held descriptor
        (see the module doc), or ``file`` itself. Use it at once, never store it: a
        descriptor number means another file after the checkpoint is closed."""
        return str(self.file) if self.checkpoint is None else self.checkpoint.open_path(self.file)

    @property
    def row_begin(self) -> int:
        return 0 if self.row_range is None else self.row_range.row_begin

    @property
    def row_end(self) -> int:
        if self.row_range is not None:
            return self.row_range.row_end
        return self.entry.shape[0] if self.entry.shape else 0

    def describe(self) -> str:
        rows = f", rows [{self.row_begin}, {self.row_end})" if self.row_range is not None else ""
        return (
            f"{self.name!r} in {self.file.name} ({self.entry.dtype} {list(self.entry.shape)}{rows})"
        )


@dataclass(frozen=True)
class TensorPiece:
    """Global rows ``[row_begin, row_end)`` read from ``location``."""

    row_begin: int
    row_end: int
    location: TensorLocation

    def local(self, row_begin: int, row_end: int) -> slice:
        """The local slice of the tensor holding global rows ``[row_begin, row_end)``."""
        offset = self.location.row_begin
        return slice(row_begin - offset, row_end - offset)


class SafetensorsCheckpoint:
    """A safetensors checkpoint: one file, or a directory of files (optionally indexed).

    Args:
        path: a ``.safetensors`` file or a directory holding ``*.safetensors``
            files and optionally ``model.safetensors.index.json``.

    Raises:
        CheckpointError: the path does not exist, holds no safetensors file,
            or its index is unreadable.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.weight_map: dict[str, str] = {}
        self.index_files: list[Path] = []
        self._held: dict[Path, int] = {}  # file -> descriptor held open (see the module doc)
        self._manifest_id: str | None = None  # the conversion id of the manifest resolved
        if self.path.is_file():
            self.files = [self.path]
            self._hold(self.path)
        elif self.path.is_dir():
            self.files = self._hold_set()
            self.index_files = sorted(p for p in self.path.glob(f"*{INDEX_SUFFIX}") if p.is_file())
            for index in self.index_files:
                self.weight_map.update(self._read_index(index))
            if not self.files and not self.weight_map:
                raise CheckpointError(
                    f"checkpoint directory {str(self.path)!r} holds no *.safetensors file"
                )
        else:
            raise CheckpointError(f"checkpoint {str(self.path)!r} does not exist")
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._ranges: dict[Path, dict[str, RowRange]] = {}
        self._verified: dict[Path, str | None] = {}
        self._conversion_id: str | None = None

    # -- the held set --------------------------------------------------------------------

    def _hold(self, file: Path) -> int:
        """Open ``file`` once (read-only) and keep the descriptor; returns it."""
        if file not in self._held:
            try:
                self._held[file] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise CheckpointError(f"{file} cannot be opened: {exc}") from exc
        return self._held[file]

    def _release(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def close(self) -> None:
        """Close the files this checkpoint holds (reads after this reopen them by path)."""
        self._release()
        self._headers.clear()
        self._ranges.clear()
        self._verified.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Descriptor numbers mean nothing in another process: a copy reopens by path.
        return {**self.__dict__, "_held": {}}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._release()

    def open_path(self, file: Path) -> str:
        """The path through which ``file``'s bytes are read: its held descriptor.

        ``/proc/self/fd/<n>`` opens the very inode held, whatever was renamed
        over ``file`` since. Without ``/proc`` the path itself, once checked
        to still name the held inode.
        """
        fd = self._hold(file)
        proc = f"/proc/self/fd/{fd}"
        if os.path.exists(proc):
            return proc
        held, now = os.fstat(fd), _stat_or_none(file)
        if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise CheckpointError(
                f"{file} was replaced while this checkpoint was being read (a conversion "
                f"committed into {file.parent}); load again"
            )
        return str(file)

    def _hold_set(self) -> list[Path]:
        """Resolve the directory's set and open its files, again while a conversion changes it.

        An attempt that fails (a file renamed away between the manifest and
        its open) or finds the held files mixed is repeated when the
        directory changed meanwhile (its manifest or any entry's inode);
        a failure in a directory that did not change is the directory's own.
        """
        changes = []
        for _attempt in range(_RESOLVE_ATTEMPTS):
            before = self._snapshot()
            manifest = before[0]
            try:
                files = resolve_directory(
                    self.path, sorted(p for p in self.path.glob("*.safetensors") if p.is_file())
                )
                for file in files:
                    self._hold(file)
                mixed = self._held_ids(files, manifest)
            except CheckpointError as exc:
                self._release()
                if self._snapshot() == before:
                    raise  # not a conversion committing meanwhile: the directory is wrong
                changes.append(str(exc))
                continue
            if mixed is None:
                self._manifest_id = None if manifest is None else manifest.conversion_id
                return files
            self._release()
            changes.append(mixed)
        raise CheckpointError(
            f"{self.path}: its conversion set changed {_RESOLVE_ATTEMPTS} times while it was "
            f"being opened (a conversion is committing into it; last: {changes[-1]}); load "
            f"again when the conversion has finished"
        )

    def _snapshot(self) -> tuple[ConversionManifest | None, list[tuple[str, int]]]:
        """The manifest and every entry's (name, inode): what a committing conversion changes."""
        try:
            entries = sorted((e.name, e.inode()) for e in os.scandir(self.path))
        except OSError:
            entries = []
        try:
            manifest = read_manifest(self.path)
        except CheckpointError:
            manifest = None
        return manifest, entries

    def _held_ids(self, files: Sequence[Path], manifest: ConversionManifest | None) -> str | None:
        """None when the held files are one set, else what is mixed.

        The ids are read through the descriptors, so they are those of the
        bytes every later read sees. With a manifest, the first
        ``len(manifest.files)`` of ``files`` are its set (see
        :func:`resolve_directory`); without one, the engramrt outputs.
        """
        if manifest is not None:
            in_set = files[: len(manifest.files)]
        else:
            in_set = [f for f in files if is_output_name(f.name)]
        ids = {
            f: read_header(f, open_path=self.open_path(f)).metadata.get(META_CONVERSION_ID)
            for f in in_set
        }
        if manifest is not None:
            wrong = sorted((f.name, cid) for f, cid in ids.items() if cid != manifest.conversion_id)
            if wrong:
                found = ", ".join(f"{name} is conversion {cid}" for name, cid in wrong)
                return f"{found} but the manifest names {manifest.conversion_id}"
            return None
        if len({cid for cid in ids.values() if cid is not None}) > 1:
            return ", ".join(f"{f.name} is conversion {cid}" for f, cid in sorted(ids.items()))
        return None

    @staticmethod
    def _read_index(index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"index {str(index)!r} cannot be read as JSON: {exc}") from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"index {str(index)!r} has no weight_map object of tensor name -> file name"
            )
        return weight_map

    def verify(self, file: Path) -> str | None:
        """Check ``file``'s content checksum (read whole, once per checkpoint); returns it.

        None for a file that records none (not converted by engramrt, or by
        an older one): there is nothing to check.

        Raises:
            CheckpointError: the bytes do not give the recorded checksum
                (naming the file and both digests).
        """
        if file in self._verified:
            return self._verified[file]
        header = self.header(file)
        recorded = header.metadata.get(META_DATA_SHA256)
        if recorded is not None:
            found = data_digest(header, open_path=self.open_path(file))
            if found != recorded:
                raise CheckpointError(
                    f"{file}: its content checksum is {found} but its metadata records "
                    f"{META_DATA_SHA256}={recorded}: the file changed after it was written "
                    f"(corrupted or edited); convert again"
                )
        self._verified[file] = recorded
        return recorded

    @property
    def conversion_id(self) -> str:
        """An id of the set this checkpoint holds, equal on every rank that opened the same set.

        The conversion id of an engramrt conversion (the manifest's, or the one
        id its files carry); for other checkpoints (a DeepSeek release, files
        engramrt did not write), ``"headers:<sha256>"`` of every held file's
        name, tensors (name, dtype, shape, offsets) and metadata: the same on
        every host holding the same files, different once any is rewritten.
        Compared across ranks by the loaders' ``group=`` (see
        :mod:`engramrt.checkpoint.ranks`).
        """
        if self._conversion_id is None:
            self._conversion_id = self._manifest_id or self._own_conversion_id()
        return self._conversion_id

    def _own_conversion_id(self) -> str:
        headers = {f: self.header(f) for f in sorted(self.files)}
        ids = {h.metadata.get(META_CONVERSION_ID) for h in headers.values()}
        if len(ids) == 1 and None not in ids:
            return str(ids.pop())
        digest = hashlib.sha256()
        for file, header in headers.items():
            tensors = sorted(
                (e.name, e.dtype, list(e.shape), e.begin, e.end) for e in header.tensors.values()
            )
            record = [file.name, tensors, sorted(header.metadata.items()), header.file_size]
            digest.update(json.dumps(record).encode() + b"\n")
        return f"headers:{digest.hexdigest()}"

    def header(self, file: Path) -> SafetensorsHeader:
        """The parsed header of ``file`` (cached)."""
        if file not in self._headers:
            header = read_header(file, open_path=self.open_path(file))
            self._headers[file] = header
            self._ranges[file] = tensor_row_ranges(header.metadata, file)
        return self._headers[file]

    def describe(self) -> str:
        """Where tensors are searched, for error messages."""
        if self.path.is_file():
            return str(self.path)
        names = [f.name for f in self.files]
        listed = ", ".join(names[:_LISTED_FILES])
        if len(names) > _LISTED_FILES:
            listed += f", ... {len(names) - _LISTED_FILES} more"
        index = f"; index {', '.join(i.name for i in self.index_files)}" if self.index_files else ""
        return f"{self.path} ({len(names)} file(s): {listed}{index})"

    def locations(self, name: str) -> list[TensorLocation]:
        """Every file holding a tensor called ``name`` (the index's file, if it lists ``name``)."""
        if name in self.weight_map:
            file = self.path / self.weight_map[name]
            index = ", ".join(i.name for i in self.index_files)
            if not file.is_file():
                raise CheckpointError(
                    f"index {index} maps tensor {name!r} to {file.name}, which does not exist "
                    f"in {self.path}"
                )
            if name not in self.header(file).tensors:
                raise CheckpointError(
                    f"index {index} maps tensor {name!r} to {file.name}, whose header lacks it"
                )
            files = [file]
        else:
            files = [f for f in self.files if name in self.header(f).tensors]
        found = [
            TensorLocation(
                name,
                f,
                self.header(f).tensors[name],
                self._ranges[f].get(name),
                self,
            )
            for f in files
        ]
        for first, second in itertools.combinations(found, 2):
            if first.row_begin < second.row_end and second.row_begin < first.row_end:
                raise CheckpointError(
                    f"tensor {name!r} is in two files of {self.path}: {first.describe()} and "
                    f"{second.describe()}, with overlapping rows; expected each row in one file "
                    f"(remove one, or list the tensor in a *{INDEX_SUFFIX} weight_map)"
                )
        return found

    def find(
        self,
        candidates: Sequence[str],
        *,
        role: str,
        layer_id: int,
        row_begin: int,
        row_end: int,
        check: Callable[[TensorLocation], None] | None = None,
    ) -> list[TensorPiece]:
        """Pieces of the first of ``candidates`` that exists, covering global rows ``[row_begin, row_end)``.

        ``check`` is called on every location found before the rows are
        matched, so a tensor of the wrong shape is reported as such.

        Raises:
            CheckpointError: no candidate exists (naming them, the layer and
                the files searched), or the tensors found do not cover the rows.
        """
        for name in candidates:
            found = self.locations(name)
            if found:
                if check is not None:
                    for location in found:
                        check(location)
                return _cover(found, row_begin, row_end, role=role, layer_id=layer_id)
        tried = " or ".join(repr(n) for n in candidates)
        raise CheckpointError(
            f"layer {layer_id}: no {role} tensor {tried} in {self.describe()}; "
            f"pass names= (engramrt convert --names) if the checkpoint names it differently"
        )


def open_checkpoint(
    checkpoint: SafetensorsCheckpoint | str | os.PathLike[str],
) -> SafetensorsCheckpoint:
    return (
        checkpoint
        if isinstance(checkpoint, SafetensorsCheckpoint)
        else SafetensorsCheckpoint(checkpoint)
    )


@contextlib.contextmanager
def _opened(
    checkpoint: SafetensorsCheckpoint | str | os.PathLike[str],
) -> Iterator[SafetensorsCheckpoint]:
    """The checkpoint, closed afterwards when it was opened here (a caller's is left open)."""
    if isinstance(checkpoint, SafetensorsCheckpoint):
        yield checkpoint
        return
    with SafetensorsCheckpoint(checkpoint) as ckpt:
        yield ckpt


def _cover(
    found: list[TensorLocation], row_begin: int, row_end: int, *, role: str, layer_id: int
) -> list[TensorPiece]:
    """Greedy cover of ``[row_begin, row_end)`` by the row ranges of ``found``."""
    pieces: list[TensorPiece] = []
    cursor = row_begin
    while cursor < row_end:
        usable = [loc for loc in found if loc.row_begin <= cursor < loc.row_end]
        if not usable:
            have = "; ".join(loc.describe() for loc in found)
            raise CheckpointError(
                f"layer {layer_id}: no {role} tensor holds global row {cursor}; rows "
                f"[{row_begin}, {row_end}) are needed and the checkpoint has {have}"
            )
        best = max(usable, key=lambda loc: loc.row_end)
        end = min(best.row_end, row_end)
        pieces.append(TensorPiece(cursor, end, best))
        cursor = end
    return pieces


def check_table_tensor(
    location: TensorLocation,
    *,
    role: str,
    layer_id: int,
    layer_index: int,
    dtypes: Sequence[str],
    width: int,
    width_note: str,
    config: EngramConfig,
    rows_needed: int,
) -> None:
    """Refuse a tensor whose dtype, row width or row count does not fit the config."""
    entry = location.entry
    where = f"tensor {location.name!r} in {location.file.name} (layer {layer_id} {role})"
    if entry.dtype not in dtypes:
        wanted = " or ".join(f"{d} (torch.{_TORCH_NAMES.get(d, d)})" for d in dtypes)
        raise CheckpointError(f"{where} has dtype {entry.dtype}; expected {wanted}")
    num_embeddings = config.num_embeddings[layer_index]
    rows = location.row_end - location.row_begin
    expected = [num_embeddings if location.row_range is None else rows, width]
    if len(entry.shape) != 2 or entry.shape[1] != width:
        raise CheckpointError(
            f"{where} has shape {list(entry.shape)}; expected {expected} ({width_note})"
        )
    if location.row_range is None:
        if entry.shape[0] != num_embeddings:
            raise CheckpointError(
                f"{where} has shape {list(entry.shape)}; expected [{num_embeddings}, {width}] "
                f"(engram_num_embeddings[{layer_index}] = {num_embeddings} rows; the hash layout "
                f"needs {rows_needed})"
            )
    else:
        if location.row_range.num_embeddings != num_embeddings:
            raise CheckpointError(
                f"{where} is a piece of a table of {location.row_range.num_embeddings} rows; "
                f"expected engram_num_embeddings[{layer_index}] = {num_embeddings}"
            )
        if entry.shape[0] != rows:
            raise CheckpointError(
                f"{where} has shape {list(entry.shape)}; expected {expected} (its metadata says "
                f"it holds rows [{location.row_begin}, {location.row_end}))"
            )


@dataclass(frozen=True)
class _Segment:
    """Global rows ``[row_begin, row_end)`` whose weight and scale each sit in one tensor."""

    row_begin: int
    row_end: int
    weight: TensorPiece
    scale: TensorPiece


def _merge(weight: list[TensorPiece], scale: list[TensorPiece]) -> list[_Segment]:
    bounds = sorted({p.row_begin for p in weight + scale} | {p.row_end for p in weight + scale})
    segments = []
    for begin, end in itertools.pairwise(bounds):
        w = next(p for p in weight if p.row_begin <= begin < p.row_end)
        s = next(p for p in scale if p.row_begin <= begin < p.row_end)
        segments.append(_Segment(begin, end, w, s))
    return segments


@dataclass(frozen=True)
class LayerRead:
    """A checked plan to read one layer's rows of one shard."""

    layer_index: int
    layer_id: int
    shard: ColumnShard
    E: int
    segments: tuple[_Segment, ...]


def plan_layer_read(
    checkpoint: SafetensorsCheckpoint,
    config: EngramConfig,
    layout: EngramLayout,
    layer_index: int,
    shard: ColumnShard,
    names: TensorNames,
) -> LayerRead:
    """Locate and check the weight and scale tensors holding ``shard``'s rows."""
    layer_id = config.layer_ids[layer_index]
    E = config.head_dim
    rows_needed = int(layout.rows_needed[layer_index])
    weight_names = names.per_layer("weight", config)[layer_index]
    scale_names = names.per_layer("scale", config)[layer_index]
    pieces: dict[str, list[TensorPiece]] = {}
    for role, candidates, dtypes, width, note in (
        ("weight", weight_names, (FP8_DTYPE,), E, f"engram_head_dim = {E}"),
        ("scale", scale_names, SCALE_DTYPES_READ, E // 32, f"one ue8m0 byte per 32 of E = {E}"),
    ):
        pieces[role] = checkpoint.find(
            candidates,
            role=role,
            layer_id=layer_id,
            row_begin=shard.row_begin,
            row_end=shard.row_end,
            check=functools.partial(
                check_table_tensor,
                role=role,
                layer_id=layer_id,
                layer_index=layer_index,
                dtypes=dtypes,
                width=width,
                width_note=note,
                config=config,
                rows_needed=rows_needed,
            ),
        )
    segments = _merge(pieces["weight"], pieces["scale"])
    return LayerRead(layer_index, layer_id, shard, E, tuple(segments))


def check_plan_token_map(
    checkpoint: SafetensorsCheckpoint,
    plan: LayerRead,
    config: EngramConfig,
    token_map: TokenMap | None,
) -> None:
    """Refuse a plan whose files were hashed with another token map (see :func:`check_token_map`)."""
    files = {p.location.file for s in plan.segments for p in (s.weight, s.scale)}
    check_token_map({f: checkpoint.header(f).metadata for f in sorted(files)}, config, token_map)


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def safe_slice(file: Path, name: str, open_path: str = "") -> Any:
    """``safe_open(file).get_slice(name)``, with the file's errors as :class:`CheckpointError`.

    ``open_path``: where to open the bytes (a held descriptor, see the module doc).
    """
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(open_path or str(file), framework="pt").get_slice(name)
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{file}: cannot read tensor {name!r}: {exc}") from exc


def read_rows(piece: TensorPiece, tensor_slice: Any, row_begin: int, row_end: int) -> torch.Tensor:
    """Global rows ``[row_begin, row_end)`` of ``piece`` (one ``get_slice`` read)."""
    local = piece.local(row_begin, row_end)
    try:
        return tensor_slice[local.start : local.stop]
    except Exception as exc:  # safetensors raises its own error types here
        raise CheckpointError(
            f"{piece.location.file}: reading rows [{local.start}, {local.stop}) of "
            f"{piece.location.name!r} failed: {exc}"
        ) from exc


def _where(location: TensorLocation) -> tuple[Path, str, str]:
    return location.file, location.name, location.open_path


def _iter_plan(plan: LayerRead, block_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    for segment in plan.segments:
        weight = safe_slice(*_where(segment.weight.location))
        scale = safe_slice(*_where(segment.scale.location))
        for begin in range(segment.row_begin, segment.row_end, block_rows):
            end = min(begin + block_rows, segment.row_end)
            values = read_rows(segment.weight, weight, begin, end)  # [n, E] float8_e4m3fn
            scales = read_rows(segment.scale, scale, begin, end)  # [n, E/32] e8m0 or uint8
            check_packed_rows_finite(
                values,
                scales,
                weight_name=segment.weight.location.name,
                scale_name=segment.scale.location.name,
                row_begin=begin,
            )
            yield begin - plan.shard.row_begin, pack_rows(values, scales)


def _resolve(
    config: ConfigSource,
    layout: EngramLayout | None,
) -> tuple[EngramConfig, EngramLayout]:
    cfg = load_config(config)
    if layout is None:
        layout = EngramLayout(cfg)
    elif layout.config != cfg:
        raise ValidationError(
            "layout was built for another config; expected layout.config == config"
        )
    return cfg, layout


def iter_packed_rows(
    checkpoint: SafetensorsCheckpoint | str | os.PathLike[str],
    config: ConfigSource,
    layer_index: int,
    *,
    shard: ColumnShard | None = None,
    names: NamesSpec = None,
    block_rows: int | None = None,
    layout: EngramLayout | None = None,
    token_map: TokenMap | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Stream the packed rows of one rank's shard of layer ``layer_index``.

    Checks every tensor first (so errors come before the first block), then
    yields ``(local_row, packed [n, E + E/32] uint8)`` with ``n <= block_rows``,
    local rows counted from the shard's ``row_begin``, in order.

    Args:
        checkpoint: a file or directory (see :class:`SafetensorsCheckpoint`).
        config: an :class:`EngramConfig`, preset name or config path.
        layer_index: position in ``config.layer_ids``.
        shard: the rank's columns and rows of this layer (SPEC §7,
            :meth:`EngramLayout.column_shard`); None reads every row the
            layout uses.
        names: tensor names (see :mod:`engramrt.checkpoint.names`).
        block_rows: rows per block (default: about 64 MiB).
        layout: the config's layout, if already built.
        token_map: the token map the rows are served with (default: the
            DeepSeek-V4 map); a file whose recorded fingerprint differs is
            refused (see :func:`engramrt.checkpoint.metadata.check_token_map`).

    Raises:
        TokenizerError: the checkpoint was hashed with another token map.
    """
    ckpt = open_checkpoint(checkpoint)
    cfg, layout = _resolve(config, layout)
    expected = layout.column_shard(layer_index, 1 if shard is None else shard.tp,
                                   0 if shard is None else shard.rank)  # fmt: skip
    if shard is not None and shard != expected:
        raise ValidationError(
            f"shard = {shard}; expected layer {cfg.layer_ids[layer_index]}'s shard of rank "
            f"{shard.rank} of tp={shard.tp}: {expected}"
        )
    shard = expected
    plan = plan_layer_read(ckpt, cfg, layout, layer_index, shard, TensorNames.from_spec(names))
    check_plan_token_map(ckpt, plan, cfg, token_map)
    return _iter_plan(plan, check_block_rows(block_rows, row_bytes_for(cfg.head_dim)))


def read_tensor(
    checkpoint: SafetensorsCheckpoint, names: Sequence[str]
) -> tuple[str, torch.Tensor] | None:
    """The first of ``names`` the checkpoint holds and its tensor, read whole; None if it
    holds none. Read through the checkpoint's held descriptor: the same set as its tables."""
    from safetensors import safe_open

    for name in names:
        locations = checkpoint.locations(name)
        if locations:
            with safe_open(locations[0].open_path, framework="pt") as handle:
                return name, handle.get_tensor(name)
    return None


def read_table(
    checkpoint: SafetensorsCheckpoint | str | os.PathLike[str],
    config: ConfigSource,
    layer_index: int,
    *,
    tp: int = 1,
    rank: int = 0,
    names: NamesSpec = None,
    block_rows: int | None = None,
    token_map: TokenMap | None = None,
) -> torch.Tensor:
    """One rank's rows of one layer as a CPU ``[num_rows, E + E/32]`` uint8 tensor.

    A convenience for small tables and tests; serving code should use
    :func:`load_table`, which fills a store without this extra copy.
    """
    cfg, layout = _resolve(config, None)
    shard = layout.column_shard(layer_index, tp, rank)
    packed = torch.empty((shard.num_rows, row_bytes_for(cfg.head_dim)), dtype=torch.uint8)
    with _opened(checkpoint) as ckpt:
        for local_row, block in iter_packed_rows(
            ckpt,
            cfg,
            layer_index,
            shard=shard,
            names=names,
            block_rows=block_rows,
            layout=layout,
            token_map=token_map,
        ):
            packed[local_row : local_row + block.shape[0]] = block
    return packed
