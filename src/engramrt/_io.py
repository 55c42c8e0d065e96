"""Atomic file writes: a reader sees the old file or the complete new one, never a part.

Directories too: :func:`staged_directory` gives a hidden directory beside the
target to write a whole set of files into, and puts it in the target's place
in one rename once the block succeeded (:func:`replace_directory`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "atomic_write_bytes",
    "atomic_writer",
    "fsync_directory",
    "remove_abandoned_stages",
    "replace_directory",
    "staged_directory",
]

_RENAME_EXCHANGE = 2  # linux/fs.h: renameat2 flag, swap the two names atomically
_AT_FDCWD = -100


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


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or the file system does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if (
        renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
        == 0
    ):
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def replace_directory(new: str | Path, target: str | Path) -> None:
    """Put directory ``new`` at ``target``'s path, removing what ``target`` held.

    ``target`` missing: one rename. Otherwise the two are exchanged in one
    step (``renameat2(RENAME_EXCHANGE)``: a reader of ``target`` sees the old
    directory or the new one, never neither), then the old one is removed;
    where the exchange is not available, ``target`` is first renamed aside
    (a moment without ``target``, never a mix of the two).
    """
    new, target = Path(new), Path(target)
    if not target.exists() and not target.is_symlink():
        os.rename(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new)  # the old directory, now under the staging name
    else:
        aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.rename(target, aside / "old")
        os.rename(new, target)
        shutil.rmtree(aside)
    fsync_directory(target.parent)


def _stage_prefix(target: Path) -> str:
    return f".{target.name}.staging-"


def _lock_of(stage: Path) -> Path:
    return stage.parent / f"{stage.name}.lock"


def _held(lock: Path) -> bool:
    """Whether a live writer holds ``lock`` (an ``flock``; a missing file is not held)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def remove_abandoned_stages(target: str | Path) -> list[Path]:
    """Remove staging directories of ``target`` whose writer died (no process holds the
    lock file beside them, see :func:`staged_directory`); returns them. A running
    writer's is kept."""
    target = Path(target)
    removed = []
    for path in sorted(target.parent.glob(_stage_prefix(target) + "*")):
        if path.name.endswith(".lock") or path.is_symlink() or not path.is_dir():
            continue
        if _held(_lock_of(path)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        _lock_of(path).unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """A new, empty directory beside ``target`` to write into; when the block succeeds it
    replaces ``target`` (:func:`replace_directory`), when it raises it is removed and
    ``target`` is left as it was.

    The directory is ``.<name>.staging-<random>`` in ``target``'s parent (hidden, never
    looked at by a loader), with the mode ``mkdir`` would give. The writer holds an
    ``flock`` on ``.<name>.staging-<random>.lock`` beside it (created first, removed
    last; not on the directory itself, which the block may lock for its own writes)
    while it runs: a writer killed meanwhile leaves both behind, and the next
    :func:`staged_directory` of the same target removes them
    (:func:`remove_abandoned_stages`).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_stages(target)
    fd, lock_name = tempfile.mkstemp(
        dir=target.parent, prefix=_stage_prefix(target), suffix=".lock"
    )
    lock = Path(lock_name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        staging = lock.parent / lock.name.removesuffix(".lock")
        staging.mkdir()
        try:
            yield staging
            fsync_directory(staging)
            replace_directory(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        lock.unlink(missing_ok=True)
    except BaseException:
        lock.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
