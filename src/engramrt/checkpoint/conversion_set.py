"""The files of one conversion, committed together and recognised as one set.

Every file a conversion writes carries its conversion id (a uuid4, in the
``engramrt_conversion_id`` metadata). A conversion into a directory commits
its files in this order:

1. each output is written in full to ``.<name>.<id>.tmp`` beside its final
   name and fsynced (nothing a loader reads yet);
2. the manifest ``engram.conversion.json`` is written atomically (temporary
   file, fsync, rename): the id, the file names, and the engramrt files of
   earlier conversions it replaces. This rename is the commit point;
3. each staged file is renamed to its final name;
4. the replaced files are removed, and the manifest rewritten without them.

A loader (:func:`resolve_directory`) goes by the manifest: before step 2 it
finds the old manifest and the old files (the staged ones are hidden), from
step 2 on the new manifest, whose files it takes from their final name when
that file carries the manifest's id, else from the staged file (a commit
killed between renames is read forward, never mixed). An engramrt file of
another conversion beside the set is refused unless the manifest names it
as replaced (it is about to be removed); files engramrt did not write are
left to the usual lookup. A directory without a manifest is refused when its
engramrt files carry different ids.

Conversions into one directory take an exclusive ``flock`` on the
directory itself; under it every temporary file left by an earlier
(killed) conversion is removed. A conversion removes its own temporary files
when it fails (and on SIGTERM, which the CLI turns into an exit).
After a SIGKILL they stay until the next conversion into the directory.

``ENGRAMRT_TEST_KILL_AT`` (tests only): a point name (``convert:staged``,
``convert:manifest``, ``convert:renamed-1``, ...) at which the writer
SIGKILLs itself, so crash tests stop a real process at a chosen instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from engramrt.errors import CheckpointError

__all__ = [
    "KILL_ENV",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "META_CONVERSION_ID",
    "OUTPUT_STEMS",
    "ConversionManifest",
    "conversion_lock",
    "is_output_name",
    "kill_point",
    "read_manifest",
    "remove_stale_temporaries",
    "resolve_directory",
    "staged_path",
]

MANIFEST_NAME = "engram.conversion.json"
MANIFEST_FORMAT = "engramrt-conversion"
META_CONVERSION_ID = "engramrt_conversion_id"
KILL_ENV = "ENGRAMRT_TEST_KILL_AT"

OUTPUT_STEMS = ("engram", "ple")
"""Stems of the files conversions write: ``engram`` (DeepSeek Engram tables) and ``ple``
(Qwen4-Exp PLE tables); ``<stem>.safetensors`` or ``<stem>-rank<r>-of-<N>.safetensors``."""

_OUTPUT = re.compile(rf"^({'|'.join(OUTPUT_STEMS)})(-rank\d+-of-\d+)?\.safetensors$")
_TEMPORARY = re.compile(r"^\.(?P<name>.+?\.(safetensors|json))\.[^/]+\.tmp$")


def kill_point(point: str) -> None:
    """Signal this process when ``$ENGRAMRT_TEST_KILL_AT`` names ``point`` (crash tests).

    ``<point>`` sends SIGKILL; ``<point>:TERM`` sends SIGTERM (what a job
    scheduler sends first), which the CLI turns into an orderly exit.
    """
    wanted = os.environ.get(KILL_ENV)
    if wanted == point:
        os.kill(os.getpid(), signal.SIGKILL)
    elif wanted == f"{point}:TERM":
        os.kill(os.getpid(), signal.SIGTERM)


def is_output_name(name: str) -> bool:
    """``<stem>.safetensors`` or ``<stem>-rank<r>-of-<N>.safetensors`` with a stem of
    :data:`OUTPUT_STEMS`: the names conversions write."""
    return _OUTPUT.match(name) is not None


def staged_path(final: Path, conversion_id: str) -> Path:
    """Where conversion ``conversion_id`` writes ``final`` before committing it."""
    return final.parent / f".{final.name}.{conversion_id}.tmp"


@contextlib.contextmanager
def conversion_lock(directory: Path) -> Iterator[None]:
    """Hold the exclusive conversion lock of ``directory`` (waits for another conversion)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)  # no lock file left behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def remove_stale_temporaries(directory: Path, names: Sequence[str] = ()) -> list[Path]:
    """Remove temporaries of conversion outputs (and of ``names``) in ``directory``.

    Call under :func:`conversion_lock`: every such file then belongs to a
    conversion that died.
    """
    removed = []
    wanted = set(names) | {MANIFEST_NAME}
    for path in directory.glob(".*.tmp"):
        match = _TEMPORARY.match(path.name)
        if match is None:
            continue
        name = match.group("name")
        if (is_output_name(name) or name in wanted) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@dataclass(frozen=True)
class ConversionManifest:
    """What ``engram.conversion.json`` records."""

    conversion_id: str
    tp: int
    files: tuple[str, ...]
    replaces: tuple[tuple[str, str | None], ...]
    """(file name, its conversion id or None) of earlier files this conversion removes."""

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "conversion_id": self.conversion_id,
                "tp": self.tp,
                "files": list(self.files),
                "replaces": [list(item) for item in self.replaces],
            },
            indent=1,
        ).encode()


def read_manifest(directory: Path) -> ConversionManifest | None:
    """The manifest of ``directory``, None when there is none; malformed: CheckpointError."""
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"conversion manifest {str(path)!r} cannot be read: {exc}") from exc
    try:
        data = json.loads(raw)
        if data["format"] != MANIFEST_FORMAT:
            raise ValueError(f"format {data['format']!r}")
        files = tuple(str(name) for name in data["files"])
        if not files or any("/" in name or not name.endswith(".safetensors") for name in files):
            raise ValueError(f"files {files}")
        return ConversionManifest(
            conversion_id=str(data["conversion_id"]),
            tp=int(data["tp"]),
            files=files,
            replaces=tuple(
                (str(name), None if cid is None else str(cid)) for name, cid in data["replaces"]
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"conversion manifest {str(path)!r} is malformed ({exc}); expected the JSON that "
            f"engramrt convert writes: rerun the conversion"
        ) from exc


def file_conversion_id(path: Path) -> tuple[bool, str | None]:
    """(written by engramrt, its conversion id or None) from ``path``'s safetensors header."""
    from engramrt.checkpoint.metadata import META_VERSION
    from engramrt.checkpoint.safetensors_format import read_header

    metadata = read_header(path).metadata
    return META_VERSION in metadata, metadata.get(META_CONVERSION_ID)


def _describe(items: Sequence[tuple[Path, str | None]]) -> str:
    return ", ".join(f"{path.name} (conversion id {cid or 'none'})" for path, cid in items)


def resolve_directory(directory: Path, files: Sequence[Path]) -> list[Path]:
    """The files of ``directory`` a loader may read, after checking the conversion set.

    ``files`` are the directory's ``*.safetensors`` files. Returns them with
    the manifest's set resolved (a staged file standing in for a final name
    not yet renamed) and replaced files dropped.

    Raises:
        CheckpointError: a file of the set is missing or carries another id,
            an engramrt file of another conversion sits beside the set, or
            (without a manifest) engramrt files carry different ids; the
            message names the files and ids.
    """
    manifest = read_manifest(directory)
    engramrt_files = {}
    for path in files:
        if is_output_name(path.name) or (manifest is not None and path.name in manifest.files):
            engramrt_files[path] = file_conversion_id(path)
    if manifest is None:
        ids = {path: cid for path, (ours, cid) in engramrt_files.items() if ours}
        if len(set(ids.values())) > 1:
            raise CheckpointError(
                f"{directory} holds files of different conversions: "
                f"{_describe(sorted(ids.items()))}; expected one set (convert again into an "
                f"empty directory, or remove the stale files)"
            )
        return list(files)
    cid = manifest.conversion_id
    resolved: list[Path] = []
    for name in manifest.files:
        final = directory / name
        final_id = engramrt_files.get(final, (False, None))[1] if final.is_file() else None
        if final.is_file() and final_id == cid:
            resolved.append(final)
            continue
        staged = staged_path(final, cid)
        if staged.is_file() and file_conversion_id(staged)[1] == cid:
            resolved.append(staged)  # committed, killed before its rename
            continue
        found = f"conversion id {final_id or 'none'}" if final.is_file() else "missing"
        raise CheckpointError(
            f"{final} is {found} but {directory / MANIFEST_NAME} names conversion {cid} "
            f"(files {', '.join(manifest.files)}): a mixed or incomplete set; convert again"
        )
    replaced = set(manifest.replaces)
    stale = [
        (path, found_id)
        for path, (ours, found_id) in sorted(engramrt_files.items())
        if ours and path.name not in manifest.files and (path.name, found_id) not in replaced
    ]
    if stale:
        raise CheckpointError(
            f"{directory}: stale file(s) {_describe(stale)} beside conversion {cid} "
            f"({', '.join(manifest.files)}) would shadow its tensors; remove them or convert again"
        )
    others = [
        path
        for path in files
        if path not in engramrt_files or not engramrt_files[path][0]
        if path.name not in manifest.files
    ]
    return resolved + others
