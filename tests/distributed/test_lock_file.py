"""The shared table's lock file against planted files and foreign holders, with real processes.

A local user who can write the shared directory (``/dev/shm`` is 1777) can
plant ``<name>.lock`` before a root process creates or attaches the table:
a symlink to a root-only file, a hard link to one, a FIFO, or a file of
their own. None of them may be followed, changed or written: the creator
process (a real subprocess, as it would run) exits with one
:class:`UntrustedFileError` line and the planted target keeps its bytes and
mode. A process that holds the lock without writing the table (a foreign
holder) is reported after ``foreign_lock_s``, naming its pid and the lock.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers import finite_packed_table

from engramrt.distributed import SharedHostTable, TablePaths
from engramrt.errors import LockTimeoutError, UntrustedFileError

ROOT = Path(__file__).resolve().parents[2]
NUM_ROWS, E = 50, 64
ROW_BYTES = E + E // 32
NAME = "table"
SECRET = b"root-only secret\n"

CREATOR = """
import sys
from engramrt.distributed import SharedHostTable
from engramrt.errors import EngramError
from tests.helpers import finite_packed_table
rows = finite_packed_table({num_rows}, {E}, seed=3)
try:
    SharedHostTable.create_or_attach(
        {name!r}, {num_rows}, {row_bytes}, lambda t: t.copy_(rows), directory=sys.argv[1],
        timeout_s=20,
    )
except EngramError as exc:
    print(f"{{type(exc).__name__}}: {{exc}}", file=sys.stderr)
    sys.exit(2)
print("published")
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def run_creator(directory: Path) -> subprocess.CompletedProcess:
    script = CREATOR.format(num_rows=NUM_ROWS, E=E, name=NAME, row_bytes=ROW_BYTES)
    return subprocess.run(
        [sys.executable, "-c", script, str(directory)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only its owner may read, outside the shared directory."""
    path = tmp_path / "private" / "secret"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def _untouched(path: Path) -> bool:
    return path.read_bytes() == SECRET and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_symlink_at_the_lock_is_refused_and_its_target_untouched(
    tmp_path: Path, secret: Path
) -> None:
    shared = tmp_path / "shm"
    shared.mkdir()
    lock = TablePaths(shared, NAME).lock
    lock.symlink_to(secret)
    done = run_creator(shared)
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UntrustedFileError: "), done.stderr
    assert str(lock) in lines[0] and "symlink" in lines[0] and str(secret) in lines[0]
    assert _untouched(secret)
    assert lock.is_symlink()  # left for the administrator to see


def test_a_symlink_to_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    shared = tmp_path / "shm"
    shared.mkdir()
    target = tmp_path / "would-be-created"
    TablePaths(shared, NAME).lock.symlink_to(target)
    done = run_creator(shared)
    assert done.returncode == 2 and "UntrustedFileError" in done.stderr
    assert not target.exists()


def test_a_hard_link_at_the_lock_is_refused(tmp_path: Path, secret: Path) -> None:
    shared = tmp_path / "private"  # a hard link needs the same file system
    os.link(secret, TablePaths(shared, NAME).lock)
    done = run_creator(shared)
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    assert "UntrustedFileError" in done.stderr and "2 link(s)" in done.stderr
    assert _untouched(secret)


def test_a_fifo_at_the_lock_neither_blocks_nor_is_used(tmp_path: Path) -> None:
    os.mkfifo(TablePaths(tmp_path, NAME).lock)
    rows = finite_packed_table(NUM_ROWS, E, seed=3)
    with pytest.raises(UntrustedFileError, match=r"is not a regular file"):
        SharedHostTable.create_or_attach(
            NAME, NUM_ROWS, ROW_BYTES, lambda t: t.copy_(rows), directory=tmp_path, timeout_s=5
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another uid's file needs root")
def test_another_users_lock_is_never_written(tmp_path: Path) -> None:
    """Root can open anyone's file for writing: it still must not write a lock that is not its own."""
    lock = TablePaths(tmp_path, NAME).lock
    lock.write_bytes(SECRET)
    os.chown(lock, 54321, 54321)
    lock.chmod(0o666)
    done = run_creator(tmp_path)
    assert done.returncode == 0 and "published" in done.stdout, done.stderr[-2000:]
    assert lock.read_bytes() == SECRET and stat.S_IMODE(lock.stat().st_mode) == 0o666


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_foreign_holder_is_reported_after_foreign_lock_s(tmp_path: Path) -> None:
    """A process holding the lock without writing the table: a clear error, not an hour's wait."""
    lock = TablePaths(tmp_path, NAME).lock
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        rows = finite_packed_table(NUM_ROWS, E, seed=3)
        began = time.monotonic()
        with pytest.raises(LockTimeoutError) as caught:
            SharedHostTable.create_or_attach(
                NAME,
                NUM_ROWS,
                ROW_BYTES,
                lambda t: t.copy_(rows),
                directory=tmp_path,
                timeout_s=60,
                foreign_lock_s=0.5,
            )
        waited = time.monotonic() - began
    finally:
        holder.kill()
        holder.wait(timeout=10)
    message = str(caught.value)
    assert f"pid {holder.pid} (python" in message and str(lock) in message, message
    assert "foreign_lock_s=0.5" in message
    assert isinstance(caught.value, TimeoutError)
    assert 0.5 <= waited < 30, waited  # bounded by foreign_lock_s, not by timeout_s
    # Once the holder is gone the same call publishes the table.
    table = SharedHostTable.create_or_attach(
        NAME, NUM_ROWS, ROW_BYTES, lambda t: t.copy_(rows), directory=tmp_path, timeout_s=10
    )
    assert table.created


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), "5"])
def test_bad_waits_are_refused(tmp_path: Path, bad: object) -> None:
    from engramrt.errors import ValidationError

    with pytest.raises(ValidationError, match=r"foreign_lock_s=.*expected a finite number"):
        SharedHostTable.create_or_attach(
            NAME, NUM_ROWS, ROW_BYTES, lambda t: None, directory=tmp_path, foreign_lock_s=bad
        )
