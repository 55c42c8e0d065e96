"""The safetensors file format, read and written without holding a tensor whole.

A safetensors file is::

    [8 bytes]  N, the header length, unsigned little-endian
    [N bytes]  a JSON object: "__metadata__": {str: str} (optional) and, per
               tensor, {"dtype": "F8_E4M3" | "U8" | ..., "shape": [...],
               "data_offsets": [begin, end]} (bytes, relative to the data)
    [data]     the tensors' raw row-major bytes, back to back, no gaps

``safetensors``' Python API serialises whole dicts of tensors, which would
need a 94 GiB table in memory; :class:`SafetensorsStreamWriter` instead
lays out the header from shapes alone and takes each tensor's bytes in
row blocks, in any interleaving of tensors. It writes the header *last*:
until :meth:`SafetensorsStreamWriter.finish` the first 8 bytes are zero,
which no reader accepts, so a file cut short at any point never loads.

:func:`read_header` parses a header (cheaply: one small read) so a
checkpoint directory can be indexed without opening tensors, and checks it
against the file size, so a truncated file is refused by name.

Content checksum: a writer given ``metadata[META_DATA_SHA256] =
DIGEST_PLACEHOLDER`` replaces the placeholder at :meth:`finish` by the
file's :func:`data_digest` (same length, so no offset moves). The digest is
the sha256 of, per tensor in data order, its name, a zero byte and the
sha256 of its bytes: each tensor is written front to back, so its digest
is computed as it is written, whatever the interleaving. :func:`data_digest`
recomputes it by reading the file once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engramrt.errors import CheckpointError

__all__ = [
    "DIGEST_PLACEHOLDER",
    "DTYPE_ITEMSIZE",
    "HEADER_ALIGNMENT",
    "MAX_HEADER_BYTES",
    "META_DATA_SHA256",
    "SafetensorsHeader",
    "SafetensorsStreamWriter",
    "TensorEntry",
    "TensorSpec",
    "data_digest",
    "encode_header",
    "read_header",
]

META_DATA_SHA256 = "engramrt_data_sha256"
"""Metadata key of a converted file's content checksum (see the module doc)."""
DIGEST_PLACEHOLDER = "0" * 64
_READ_BYTES = 16 * 2**20

DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
"""Bytes per element of each safetensors dtype string."""

HEADER_ALIGNMENT = 8
"""The header is padded with spaces to a multiple of this (as ``safetensors`` does)."""

MAX_HEADER_BYTES = 100_000_000
"""``safetensors`` refuses longer headers; so do we."""

_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor in a file's header; ``begin``/``end`` are byte offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of one file: tensors by name, metadata and where data starts."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(
    path: str | os.PathLike[str], *, open_path: str | os.PathLike[str] | None = None
) -> SafetensorsHeader:
    """Parse and check the header of ``path`` (read from ``open_path`` when given:
    a descriptor held open, ``/proc/self/fd/<n>``, named as ``path`` in messages).

    Raises:
        CheckpointError: the file is missing, not a safetensors file, or
            shorter than its header says (a truncated or unfinished write).
    """
    file = Path(path)
    try:
        with open(file if open_path is None else open_path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(_LENGTH.size)
            if len(prefix) < _LENGTH.size:
                raise CheckpointError(
                    f"{file} has {file_size} bytes; expected a safetensors file (8-byte header "
                    f"length, JSON header, data)"
                )
            (length,) = _LENGTH.unpack(prefix)
            if not 2 <= length <= MAX_HEADER_BYTES or _LENGTH.size + length > file_size:
                raise CheckpointError(
                    f"{file} declares a header of {length} bytes in a file of {file_size} bytes; "
                    f"expected a safetensors file (an unfinished write has length 0)"
                )
            raw = handle.read(length)
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} has a header that is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} has a JSON header of type {type(header).__name__}")
    data_start = _LENGTH.size + length
    data_size = file_size - data_start
    metadata_raw = header.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise CheckpointError(f"{file} has __metadata__ that is not a str -> str object")
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{file}: tensor {name!r} has a malformed entry {info!r}"
            ) from exc
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {list(shape)} and data_offsets "
                f"[{begin}, {end}]; expected non-negative sizes"
            )
        if dtype in DTYPE_ITEMSIZE and end - begin != math.prod(shape) * DTYPE_ITEMSIZE[dtype]:
            raise CheckpointError(
                f"{file}: tensor {name!r} ({dtype} {list(shape)}) spans {end - begin} bytes; "
                f"expected {math.prod(shape) * DTYPE_ITEMSIZE[dtype]}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{file}: tensor {name!r} ends at data byte {end} but the file holds only "
                f"{data_size} data bytes (truncated?)"
            )
        tensors[name] = TensorEntry(name, dtype, shape, begin, end)
    return SafetensorsHeader(file, tensors, dict(metadata_raw), data_start, file_size)


def encode_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, TensorEntry]]:
    """The header bytes (length prefix included) and data offsets of ``specs`` laid out in order."""
    header: dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise CheckpointError(
                f"metadata keys {bad} have non-string values; expected str -> str"
            )
        header["__metadata__"] = dict(metadata)
    entries: dict[str, TensorEntry] = {}
    offset = 0
    for spec in specs:
        if spec.name in entries or spec.name == "__metadata__":
            raise CheckpointError(f"tensor name {spec.name!r} appears twice; expected unique names")
        if spec.dtype not in DTYPE_ITEMSIZE:
            raise CheckpointError(
                f"tensor {spec.name!r} has dtype {spec.dtype!r}; expected one of "
                f"{', '.join(DTYPE_ITEMSIZE)}"
            )
        entry = TensorEntry(spec.name, spec.dtype, tuple(spec.shape), offset, offset + spec.nbytes)
        entries[spec.name] = entry
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [entry.begin, entry.end],
        }
        offset = entry.end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return _LENGTH.pack(len(text)) + text, entries


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensors arrive as row blocks.

    Each tensor is filled front to back by :meth:`append` (any interleaving
    of tensors is fine: each write goes to the tensor's own cursor);
    :meth:`finish` checks that every tensor is complete and only then
    writes the header. Memory use is that of the block being written.

    Args:
        handle: a binary file opened for writing, seekable, empty.
        specs: the tensors, in file order.
        metadata: ``__metadata__`` (str -> str).
    """

    def __init__(
        self,
        handle: BinaryIO,
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._handle = handle
        self._header, self.entries = encode_header(specs, metadata)
        self.data_start = len(self._header)
        self.nbytes = self.data_start + sum(e.nbytes for e in self.entries.values())
        self._cursor = dict.fromkeys(self.entries, 0)
        self._finished = False
        self._specs, self._metadata = tuple(specs), dict(metadata or {})
        self._digests = (
            {name: hashlib.sha256() for name in self.entries}
            if self._metadata.get(META_DATA_SHA256) == DIGEST_PLACEHOLDER
            else None
        )
        # Zeros where the header goes: a header length of 0 is not a valid file.
        handle.write(bytes(self.data_start))

    def append(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` (raw bytes, row-major) at the cursor of tensor ``name``."""
        if self._finished:
            raise CheckpointError(f"append({name!r}) after finish()")
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(
                f"tensor {name!r} is not in this file; it holds {list(self.entries)}"
            )
        view = memoryview(data).cast("B")
        cursor = self._cursor[name]
        if cursor + view.nbytes > entry.nbytes:
            raise CheckpointError(
                f"tensor {name!r} gets bytes [{cursor}, {cursor + view.nbytes}); expected at most "
                f"{entry.nbytes} bytes ({entry.dtype} {list(entry.shape)})"
            )
        self._handle.seek(self.data_start + entry.begin + cursor)
        self._handle.write(view)
        self._cursor[name] = cursor + view.nbytes
        if self._digests is not None:
            self._digests[name].update(view)

    def remaining(self, name: str) -> int:
        """Bytes still to write into tensor ``name``."""
        return self.entries[name].nbytes - self._cursor[name]

    def finish(self) -> None:
        """Check every tensor is complete, then write the header (the file becomes valid)."""
        short = {n: self.remaining(n) for n in self.entries if self.remaining(n)}
        if short:
            raise CheckpointError(
                f"tensors {sorted(short)} are incomplete ({sum(short.values())} bytes missing); "
                f"expected every tensor written in full before finish()"
            )
        if self._digests is not None:
            per_tensor = {name: d.digest() for name, d in self._digests.items()}
            digest = _combine(per_tensor, self.entries)
            header, _ = encode_header(self._specs, {**self._metadata, META_DATA_SHA256: digest})
            if len(header) != len(self._header):  # pragma: no cover - same-length substitution
                raise CheckpointError("the checksum changed the header's length")
            self._header = header
        self._handle.seek(self.nbytes)
        self._handle.truncate(self.nbytes)
        self._handle.seek(0)
        self._handle.write(self._header)
        self._handle.seek(self.nbytes)
        self._finished = True


def _combine(per_tensor: Mapping[str, bytes], entries: Mapping[str, TensorEntry]) -> str:
    """The file digest from each tensor's sha256 (tensors in data order)."""
    combined = hashlib.sha256()
    for name in sorted(entries, key=lambda n: (entries[n].begin, n)):
        combined.update(name.encode() + b"\0" + per_tensor[name])
    return combined.hexdigest()


def data_digest(
    header: SafetensorsHeader, *, open_path: str | os.PathLike[str] | None = None
) -> str:
    """The content digest of the file ``header`` describes (see the module doc), by reading it.

    Raises:
        CheckpointError: the file cannot be read or is shorter than its header says.
    """
    per_tensor = {}
    try:
        with open(header.path if open_path is None else open_path, "rb") as handle:
            for name, entry in sorted(header.tensors.items(), key=lambda t: (t[1].begin, t[0])):
                handle.seek(header.data_start + entry.begin)
                digest, left = hashlib.sha256(), entry.nbytes
                while left:
                    chunk = handle.read(min(left, _READ_BYTES))
                    if not chunk:
                        raise CheckpointError(
                            f"{header.path}: tensor {name!r} is cut short ({left} bytes missing)"
                        )
                    digest.update(chunk)
                    left -= len(chunk)
                per_tensor[name] = digest.digest()
    except OSError as exc:
        raise CheckpointError(f"{header.path} cannot be read: {exc}") from exc
    return _combine(per_tensor, header.tensors)
