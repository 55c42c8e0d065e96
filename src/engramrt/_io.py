"""Atomic file writes: a reader sees the old file or the complete new one, never a part."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_write_bytes", "atomic_writer", "fsync_directory"]


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: int | None = None) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path``; on success fsync and rename it over ``path``.

    ``mode``: the file's permission bits, whatever the umask (default: what
    ``open()`` would give, ``0o666`` less the umask). If the block raises (or the process dies), ``path`` is left untouched and
    the temporary file is removed (or, after a crash, left under a hidden
    ``.<name>.*.tmp`` name that no loader looks for).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode asked for, or the one open() would have.
        os.fchmod(fd, 0o666 & ~_umask() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)  # make the rename itself durable


def fsync_directory(directory: str | Path) -> None:
    """Flush ``directory``'s entries (renames, creations) to disk; best effort (some
    file systems refuse to open or fsync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` would, process-wide)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_writer` (``mode``: see there)."""
    with atomic_writer(path, mode) as f:
        f.write(data)


def read_json(path: Path, error: type[Exception], what: str) -> Any:
    """The JSON value in the UTF-8 file ``path``; raises ``error`` naming ``what`` (e.g.
    ``"config file '/x/config.json'"``) when it cannot be read, is not UTF-8 or is not JSON."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise error(f"{what} cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from exc
