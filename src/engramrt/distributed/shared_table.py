"""One host copy of a table per node, mapped by every process that serves it.

Data-parallel replicas on one node serve the same tables: rank ``r`` of
every replica's TP group needs the same shard. Loading a private copy per
process would hold the 188.8 GiB of V4.1-Flash once per replica; instead
the first process to take a shard's creation lock loads it once into a file
of a memory file system (``/dev/shm``) and every process maps that file
read-only. The mapping is ordinary host memory: the host-gather tier reads
it directly and the UVA tier registers it with ``cudaHostRegister`` (see
:mod:`engramrt.distributed.stores`). Nobody makes a private copy.

Files in the directory, for a table called ``<name>``:

=========================  ==================================================
``<name>``                 the packed rows, ``num_rows * row_bytes`` bytes,
                           complete: it only ever appears by a rename
``<name>.manifest.json``   written last, atomically: geometry, the data
                           file's identity (device, inode, size), a sha256 of
                           sample rows, ``"complete": true``, and a sha256 of
                           all that
``<name>.tmp-<pid>``       a table being written by process ``pid``
``<name>.lock``            ``flock`` target; never deleted by the protocol
=========================  ==================================================

Permissions, whatever the umask: the data file and the manifest are
``0o444``, the lock ``0o644`` (set with ``fchmod``), so every local user
can read and wait, and nobody but the owner can change anything. The lock
is opened with ``O_NOFOLLOW`` and must be a regular file with one link
before anything touches it (a symlink or hard link planted in a 1777
directory would otherwise make a root process chmod and overwrite its
target); only its owner writes its mode and holder line. An
attacher maps a table only when its manifest and data file belong to this
process's user or to a trusted uid (``trusted_uids=``, or the
comma-separated ``$ENGRAMRT_SHARED_TRUSTED_UIDS``) and neither is group- or
world-writable; anything else is an :class:`~engramrt.errors.UntrustedFileError`
(another user could otherwise publish rows under a name and fingerprint
that this process would serve without running its loader).

Publication (the creator holds an exclusive ``flock`` on ``<name>.lock``):

1. remove any old manifest, then any old data file, then every
   ``<name>.tmp-*`` file (under the lock nobody else can be writing one);
2. create ``<name>.tmp-<pid>``, reserve its bytes with ``posix_fallocate``
   (a full ``/dev/shm`` fails here with ENOSPC, not later with SIGBUS on a
   page fault; ``reserve="truncate"`` makes a sparse file instead, so the
   loader's writers allocate the pages in parallel), map it and let the
   loader fill it;
3. ``msync`` + ``fsync``, make it read-only, ``rename`` it to ``<name>``,
   ``fsync`` the directory;
4. write the manifest with :func:`engramrt._io.atomic_write_bytes` (temp
   file ``.<name>.manifest.json.*.tmp``, ``fsync``, ``rename``, directory
   ``fsync``).

Before step 2 the creator checks the directory's free space (``statvfs``)
and a full file system at any step (the reservation, the manifest) removes
everything this attempt wrote (no orphan data file) and becomes a
:class:`~engramrt.errors.CapacityError` naming the bytes needed, the bytes
free, the directory and the remedy (``docker run --shm-size``), or, with
``private_fallback`` (the default), a private copy with that message as a
warning.

Why a crash at any point cannot be mistaken for a loaded table: an attacher
accepts a table only through a manifest that says complete, whose own
checksum verifies, whose geometry is the one asked for, and whose recorded
(device, inode, size) is that of the data file it opened. The manifest is
written only after the data file it describes was completely written,
synced and renamed into place, and a data file is never written after its
rename. A creator that dies before step 4 leaves no manifest (step 1 removed
the old one before anything else), so nothing is attached; it may leave a
tmp file or a data file without manifest, which the next lock holder removes
in step 1. The lock is an ``flock``: the kernel drops it when its holder
dies, so waiters notice a dead creator (the lock becomes free while no
complete manifest exists) and one of them takes over. A process that mapped
an older table keeps its pages when the files are replaced: POSIX keeps an
unlinked inode alive while it is mapped.

Falling back to private copies: sharing needs every process of ``group`` on
one node (hostname and boot id, gathered with ``all_gather_object``) and
room in the directory (``statvfs``) for the tables not there yet.
Otherwise every process loads a private copy and a :class:`UserWarning`
gives the numbers. ``posix_fallocate`` failing for lack of space falls back
the same way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import signal
import socket
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt import memory
from engramrt._io import atomic_write_bytes, fsync_directory
from engramrt.errors import CapacityError, LockTimeoutError, UntrustedFileError, ValidationError

__all__ = [
    "DIRECTORY_ENV",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "SAMPLE_ROWS",
    "TRUSTED_UIDS_ENV",
    "Loader",
    "SharedHostTable",
    "SharingDecision",
    "SharingRequest",
    "TablePaths",
    "clean_stale_tmp_files",
    "decide_sharing",
    "default_directory",
    "free_bytes",
    "node_id",
    "resolve_trusted_uids",
]

MANIFEST_FORMAT = "engramrt-shared-table"
MANIFEST_VERSION = 1
DIRECTORY_ENV = "ENGRAMRT_SHARED_DIR"
"""Environment variable naming the directory of shared tables (default ``/dev/shm``)."""
TRUSTED_UIDS_ENV = "ENGRAMRT_SHARED_TRUSTED_UIDS"
"""Environment variable: comma-separated uids whose shared tables this process may map."""
KILL_ENV = "ENGRAMRT_TEST_KILL_AT"
"""Tests only: a point name (``shared:reserved``, ...) at which the creator SIGKILLs itself."""
DATA_MODE = 0o444
MANIFEST_MODE = 0o444
LOCK_MODE = 0o644
SAMPLE_ROWS = 64
"""Rows (evenly spaced, first and last included) whose sha256 the manifest records."""
_FULL_HASH_BYTES = 64 * 2**20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_MANIFEST_KEYS = frozenset(
    ("num_rows", "row_bytes", "fingerprint", "file", "checksum", "sample_rows", "sha256")
)

Loader = Callable[[torch.Tensor], None]
"""Fills a writable ``[num_rows, row_bytes]`` uint8 CPU tensor with the table's packed rows."""


def default_directory() -> Path:
    """``$ENGRAMRT_SHARED_DIR``, else ``/dev/shm`` when it exists, else the temp directory."""
    configured = os.environ.get(DIRECTORY_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still allocate in ``directory`` (``statvfs``)."""
    stats = os.statvfs(directory)
    return int(stats.f_bavail * stats.f_frsize)


def _no_space_message(directory: Path, needed: int, free: int, what: str) -> str:
    return (
        f"{what} needs {memory.format_bytes(needed)} in {directory} but it has "
        f"{memory.format_bytes(free)} free; make it larger (in a container: "
        f"docker run --shm-size=<size>, e.g. --shm-size={max(1, -(-needed // 2**30))}g) or set "
        f"${DIRECTORY_ENV} to a larger memory file system"
    )


def resolve_trusted_uids(extra: Sequence[int] = ()) -> frozenset[int]:
    """This process's effective uid, ``extra`` and the uids of ``$ENGRAMRT_SHARED_TRUSTED_UIDS``."""
    uids = {os.geteuid(), *(int(uid) for uid in extra)}
    configured = os.environ.get(TRUSTED_UIDS_ENV, "")
    for item in configured.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ValidationError(
                f"{TRUSTED_UIDS_ENV}={configured!r}: {item!r} is not a uid; expected "
                f"comma-separated non-negative integers"
            )
        uids.add(int(item))
    return frozenset(uids)


def _check_trusted(path: Path, status: os.stat_result, trusted: frozenset[int]) -> None:
    if status.st_uid not in trusted:
        raise UntrustedFileError(
            f"{path} belongs to uid {status.st_uid}; expected one of the trusted uids "
            f"{sorted(trusted)} (this process's user, trusted_uids= or ${TRUSTED_UIDS_ENV}): "
            f"a table published by another user is not mapped"
        )
    if status.st_mode & 0o022:
        raise UntrustedFileError(
            f"{path} has mode {stat.S_IMODE(status.st_mode):#o}, writable by group or others; "
            f"expected no group/world write bit (remove the table and publish it again)"
        )


def _kill_point(point: str) -> None:
    if os.environ.get(KILL_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def node_id() -> str:
    """This machine: hostname plus the kernel's boot id (two nodes may share a hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


# --- paths and small file helpers --------------------------------------------------


@dataclass(frozen=True)
class TablePaths:
    """The files of table ``name`` in ``directory`` (see the module doc)."""

    directory: Path
    name: str

    @property
    def data(self) -> Path:
        return self.directory / self.name

    @property
    def manifest(self) -> Path:
        return self.directory / f"{self.name}.manifest.json"

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.name}.lock"

    def manifest_tmp_files(self) -> list[Path]:
        """Temporaries of manifest writes (``.<name>.manifest.json.*.tmp``)."""
        return sorted(self.directory.glob(f".{self.name}.manifest.json.*.tmp"))

    def tmp(self, pid: int) -> Path:
        return self.directory / f"{self.name}.tmp-{pid}"

    def tmp_files(self) -> list[tuple[Path, int | None]]:
        """Every ``<name>.tmp-*`` file with the pid its name carries (None: not a pid)."""
        found = []
        for path in self.directory.glob(f"{self.name}.tmp-*"):
            suffix = path.name[len(self.name) + len(".tmp-") :]
            found.append((path, int(suffix) if suffix.isdigit() else None))
        return sorted(found)


def _check_name(name: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\0" in name
        or name.startswith(".")
        or ".tmp-" in name
        or name.endswith((".lock", ".manifest.json"))
    ):
        raise ValidationError(
            f"name={name!r}; expected a plain file name (no '/', no leading '.', no '.tmp-', "
            f"not ending in '.lock' or '.manifest.json')"
        )
    return name


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def clean_stale_tmp_files(directory: str | os.PathLike[str], name: str) -> list[Path]:
    """Remove ``<name>.tmp-<pid>`` files whose writer ``pid`` is dead; returns those removed.

    Safe without the creation lock (a live writer's file is kept). Under
    the lock the creator removes every tmp file (see the module doc).
    """
    paths = TablePaths(Path(directory), _check_name(name))
    removed = []
    for path, pid in paths.tmp_files():
        if pid is not None and not _pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _open_lock(path: Path) -> tuple[int, bool]:
    """Open the lock file without following a symlink; returns (fd, whether we may write it).

    ``O_NOFOLLOW`` refuses a symlink planted at ``path`` (another user of a
    1777 directory could otherwise point it at any file, which a root process
    would then chmod and overwrite); ``O_NONBLOCK`` keeps a FIFO planted
    there from blocking the open. The file must then be a regular file with
    one link (not a hard link to another file), and it is written (mode,
    holder line) only when it belongs to this process's user: never a lock
    that is not ours.
    """
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, LOCK_MODE)
    except PermissionError:  # another user's lock: flock works on a read-only descriptor
        fd = _open_lock_read_only(path, flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _symlink_error(path) from exc
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
            kind = "a regular file" if stat.S_ISREG(status.st_mode) else "not a regular file"
            raise UntrustedFileError(
                f"lock file {str(path)!r} is {kind} with {status.st_nlink} link(s) (uid "
                f"{status.st_uid}); expected a regular file with one link: remove it (someone "
                f"may have planted it to make this process write another file)"
            )
        return fd, status.st_uid == os.geteuid() and _writable(fd)
    except BaseException:
        os.close(fd)
        raise


def _open_lock_read_only(path: Path, flags: int) -> int:
    try:
        return os.open(path, os.O_RDONLY | flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _symlink_error(path) from exc


def _writable(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR


def _symlink_error(path: Path) -> UntrustedFileError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return UntrustedFileError(
        f"lock file {str(path)!r} is a symlink (to {target!r}); expected a regular file: "
        f"remove it (a symlink there would make this process change the file it points to)"
    )


@contextlib.contextmanager
def _try_lock(path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` if nobody else does; yields whether we got it."""
    fd, ours = _open_lock(path)
    try:
        if ours:
            os.fchmod(fd, LOCK_MODE)  # whatever the umask
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            if ours:  # who holds it, for the messages of those who wait (informational)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {node_id()}\n".encode(), 0)
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _flock_holder_pid(path: Path) -> int | None:
    """The pid holding an ``flock`` on ``path`` according to ``/proc/locks`` (Linux), or None."""
    try:
        status = os.stat(path, follow_symlinks=False)
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return None
    wanted = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF"; a waiter's line reads "1: -> FLOCK"
        if (
            len(fields) >= 6
            and fields[1] == "FLOCK"
            and fields[5] == wanted
            and fields[4].isdigit()
            and int(fields[4]) > 0
        ):
            return int(fields[4])
    return None


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


def _lock_holder(path: Path) -> str:
    """Who holds the lock: the pid the kernel reports, else the line the holder wrote."""
    pid = _flock_holder_pid(path)
    if pid is not None:
        return f"pid {pid} ({_process_name(pid)})"
    try:
        with open(path, "rb", opener=_no_follow_opener) as lock:
            recorded = lock.read(256).decode(errors="replace").strip()
    except OSError:
        recorded = ""
    return f"pid {recorded} (as recorded in the lock file)" if recorded else "an unknown process"


def _no_follow_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _holder_is_writing(paths: TablePaths) -> bool | None:
    """Whether the lock's holder is writing the table (its ``<name>.tmp-<pid>`` exists).

    None when the holder is unknown (no ``/proc/locks``): it is then given
    the whole ``timeout_s``. A creator makes its tmp file right after the
    free-space check, so a holder without one for ``foreign_lock_s`` is not
    loading this table (a foreign process holding the lock).
    """
    pid = _flock_holder_pid(paths.lock)
    if pid is None:
        return None
    return paths.tmp(pid).exists() or paths.data.exists()


# --- mapping and checksums ---------------------------------------------------------


def _map(fd: int, num_rows: int, row_bytes: int, *, writable: bool) -> tuple[Any, torch.Tensor]:
    """Map ``fd`` shared as ``[num_rows, row_bytes]`` uint8; returns (mmap or None, tensor)."""
    nbytes = num_rows * row_bytes
    if nbytes == 0:  # mmap cannot map zero bytes
        return None, torch.empty((num_rows, row_bytes), dtype=torch.uint8)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    array = np.frombuffer(mapping, dtype=np.uint8).reshape(num_rows, row_bytes)
    with warnings.catch_warnings():
        # A read-only mapping is not writable; nothing here writes through it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return mapping, torch.from_numpy(array)


def _sample_indices(num_rows: int) -> list[int]:
    if num_rows == 0:
        return []
    count = min(num_rows, SAMPLE_ROWS)
    return sorted(set(np.linspace(0, num_rows - 1, count).round().astype(np.int64).tolist()))


def _digest(rows: torch.Tensor, indices: Sequence[int] | None) -> str:
    """sha256 of the bytes of ``rows`` (``indices``: of those rows only)."""
    array = rows.numpy()
    digest = hashlib.sha256()
    if indices is not None:
        for index in indices:
            digest.update(array[index].tobytes())
        return digest.hexdigest()
    flat = array.reshape(-1)
    for start in range(0, flat.shape[0], _FULL_HASH_BYTES):
        digest.update(flat[start : start + _FULL_HASH_BYTES].data)
    return digest.hexdigest()


def _metadata_digest(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- the sharing decision -----------------------------------------------------------


@dataclass(frozen=True)
class SharingRequest:
    """What one process asks for and sees, gathered over the group before anything is created."""

    node: str
    directory: str
    name: str
    nbytes: int
    present: bool
    free_bytes: int


@dataclass(frozen=True)
class SharingDecision:
    """Whether the group shares tables through the directory; ``reason`` says why not."""

    shared: bool
    reason: str = ""


def decide_sharing(requests: Sequence[SharingRequest]) -> SharingDecision:
    """One decision for the whole group, from every member's request (the same on every rank).

    Shared only when every process is on one node and, for every directory,
    the tables not yet there (each name once) fit in the free space the
    fullest-looking process saw.
    """
    nodes: dict[str, list[int]] = {}
    for rank, request in enumerate(requests):
        nodes.setdefault(request.node, []).append(rank)
    if len(nodes) > 1:
        listed = "; ".join(f"{node}: ranks {ranks}" for node, ranks in sorted(nodes.items()))
        return SharingDecision(
            False,
            f"the {len(requests)} processes are on {len(nodes)} nodes ({listed}); a shared "
            f"table needs one node (pass a node-local group)",
        )
    by_directory: dict[str, list[SharingRequest]] = {}
    for request in requests:
        by_directory.setdefault(request.directory, []).append(request)
    for directory, members in sorted(by_directory.items()):
        missing = {r.name: r.nbytes for r in members if not r.present}
        needed = sum(missing.values())
        free = min(r.free_bytes for r in members)
        if needed > free:
            tables = ", ".join(f"{name} {nbytes}" for name, nbytes in sorted(missing.items()))
            return SharingDecision(
                False,
                f"{directory} has {memory.format_bytes(free)} free but the {len(missing)} "
                f"table(s) not there yet need {memory.format_bytes(needed)} (bytes: {tables}); "
                + _no_space_message(Path(directory), needed, free, "sharing"),
            )
    return SharingDecision(True)


def _gather_requests(request: SharingRequest, group: Any) -> list[SharingRequest]:
    if group is None:
        return [request]
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValidationError(
            "group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first, or pass group=None"
        )
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, asdict(request), group=group)
    return [SharingRequest(**item) for item in gathered]


# --- the table ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Wanted:
    """The table a caller asks for and what an existing one must be to be attached.

    ``geometry`` holds ``num_rows``, ``row_bytes`` and ``fingerprint``, the
    values its manifest must record; ``checksum`` is ``"sample"`` or
    ``"full"``; ``trusted``: the uids whose files may be mapped;
    ``replace_mismatched``: a complete table of another geometry or checksum
    is left for the lock holder to replace instead of refused.
    """

    paths: TablePaths
    geometry: Mapping[str, Any]
    checksum: str
    trusted: frozenset[int]
    replace_mismatched: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.geometry["num_rows"])

    @property
    def row_bytes(self) -> int:
        return int(self.geometry["row_bytes"])


@dataclass(eq=False, repr=False, kw_only=True)
class SharedHostTable:
    """Packed rows ``[num_rows, row_bytes]`` uint8 in host memory, shared by a node's processes.

    Build one with :meth:`create_or_attach` (or :meth:`attach`). Attributes:

    - ``rows``: the read-only CPU tensor (a shared mapping; a private copy
      when sharing fell back, ``shared`` False);
    - ``mapping``: the ``mmap`` that ``rows`` views, held as long as the
      table (None for a private copy or an empty table);
    - ``created``: this process ran the loader;
    - ``path``, ``manifest``: the data file and its manifest (None when private).
    """

    name: str
    directory: Path
    num_rows: int
    row_bytes: int
    rows: torch.Tensor
    mapping: Any
    manifest: dict[str, Any] | None
    created: bool
    shared: bool
    _registered: bool = field(default=False, init=False)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def path(self) -> Path | None:
        """The data file (None for a private copy)."""
        return TablePaths(self.directory, self.name).data if self.shared else None

    def __repr__(self) -> str:
        where = str(self.path) if self.shared else "private copy"
        return (
            f"SharedHostTable(name={self.name!r}, rows={self.num_rows}, row_bytes={self.row_bytes}, "
            f"{where}, created={self.created})"
        )

    # -- CUDA ------------------------------------------------------------------

    def register_cuda(self) -> torch.Tensor:
        """Page-lock the rows and map them for every CUDA device; returns :attr:`rows`.

        ``cudaHostRegister`` (portable, mapped, read-only: the mapping is
        ``PROT_READ``) in this process, once; unregistered when the table is
        collected. Each process registers its own mapping of the shared
        pages (the pages are pinned once per registration; locked memory
        counts against each process's ``ulimit -l``).
        """
        if self._registered or self.nbytes == 0:
            return self.rows
        if not torch.cuda.is_available():
            raise CapacityError(
                f"register_cuda on table {self.name!r}: no CUDA device (CUDA available: False)"
            )
        status = memory.cuda_host_register(
            self, self.rows, read_only=True, keep_alive=(self.mapping, self.rows)
        )
        if status != 0:
            raise CapacityError(
                f"cudaHostRegister of table {self.name!r} ({memory.format_bytes(self.nbytes)}, "
                f"read-only shared mapping) returned cudaError {status}; check ulimit -l "
                f"(memlock) and that the device supports cudaHostRegisterReadOnly"
            )
        self._registered = True
        return self.rows

    # -- building ----------------------------------------------------------------

    @classmethod
    def create_or_attach(
        cls,
        name: str,
        num_rows: int,
        row_bytes: int,
        loader: Loader,
        *,
        directory: str | os.PathLike[str] | None = None,
        group: Any = None,
        fingerprint: str = "",
        checksum: str = "sample",
        replace_mismatched: bool = False,
        timeout_s: float = 3600.0,
        poll_s: float = 0.05,
        foreign_lock_s: float = 10.0,
        cuda_register: bool = False,
        trusted_uids: Sequence[int] = (),
        private_fallback: bool = True,
        reserve: str = "fallocate",
    ) -> SharedHostTable:
        """Attach the node's copy of table ``name``, loading it first if nobody has.

        Args:
            name: the table's file name in ``directory`` (one per layer and
                shard, e.g. ``engram-<model>-layer1-tp2-rank0``).
            num_rows, row_bytes: its geometry (``row_bytes = E + E/32``).
            loader: fills a writable ``[num_rows, row_bytes]`` uint8 tensor
                (a mapping of the new file, or of a private copy); run by
                one process per node, or by each on fallback.
            directory: where the files live (default :func:`default_directory`).
            group: the torch.distributed group of the processes calling this
                now (each for its own table), used once to check that they
                share a node and that the directory has room; None: decide
                from this process alone.
            fingerprint: what the rows are (checkpoint identity, layer,
                shard); a table of the same name made from another
                fingerprint or geometry is refused (or replaced).
            checksum: ``"sample"`` (sha256 of up to :data:`SAMPLE_ROWS` rows,
                verified by every attacher) or ``"full"`` (of every byte,
                which each attacher then hashes too).
            replace_mismatched: replace a complete table of another
                fingerprint or geometry instead of raising.
            timeout_s: how long to wait for another process's load.
            poll_s: how often waiters look.
            foreign_lock_s: how long to wait for a lock whose holder is not
                writing this table (no ``<name>.tmp-<pid>`` of the pid that
                ``/proc/locks`` names): a process that holds the lock for
                another reason would otherwise keep every caller waiting
                ``timeout_s``.
            cuda_register: also page-lock and map the rows for CUDA
                (:meth:`register_cuda`); only the UVA tier reads them that
                way, and its store registers them itself.
            trusted_uids: uids besides this process's whose tables may be
                mapped (also ``$ENGRAMRT_SHARED_TRUSTED_UIDS``).
            private_fallback: when the group cannot share (several nodes,
                too little room in ``directory``), load a private copy with
                a warning; False: raise :class:`CapacityError` instead.
            reserve: how the creator reserves the data file's bytes before
                the loader writes them: ``"fallocate"`` (``posix_fallocate``:
                a full directory fails there, cleanly; the pages are
                allocated by this one thread) or ``"truncate"`` (a sparse
                file of the right size: the loader's first writes allocate
                the pages, in parallel when it writes from many threads; the
                free space is still checked first, but a directory filled by
                someone else meanwhile kills the creator with SIGBUS, which
                the protocol survives like any other crash).

        Raises:
            UntrustedFileError: the table's files belong to an untrusted
                user or are writable by group or others.
            ValidationError: a complete table of another geometry or
                fingerprint exists (and ``replace_mismatched`` is off).
            LockTimeoutError: (a ``TimeoutError``) another process held the
                lock longer than ``timeout_s``, or longer than
                ``foreign_lock_s`` without writing the table; the message
                names the holder and the lock file.
            UntrustedFileError: the lock file is a symlink, not a regular
                file, or has more than one link.
            CapacityError: the directory is too small (``private_fallback``
                off), or a private copy was needed and host memory is short.
        """
        name = _check_name(name)
        trusted = resolve_trusted_uids(trusted_uids)
        if checksum not in ("sample", "full"):
            raise ValidationError(f"checksum={checksum!r}; expected 'sample' or 'full'")
        if reserve not in ("fallocate", "truncate"):
            raise ValidationError(f"reserve={reserve!r}; expected 'fallocate' or 'truncate'")
        if num_rows < 0 or row_bytes <= 0:
            raise ValidationError(
                f"num_rows={num_rows}, row_bytes={row_bytes}; expected num_rows >= 0, row_bytes > 0"
            )
        for label, seconds in (("timeout_s", timeout_s), ("foreign_lock_s", foreign_lock_s)):
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))
                or not (0 <= seconds < float("inf"))
            ):
                raise ValidationError(
                    f"{label}={seconds!r}; expected a finite number of seconds >= 0"
                )
        where = Path(directory) if directory is not None else default_directory()
        where.mkdir(parents=True, exist_ok=True)
        wanted = _Wanted(
            TablePaths(where, name),
            {"num_rows": num_rows, "row_bytes": row_bytes, "fingerprint": fingerprint},
            checksum,
            trusted,
            replace_mismatched,
        )
        request = SharingRequest(
            node=node_id(),
            directory=str(where.resolve()),
            name=name,
            nbytes=num_rows * row_bytes,
            present=_read_manifest(wanted.paths) is not None,
            free_bytes=free_bytes(where),
        )
        decision = decide_sharing(_gather_requests(request, group))
        table, reason = None, decision.reason
        if decision.shared:
            table, reason = cls._attach_or_publish(
                wanted, loader, reserve, timeout_s, poll_s, foreign_lock_s
            )
        if table is None:  # load the private copy (after releasing the lock)
            if not private_fallback:
                raise CapacityError(f"table {name!r} cannot be shared: {reason}")
            table = cls._private(wanted, loader, reason)
        if cuda_register:
            table.register_cuda()
        return table

    @classmethod
    def _attach_or_publish(
        cls,
        wanted: _Wanted,
        loader: Loader,
        reserve: str,
        timeout_s: float,
        poll_s: float,
        foreign_lock_s: float,
    ) -> tuple[SharedHostTable | None, str]:
        """The shared table, attached or published under the creation lock; or None and
        why when the directory had no room for it (the caller loads a private copy)."""
        paths = wanted.paths
        start = time.monotonic()
        deadline = start + timeout_s
        idle_since: float | None = None  # since when the holder has not been writing the table
        while True:
            table = cls._attach_complete(wanted)
            if table is not None:
                return table, ""
            with _try_lock(paths.lock) as locked:
                if locked:
                    # Re-check under the lock: someone may have published meanwhile.
                    table = cls._attach_complete(wanted)
                    if table is not None:
                        return table, ""
                    try:
                        _publish(wanted, loader, reserve)
                    except _NoSpaceError as exc:
                        return None, str(exc)
                    table = cls._attach_complete(wanted)
                    if table is None:  # pragma: no cover - we just published it
                        raise RuntimeError(f"table {paths.name!r} published but not attachable")
                    table.created = True
                    return table, ""
            now = time.monotonic()
            writing = _holder_is_writing(paths)
            idle_since = None if writing is not False else (idle_since or now)
            if idle_since is not None and now - idle_since > foreign_lock_s:
                raise LockTimeoutError(
                    f"table {paths.name!r} in {paths.directory}: its creation lock "
                    f"{str(paths.lock)!r} is held by {_lock_holder(paths.lock)}, which has not "
                    f"been writing the table for {now - idle_since:.1f} s "
                    f"(foreign_lock_s={foreign_lock_s:g}); stop that process, or raise "
                    f"foreign_lock_s if it is a slow loader"
                )
            if now > deadline:
                raise LockTimeoutError(
                    f"waited {now - start:.0f} s (timeout_s={timeout_s:g}) for table "
                    f"{paths.name!r} in {paths.directory}: its creation lock "
                    f"{str(paths.lock)!r} is held by {_lock_holder(paths.lock)} and no complete "
                    f"manifest appeared"
                )
            time.sleep(poll_s)

    @classmethod
    def attach(
        cls,
        name: str,
        num_rows: int,
        row_bytes: int,
        *,
        directory: str | os.PathLike[str] | None = None,
        fingerprint: str = "",
        checksum: str = "sample",
        trusted_uids: Sequence[int] = (),
    ) -> SharedHostTable:
        """Map an existing complete table; raises :class:`ValidationError` if there is none.

        ``trusted_uids``: see :meth:`create_or_attach`.
        """
        where = Path(directory) if directory is not None else default_directory()
        paths = TablePaths(where, _check_name(name))
        geometry = {"num_rows": num_rows, "row_bytes": row_bytes, "fingerprint": fingerprint}
        table = cls._attach_complete(
            _Wanted(paths, geometry, checksum, resolve_trusted_uids(trusted_uids))
        )
        if table is None:
            raise ValidationError(
                f"no complete table {name!r} in {where} (no manifest that says complete and "
                f"matches its data file)"
            )
        return table

    @staticmethod
    def remove(name: str, directory: str | os.PathLike[str] | None = None) -> None:
        """Delete table ``name``'s files, lock included: only when no process uses it.

        Processes that mapped it keep their pages until they unmap them.
        """
        paths = TablePaths(
            Path(directory) if directory is not None else default_directory(), _check_name(name)
        )
        paths.manifest.unlink(missing_ok=True)
        paths.data.unlink(missing_ok=True)
        for path, _pid in paths.tmp_files():
            path.unlink(missing_ok=True)
        for path in paths.manifest_tmp_files():
            path.unlink(missing_ok=True)
        paths.lock.unlink(missing_ok=True)

    @classmethod
    def _private(cls, wanted: _Wanted, loader: Loader, reason: str) -> SharedHostTable:
        paths, num_rows, row_bytes = wanted.paths, wanted.num_rows, wanted.row_bytes
        nbytes = num_rows * row_bytes
        warnings.warn(
            f"table {paths.name!r}: loading a private copy of {memory.format_bytes(nbytes)} "
            f"in this process instead of sharing one through {paths.directory}: {reason}",
            UserWarning,
            stacklevel=3,  # the caller of create_or_attach
        )
        what = f"private copy of table {paths.name!r}"
        memory.require(what, nbytes, memory.host_available_bytes(), "host memory")
        rows = torch.empty((num_rows, row_bytes), dtype=torch.uint8)
        loader(rows)
        return cls(
            name=paths.name,
            directory=paths.directory,
            num_rows=num_rows,
            row_bytes=row_bytes,
            rows=rows,
            mapping=None,
            manifest=None,
            created=True,
            shared=False,
        )

    @classmethod
    def _attach_complete(cls, wanted: _Wanted) -> SharedHostTable | None:
        """The complete table at ``wanted.paths``, mapped read-only, or None (absent, partial,
        corrupt).

        Raises :class:`UntrustedFileError` for a manifest or data file of an
        untrusted owner or with a group/world write bit.
        """
        paths, geometry, checksum = wanted.paths, wanted.geometry, wanted.checksum
        manifest = _read_manifest(paths, wanted.trusted)
        if manifest is None:
            return None
        found = {key: manifest[key] for key in geometry}
        if found != dict(geometry) or manifest["checksum"] != checksum:
            if wanted.replace_mismatched:
                return None  # the lock holder replaces it
            raise ValidationError(
                f"{paths.data} holds another table: its manifest has {found} (checksum "
                f"{manifest['checksum']!r}) but {dict(geometry)} (checksum {checksum!r}) was asked "
                f"for; remove it (SharedHostTable.remove), choose another name or pass "
                f"replace_mismatched=True"
            )
        try:
            fd = os.open(paths.data, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            status = os.fstat(fd)
            _check_trusted(paths.data, status, wanted.trusted)
            identity = {"dev": status.st_dev, "ino": status.st_ino, "size": status.st_size}
            if identity != manifest["file"]:
                return None  # a data file the manifest does not describe
            mapping, rows = _map(fd, manifest["num_rows"], manifest["row_bytes"], writable=False)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        indices = manifest["sample_rows"] if checksum == "sample" else None
        if _digest(rows, indices) != manifest["sha256"]:
            return None  # corrupt: the lock holder recreates it
        return cls(
            name=paths.name,
            directory=paths.directory,
            num_rows=manifest["num_rows"],
            row_bytes=manifest["row_bytes"],
            rows=rows,
            mapping=mapping,
            manifest=manifest,
            created=False,
            shared=True,
        )


def _read_manifest(
    paths: TablePaths, trusted: frozenset[int] | None = None
) -> dict[str, Any] | None:
    """The manifest when it exists, parses, says complete and its own checksum verifies.

    ``trusted``: refuse (:class:`UntrustedFileError`) a manifest of another owner.
    """
    try:
        fd = os.open(paths.manifest, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if trusted is not None:
            _check_trusted(paths.manifest, os.fstat(fd), trusted)
        with os.fdopen(os.dup(fd), "rb") as handle:
            manifest = json.loads(handle.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    finally:
        os.close(fd)
    if not isinstance(manifest, dict) or manifest.get("complete") is not True:
        return None
    fields = {key: value for key, value in manifest.items() if key != "metadata_sha256"}
    if (
        manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("version") != MANIFEST_VERSION
        or manifest.get("name") != paths.name
        or manifest.get("metadata_sha256") != _metadata_digest(fields)
        or not _MANIFEST_KEYS.issubset(manifest)
    ):
        return None
    return manifest


class _NoSpaceError(Exception):
    """The directory could not reserve the table's bytes."""

    @classmethod
    def after(cls, code: int, what: str, directory: Path, nbytes: int) -> _NoSpaceError:
        """``what`` (a step writing the table's ``nbytes`` into ``directory``) failed with
        errno ``code``, one of the no-space errors: the message names the error and the
        remedy."""
        return cls(
            f"{what} failed ({os.strerror(code)}); "
            + _no_space_message(directory, nbytes, free_bytes(directory), "the table")
        )


def _publish(wanted: _Wanted, loader: Loader, reserve: str = "fallocate") -> None:
    """Steps 1-4 of the module doc. The caller holds the creation lock."""
    paths, checksum = wanted.paths, wanted.checksum
    num_rows, row_bytes = wanted.num_rows, wanted.row_bytes
    nbytes = num_rows * row_bytes
    # 1. Nothing of an older or crashed attempt survives: manifest first, so no
    #    instant exists where a manifest describes a file about to change.
    paths.manifest.unlink(missing_ok=True)
    fsync_directory(paths.directory)
    paths.data.unlink(missing_ok=True)
    for path, _pid in paths.tmp_files():  # under the lock nobody is writing one
        path.unlink(missing_ok=True)
    for path in paths.manifest_tmp_files():  # a manifest write that was killed
        path.unlink(missing_ok=True)
    # Preflight: the old files are gone, so what is free now is what the table can use.
    free = free_bytes(paths.directory)
    if nbytes > free:
        raise _NoSpaceError(
            _no_space_message(paths.directory, nbytes, free, f"table {paths.name!r}")
        )
    # 2. Write the rows into a file only this process knows about.
    tmp = paths.tmp(os.getpid())
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes > 0 and reserve == "truncate":
            os.ftruncate(fd, nbytes)  # sparse: the loader's writes allocate the pages
        elif nbytes > 0:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno in _NO_SPACE:
                    what = f"reserving {memory.format_bytes(nbytes)} in {paths.directory}"
                    raise _NoSpaceError.after(exc.errno, what, paths.directory, nbytes) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, nbytes)  # a file system without fallocate
        _kill_point("shared:reserved")
        mapping, target = _map(fd, num_rows, row_bytes, writable=True)
        loader(target)
        indices = _sample_indices(num_rows) if checksum == "sample" else None
        sha256 = _digest(target, indices)
        del target
        if mapping is not None:
            mapping.flush()  # msync
            with contextlib.suppress(BufferError):  # the loader kept a view: unmapped on GC
                mapping.close()
        # 3. Durable, read-only, then visible under its name in one step.
        _kill_point("shared:loaded")
        os.fsync(fd)
        os.fchmod(fd, DATA_MODE)  # whatever the umask
        status = os.fstat(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, paths.data)
    fsync_directory(paths.directory)
    _kill_point("shared:renamed")
    # 4. The manifest, last and atomically.
    fields: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "name": paths.name,
        "complete": True,
        "num_rows": num_rows,
        "row_bytes": row_bytes,
        "nbytes": nbytes,
        "fingerprint": wanted.geometry["fingerprint"],
        "file": {"dev": status.st_dev, "ino": status.st_ino, "size": status.st_size},
        "checksum": checksum,
        "sample_rows": indices,
        "sha256": sha256,
        "creator": {"pid": os.getpid(), "node": node_id(), "time": time.time()},
    }
    fields["metadata_sha256"] = _metadata_digest(fields)
    try:
        atomic_write_bytes(paths.manifest, json.dumps(fields, indent=1).encode(), MANIFEST_MODE)
    except BaseException as exc:
        # No manifest: the data file would be a full-size orphan until the next creator.
        paths.data.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            what = f"writing the manifest of table {paths.name!r} in {paths.directory}"
            raise _NoSpaceError.after(exc.errno, what, paths.directory, nbytes) from exc
        raise
    _kill_point("shared:published")
