"""Filling a table's host memory fast: synthetic rows in parallel, NUMA policy, huge pages.

A V4.1-Flash layer is 384 M rows of 264 B (94.4 GiB). Written by one thread
it takes minutes, and on machines that provision memory on first touch the
first write of each page is the cost. :func:`fill_synthetic_rows` writes
the rows of :func:`engramrt.lookup.synthetic.synthetic_packed_rows`
(bytes computed from the row id, bit for bit the same) into a target such
as the mapping a :class:`~engramrt.distributed.SharedHostTable` hands its
loader, with ``num_threads`` threads each writing one disjoint, contiguous
row range (so the first touch of every page is done by a filler thread, in
parallel):

- ``device="cpu"``: each thread computes its rows with numpy (which
  releases the GIL; one core per thread) and writes them;
- ``device="cuda:N"``: the GPU computes blocks of rows with the torch
  definition itself, copies each into one of two pinned staging buffers, and
  the threads copy the staging buffer into the target while the GPU
  computes the next block; with ``copy="direct"`` the threads first touch
  every page of the target (allocating them in parallel), then the target
  is registered for CUDA (:func:`engramrt.memory.cuda_host_register`) and
  the GPU copies each block straight into it while it computes the next;
  the registration is undone at the end.

Placement helpers, each best effort and reporting what happened rather than
raising (containers often forbid them):

- :func:`memory_policy`: the calling thread's NUMA policy (``interleave``
  over nodes, or ``bind`` to some) through ``set_mempolicy``, for the
  duration of a ``with`` block. Pages of a shared table are allocated when
  the creator reserves the file (``posix_fallocate``) in the calling thread,
  so wrapping :meth:`SharedHostTable.create_or_attach` places them.
- :func:`bind_rows`: the same policy set on the memory itself (``mbind``),
  for pages first touched later by any thread (a sparse reservation,
  ``reserve="truncate"``, leaves the allocation to the fill's writers).
- :func:`advise_hugepages`: ``madvise(MADV_HUGEPAGE)`` on a tensor's pages.
- :func:`numa_nodes`, :func:`device_numa_node`, :func:`hugepage_state`: what
  the machine offers, for reports.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt import memory
from engramrt.distributed.shared_table import Loader
from engramrt.errors import CapacityError, ValidationError
from engramrt.lookup.synthetic import _A, _B, _C, _P, synthetic_packed_rows
from engramrt.packed import row_bytes_for

__all__ = [
    "FillStats",
    "advise_hugepages",
    "bind_rows",
    "device_numa_node",
    "fill_synthetic_rows",
    "hugepage_state",
    "memory_policy",
    "numa_nodes",
    "synthetic_loader",
    "synthetic_rows_numpy",
]

CPU_BLOCK_ROWS = 2048
"""Rows one CPU thread computes at once: ~4 MiB of int64 temporaries, cache-sized."""
CUDA_BLOCK_ROWS = 1 << 21
"""Rows the GPU computes per block: 528 MiB of packed rows per staging buffer."""


def synthetic_rows_numpy(
    first_row: int, count: int, E: int, seed: int = 0, out: np.ndarray | None = None
) -> np.ndarray:
    """``[count, E + E/32]`` uint8: rows ``first_row ..`` of ``synthetic_packed_rows``, in numpy.

    The same integer arithmetic as the torch definition (int64, no
    overflow: every product stays below ``2**62``), in place where it can,
    single-threaded and without the GIL, so threads compute in parallel.
    """
    row_bytes = row_bytes_for(E)
    if out is None:
        out = np.empty((count, row_bytes), dtype=np.uint8)
    if count == 0:
        return out
    r = np.arange(first_row, first_row + count, dtype=np.int64)
    np.remainder(r, _P, out=r)
    r *= _B
    column = np.arange(row_bytes, dtype=np.int64) * 7_919 + seed * 104_729  # [row_bytes]
    h = r[:, None] + column[None, :]  # [count, row_bytes]
    np.remainder(h, _P, out=h)
    h *= _A
    h += 12_345
    np.remainder(h, _P, out=h)
    h ^= h >> 13
    h *= _C
    h += 1
    np.remainder(h, _P, out=h)
    values = out[:, :E]
    np.bitwise_and(h[:, :E], 0xFF, out=values, casting="unsafe")
    values ^= ((values & 0x7F) == 0x7F).view(np.uint8)  # NaN codes 0x7F/0xFF -> +-448
    scales = h[:, E:]
    np.remainder(scales, 26, out=scales)
    scales += 110
    out[:, E:] = scales
    return out


@dataclass(frozen=True)
class FillStats:
    """What one fill did: rows written, seconds, threads, the computing device, bytes/s."""

    num_rows: int
    nbytes: int
    seconds: float
    num_threads: int
    device: str

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


def _split(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, num_rows)``, sizes differing by at most one."""
    return [(num_rows * i // parts, num_rows * (i + 1) // parts) for i in range(parts)]


def _check_target(target: torch.Tensor, E: int) -> np.ndarray:
    row_bytes = row_bytes_for(E)
    if (
        target.dtype != torch.uint8
        or target.device.type != "cpu"
        or target.dim() != 2
        or target.shape[1] != row_bytes
        or not target.is_contiguous()
    ):
        raise ValidationError(
            f"target: {tuple(target.shape)} {target.dtype} on {target.device}"
            f"{'' if target.is_contiguous() else ', not contiguous'}; expected a contiguous "
            f"[num_rows, {row_bytes}] uint8 CPU tensor for E={E}"
        )
    return target.numpy()


def fill_synthetic_rows(
    target: torch.Tensor,
    E: int,
    seed: int = 0,
    *,
    row_begin: int = 0,
    num_threads: int | None = None,
    device: torch.device | str = "cpu",
    block_rows: int | None = None,
    copy: str = "staged",
) -> FillStats:
    """Write rows ``row_begin + i`` of the synthetic table into ``target[i]``, in parallel.

    Args:
        target: contiguous ``[num_rows, E + E/32]`` uint8 CPU tensor (a
            shared table's fresh mapping: its pages are first touched here).
        E: head dim (256 for V4.1-Flash).
        seed: selects the table (as :class:`SyntheticRowStore`'s ``seed``).
        row_begin: global id of ``target``'s first row (a shard's offset).
        num_threads: writer threads (default: the CPUs this process may use).
        device: ``"cpu"`` computes in the threads; a CUDA device computes
            on the GPU and the threads only copy.
        block_rows: rows computed at once (default :data:`CPU_BLOCK_ROWS`
            or :data:`CUDA_BLOCK_ROWS`).
        copy: how a CUDA device's rows reach ``target``: ``"staged"``
            (pinned staging buffers, copied out by the threads) or
            ``"direct"`` (``target`` registered for CUDA, the device copies
            into it); see the module doc.
    """
    array = _check_target(target, E)
    threads = int(num_threads) if num_threads is not None else len(os.sched_getaffinity(0))
    if threads < 1:
        raise ValidationError(f"num_threads={num_threads}; expected >= 1")
    if row_begin < 0:
        raise ValidationError(f"row_begin={row_begin}; expected >= 0")
    where = torch.device(device)
    if where.type not in ("cpu", "cuda"):
        raise ValidationError(f"device={device!r}; expected 'cpu' or a CUDA device")
    block = int(block_rows) if block_rows is not None else None
    if block is not None and block < 1:
        raise ValidationError(f"block_rows={block_rows}; expected >= 1")
    if copy not in ("staged", "direct"):
        raise ValidationError(f"copy={copy!r}; expected 'staged' or 'direct'")
    num_rows = array.shape[0]
    start = time.perf_counter()
    if num_rows:
        if where.type == "cpu":
            _fill_cpu(array, E, seed, row_begin, threads, block or CPU_BLOCK_ROWS)
        else:
            _fill_cuda(target, E, seed, row_begin, threads, where, block or CUDA_BLOCK_ROWS, copy)
    return FillStats(num_rows, array.nbytes, time.perf_counter() - start, threads, str(where))


def _fill_cpu(
    array: np.ndarray, E: int, seed: int, row_begin: int, threads: int, block: int
) -> None:
    def fill_range(begin: int, end: int) -> None:
        for first in range(begin, end, block):
            last = min(end, first + block)
            synthetic_rows_numpy(row_begin + first, last - first, E, seed, out=array[first:last])

    _in_parallel(fill_range, array.shape[0], threads)


def _in_parallel(work: Callable[[int, int], None], count: int, threads: int) -> None:
    """``work(begin, end)`` over ``threads`` contiguous ranges of ``[0, count)`` at once."""
    with ThreadPoolExecutor(threads, thread_name_prefix="engramrt-fill") as pool:
        for future in [pool.submit(work, b, e) for b, e in _split(count, threads)]:
            future.result()


def _device_blocks(
    num_rows: int, E: int, seed: int, row_begin: int, device: torch.device, block: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first, packed)``: the synthetic rows ``[first, first + block)`` of the target,
    computed on ``device`` (queued on its current stream), block by block."""
    for first in range(0, num_rows, block):
        count = min(block, num_rows - first)
        ids = torch.arange(row_begin + first, row_begin + first + count, device=device)
        yield first, synthetic_packed_rows(ids, E, seed)


def _fill_cuda(
    target: torch.Tensor, E: int, seed: int, row_begin: int, threads: int, device: torch.device,
    block: int, copy: str,
) -> None:  # fmt: skip
    block = min(block, target.shape[0])
    blocks = _device_blocks(target.shape[0], E, seed, row_begin, device, block)
    if copy == "direct":
        _copy_direct(target, blocks, threads, device)
    else:
        _copy_staged(target.numpy(), blocks, threads, device, block)


def _copy_staged(
    array: np.ndarray,
    blocks: Iterator[tuple[int, torch.Tensor]],
    threads: int,
    device: torch.device,
    block: int,
) -> None:
    """Each block into one of two pinned staging buffers, copied out by the threads while
    the GPU computes the next."""
    staging = [
        torch.empty((block, array.shape[1]), dtype=torch.uint8, pin_memory=True) for _ in range(2)
    ]
    in_flight: list[list[Future[None]]] = [[], []]

    def copy_out(source: np.ndarray, first: int) -> None:
        array[first : first + source.shape[0]] = source

    with ThreadPoolExecutor(threads, thread_name_prefix="engramrt-fill") as pool:
        for index, (first, packed) in enumerate(blocks):
            slot = index % 2
            for future in in_flight[slot]:  # the buffer is free again
                future.result()
            count = packed.shape[0]
            buffer = staging[slot][:count]
            buffer.copy_(packed, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            source = buffer.numpy()
            in_flight[slot] = [
                pool.submit(copy_out, source[b:e], first + b) for b, e in _split(count, threads)
            ]
        for futures in in_flight:
            for future in futures:
                future.result()


class _Registration:
    """Owner of a fill's registration: undone when it is collected."""


def _first_touch(target: torch.Tensor, threads: int) -> None:
    """Write a zero to every page of ``target`` from ``threads`` threads, each a contiguous
    range: the pages a fill is about to overwrite are allocated (and zeroed) in
    parallel, where a registration would fault them in one by one."""
    flat = target.view(-1)

    def touch(begin: int, end: int) -> None:
        flat[begin:end:4096].fill_(0)  # one byte a page: torch releases the GIL

    _in_parallel(touch, flat.numel(), threads)


def _copy_direct(
    target: torch.Tensor,
    blocks: Iterator[tuple[int, torch.Tensor]],
    threads: int,
    device: torch.device,
) -> None:
    """``target`` registered for CUDA (its pages first touched by the threads), each block
    copied into it by the GPU on a side stream while the next is computed."""
    _first_touch(target, threads)
    owner = _Registration()
    status = memory.cuda_host_register(owner, target)
    if status != 0:
        raise CapacityError(
            f"copy='direct' could not register the fill's target "
            f"({memory.format_bytes(target.numel())}) for CUDA: cudaError {status} (is the "
            f"memlock limit, ulimit -l, below the table size?); copy='staged' needs no "
            f"registration"
        )
    # One CUDA copy may not span two registered pieces: each block's bytes are
    # copied piece by piece.
    base = target.data_ptr()
    bounds = [address - base for address, _ in memory.register_spans(base, target.numel())]
    bounds.append(target.numel())
    flat = target.view(-1)
    row_bytes = target.shape[1]
    compute = torch.cuda.current_stream(device)
    copies = torch.cuda.Stream(device)
    copied: list[torch.cuda.Event | None] = [None, None]  # two blocks in flight at most
    for index, (first, packed) in enumerate(blocks):
        copies.wait_stream(compute)  # the block is computed; the next one starts now
        lo, hi = first * row_bytes, (first + packed.shape[0]) * row_bytes
        source = packed.view(-1)
        with torch.cuda.stream(copies):
            for piece_lo, piece_hi in itertools.pairwise(bounds):
                a, b = max(lo, piece_lo), min(hi, piece_hi)
                if a < b:
                    flat[a:b].copy_(source[a - lo : b - lo], non_blocking=True)
        packed.record_stream(copies)
        copied[index % 2] = copies.record_event()
        if (event := copied[(index + 1) % 2]) is not None:
            event.synchronize()  # else the host would queue blocks, each on new memory
    copies.synchronize()
    del owner  # unregistered here: the fill's mapping is not the one served


def synthetic_loader(
    E: int,
    seed: int = 0,
    *,
    row_begin: int = 0,
    num_threads: int | None = None,
    device: torch.device | str = "cpu",
    hugepages: bool = False,
    numa: tuple[str, Sequence[int] | None] = ("none", None),
    stats: list[FillStats] | None = None,
    copy: str = "staged",
) -> Loader:
    """A :data:`Loader` that fills a table with :func:`fill_synthetic_rows`.

    Before the first write: ``hugepages``: :func:`advise_hugepages` on the
    target; ``numa``: ``(mode, nodes)`` for :func:`bind_rows` on the target.
    ``stats``: each fill's :class:`FillStats` is appended to it; ``copy``: see
    :func:`fill_synthetic_rows`.
    """
    if numa[0] != "none":
        _policy_mode(*numa)  # checked at the door, not inside the creator's lock

    def load(target: torch.Tensor) -> None:
        if hugepages:
            advise_hugepages(target)
        bind_rows(target, *numa)
        done = fill_synthetic_rows(
            target,
            E,
            seed,
            row_begin=row_begin,
            num_threads=num_threads,
            device=device,
            copy=copy,
        )
        if stats is not None:
            stats.append(done)

    return load


# --- placement -------------------------------------------------------------------------


_MPOL_DEFAULT, _MPOL_BIND, _MPOL_INTERLEAVE = 0, 2, 3
_MADV_HUGEPAGE = 14
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261}
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}
_libc_lock = threading.Lock()
_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL:
    global _libc
    with _libc_lock:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return _libc


def numa_nodes() -> list[int]:
    """The host's NUMA nodes with memory (``/sys/devices/system/node``); ``[0]`` if unknown."""
    root = Path("/sys/devices/system/node")
    nodes = sorted(
        int(path.name[4:])
        for path in root.glob("node*")
        if path.name[4:].isdigit() and (path / "meminfo").exists()
    )
    return nodes or [0]


def device_numa_node(device: torch.device | str) -> int | None:
    """The NUMA node of a CUDA device's PCI slot (None: unknown, or not a CUDA device)."""
    where = torch.device(device)
    if where.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(where)
    try:
        domain, bus_id, slot = (
            getattr(props, name) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
        )
        bus = f"{domain:04x}:{bus_id:02x}:{slot:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (AttributeError, OSError, ValueError):
        return None
    return node if node >= 0 else None


def _nodemask(nodes: Sequence[int]) -> tuple[Any, int]:
    """The kernel's node bitmask for ``nodes`` and its ``maxnode`` (None, 0 for no nodes)."""
    if not nodes:
        return None, 0
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    maxnode = max(nodes) + 2
    words = (ctypes.c_ulong * (maxnode // bits + 1))()
    for node in nodes:
        words[node // bits] |= 1 << (node % bits)
    return words, maxnode


def _set_mempolicy(mode: int, nodes: Sequence[int]) -> int:
    """``set_mempolicy(mode, nodes)`` for the calling thread; returns 0 or the errno."""
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return errno.ENOSYS  # no known syscall number on this architecture
    mask, maxnode = _nodemask(nodes)
    status = _load_libc().syscall(
        ctypes.c_long(number), ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode)
    )
    return 0 if status == 0 else ctypes.get_errno()


def _policy_mode(mode: str, nodes: Sequence[int] | None) -> tuple[int, list[int]]:
    if mode not in ("interleave", "bind"):
        raise ValidationError(f"mode={mode!r}; expected 'none', 'interleave' or 'bind'")
    chosen = list(nodes) if nodes is not None else (numa_nodes() if mode == "interleave" else [0])
    if not chosen or min(chosen) < 0:
        raise ValidationError(f"nodes={nodes!r}; expected non-negative NUMA node numbers")
    return (_MPOL_INTERLEAVE if mode == "interleave" else _MPOL_BIND), chosen


def bind_rows(rows: torch.Tensor, mode: str, nodes: Sequence[int] | None = None) -> str:
    """``mbind`` the pages under ``rows`` to ``mode`` over ``nodes``; returns what happened.

    The policy belongs to the memory, not to a thread: pages of a shared
    mapping faulted afterwards by any thread (the fill's writers, after a
    sparse reservation) follow it. Pages that already exist stay where they
    are. ``mode``, ``nodes``: as :func:`memory_policy`.
    """
    if mode == "none":
        return "none"
    policy, chosen = _policy_mode(mode, nodes)
    nbytes = rows.numel() * rows.element_size()
    if nbytes == 0:
        return "empty"
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        return f"not applied: no mbind on {platform.machine()}"
    page = mmap.PAGESIZE
    begin = rows.data_ptr() // page * page
    mask, maxnode = _nodemask(chosen)
    status = _load_libc().syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(begin),
        ctypes.c_ulong(rows.data_ptr() + nbytes - begin),
        ctypes.c_int(policy),
        mask,
        ctypes.c_ulong(maxnode),
        ctypes.c_uint(0),
    )
    if status != 0:
        return f"not applied: mbind({mode}, {chosen}) failed: {os.strerror(ctypes.get_errno())}"
    return f"applied {mode} {chosen}"


@contextlib.contextmanager
def memory_policy(mode: str, nodes: Sequence[int] | None = None) -> Iterator[str]:
    """The calling thread allocates pages by ``mode`` inside the block; yields what happened.

    ``mode``: ``"none"`` (leave the policy alone), ``"interleave"`` (round
    robin over ``nodes``, default all) or ``"bind"`` (only ``nodes``,
    default node 0). Yields ``"applied ..."``, ``"none"`` or why it was
    not applied (``set_mempolicy`` failed: no NUMA support, seccomp); the
    default policy is restored on exit.
    """
    if mode == "none":
        yield "none"
        return
    policy, chosen = _policy_mode(mode, nodes)
    status = _set_mempolicy(policy, chosen)
    if status != 0:
        yield f"not applied: set_mempolicy({mode}, {chosen}) failed: {os.strerror(status)}"
        return
    try:
        yield f"applied {mode} {chosen}"
    finally:
        _set_mempolicy(_MPOL_DEFAULT, [])


def advise_hugepages(rows: torch.Tensor) -> str:
    """``madvise(MADV_HUGEPAGE)`` on the whole pages under ``rows``; returns ``"ok"`` or why not.

    Takes effect for pages faulted afterwards, where the kernel allows it:
    ``transparent_hugepage/enabled`` (private memory) or ``shmem_enabled``
    and the tmpfs ``huge=`` mount option (a shared table) must not be
    ``never`` (see :func:`hugepage_state`).
    """
    nbytes = rows.numel() * rows.element_size()
    if nbytes == 0:
        return "empty"
    page = mmap.PAGESIZE
    begin = rows.data_ptr() // page * page
    end = rows.data_ptr() + nbytes
    libc = _load_libc()
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(begin, end - begin, _MADV_HUGEPAGE) != 0:
        return f"madvise(MADV_HUGEPAGE) failed: {os.strerror(ctypes.get_errno())}"
    return "ok"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def hugepage_state(directory: str | os.PathLike[str] = "/dev/shm") -> dict[str, object]:
    """Transparent and explicit huge page settings, and the mount options of ``directory``."""
    meminfo: dict[str, int] = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key in (
            "AnonHugePages",
            "ShmemHugePages",
            "ShmemPmdMapped",
            "HugePages_Total",
            "HugePages_Free",
            "Hugepagesize",
            "Shmem",
            "MemAvailable",
        ):
            parts = value.split()
            meminfo[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    mount = None
    target = str(Path(directory).resolve())
    best = -1
    for line in (_read("/proc/mounts") or "").splitlines():
        fields = line.split()
        if (
            len(fields) >= 4
            and (target + "/").startswith(fields[1].rstrip("/") + "/")
            and len(fields[1]) >= best  # the longest prefix; the last of equals is on top
        ):
            best = len(fields[1])
            mount = {"mount": fields[1], "type": fields[2], "options": fields[3]}
    return {
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "meminfo_bytes": meminfo,
        "directory_mount": mount,
    }
