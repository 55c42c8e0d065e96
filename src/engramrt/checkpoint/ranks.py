"""Ranks that load one checkpoint agree on the set they read, or refuse.

Each rank's load holds one conversion set (:class:`SafetensorsCheckpoint`),
but ranks open the directory at different instants: a conversion committing
between rank 0's open and rank 1's gives the two ranks different tables,
each consistent alone. With a process group, the loaders
(:func:`~engramrt.checkpoint.load_tables`, ``load_table``, ``load_layer``,
:meth:`~engramrt.checkpoint.EngramWeightLoader.read_checkpoint`) open the
checkpoint, then all-gather every rank's
:attr:`~engramrt.checkpoint.SafetensorsCheckpoint.conversion_id` (a fixed
128-byte record per rank, so any backend moves it) before reading a row:

- every rank holds the same id: the load goes on, from the held set;
- the ids differ and the loaders opened the checkpoint themselves (a path
  was given): every rank closes its set and opens the directory again, right
  after the collective, so the ranks open it nearly together; up to
  :data:`AGREE_ATTEMPTS` times;
- the ids still differ (or the caller passed an already open checkpoint,
  which cannot be reopened): a :class:`~engramrt.errors.CheckpointError` on
  every rank naming each rank's conversion id;
- a rank could not open the checkpoint: it raises its own error and every
  other rank a :class:`~engramrt.errors.CheckpointError` naming that rank,
  so no rank waits for ever in a later collective.

Every rank takes the same decision from the same gathered records, so the
ranks run the same number of collectives.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from engramrt.checkpoint.reader import SafetensorsCheckpoint
from engramrt.errors import CheckpointError, ValidationError

__all__ = ["AGREE_ATTEMPTS", "RECORD_BYTES", "agreed_checkpoint", "gather_conversion_ids"]

AGREE_ATTEMPTS = 5
"""Times the ranks open a path again when they found different conversions."""

RECORD_BYTES = 128
"""Bytes per rank in the all-gather: a status byte, a length byte, the id (at most 126 bytes;
a longer id travels as ``sha256:<hex>`` of itself)."""

_OK, _FAILED = 1, 2


def _encode(conversion_id: str | None) -> torch.Tensor:
    record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    if conversion_id is None:
        record[0] = _FAILED
        return record
    raw = conversion_id.encode()
    if len(raw) > RECORD_BYTES - 2:
        raw = f"sha256:{hashlib.sha256(raw).hexdigest()}".encode()
    record[0], record[1] = _OK, len(raw)
    record[2 : 2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return record


def _decode(record: torch.Tensor) -> str | None:
    values = record.tolist()
    if values[0] != _OK:
        return None
    return bytes(values[2 : 2 + values[1]]).decode()


def _group_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device for NCCL."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_group(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; a clear error when it cannot be used."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValidationError(
            f"group={group!r} but torch.distributed is not initialised; expected a process "
            f"group of the ranks loading this checkpoint (after init_process_group), or None"
        )
    try:
        rank = dist.get_rank(group)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValidationError(
            f"group={group!r} is not a process group ({exc}); expected a "
            f"torch.distributed ProcessGroup or None"
        ) from exc
    if rank < 0:
        raise ValidationError(
            f"group={group!r}: this process is not a member of it; expected a group holding "
            f"every rank that loads the checkpoint"
        )
    return rank, dist.get_world_size(group)


def gather_conversion_ids(conversion_id: str | None, group: Any) -> list[str | None]:
    """Every rank's conversion id (None for a rank that could not open the checkpoint)."""
    import torch.distributed as dist

    _rank, size = check_group(group)
    device = _group_device(group)
    record = _encode(conversion_id).to(device)
    gathered = [torch.empty_like(record) for _ in range(size)]
    dist.all_gather(gathered, record, group=group)
    return [_decode(item.cpu()) for item in gathered]


def _mismatch(where: str, ids: list[str | None], attempts: int) -> CheckpointError:
    listed = ", ".join(f"rank {rank}: conversion {cid}" for rank, cid in enumerate(ids))
    reason = (
        f"opened {attempts} times, a conversion kept committing meanwhile; load again when it "
        f"has finished"
        if attempts > 1
        else "the checkpoint was passed open, so it is not opened again; open it again on "
        "every rank, or pass its path"
    )
    return CheckpointError(
        f"{where}: the ranks hold different conversions ({listed}); expected one conversion on "
        f"every rank ({reason})"
    )


@contextlib.contextmanager
def agreed_checkpoint(
    checkpoint: SafetensorsCheckpoint | str | os.PathLike[str], group: Any
) -> Iterator[SafetensorsCheckpoint]:
    """The checkpoint, opened so that every rank of ``group`` holds the same conversion.

    A path is opened here (again, when the ranks differ; see the module doc)
    and closed afterwards; an open :class:`SafetensorsCheckpoint` is checked
    once and left open. With ``group=None``: the checkpoint as it is.

    Raises:
        CheckpointError: the ranks hold different conversions (naming every
            rank's id), or another rank could not open the checkpoint.
        ValidationError: ``group`` is not a usable process group.
    """
    passed = checkpoint if isinstance(checkpoint, SafetensorsCheckpoint) else None
    given = passed is not None
    if group is None:
        if passed is not None:
            yield passed
            return
        with SafetensorsCheckpoint(checkpoint) as opened:  # type: ignore[arg-type]
            yield opened
        return
    rank, _size = check_group(group)
    where = str(checkpoint if passed is None else passed.path)
    attempts = 1 if given else AGREE_ATTEMPTS
    for attempt in range(1, attempts + 1):
        held: SafetensorsCheckpoint | None = None
        failure: Exception | None = None
        own: str | None = None
        try:
            held = passed or SafetensorsCheckpoint(checkpoint)  # type: ignore[arg-type]
            own = held.conversion_id
        except Exception as exc:  # told to the other ranks, then raised here
            failure, own = exc, None
        ids = gather_conversion_ids(own, group)
        if failure is not None:
            if held is not None and not given:
                held.close()
            raise failure
        assert held is not None
        failed = [r for r, cid in enumerate(ids) if cid is None]
        if failed or len(set(ids)) > 1:
            if not given:
                held.close()
            if failed:
                raise CheckpointError(
                    f"{where}: rank(s) {failed} could not open the checkpoint (their own error "
                    f"says why); rank {rank} stops its load too"
                )
            if attempt == attempts:
                raise _mismatch(where, ids, attempts)
            continue
        try:
            yield held
        finally:
            if not given:
                held.close()
        return
