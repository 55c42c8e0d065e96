"""Host-side checks of a hashing batch (switch off on the hot path).

These read tensors back to the host, so they synchronise with the device;
engines that trust their inputs pass ``validate=False`` to the hasher.
"""

from __future__ import annotations

import numpy as np
import torch

from engramrt.errors import ValidationError
from engramrt.hashing.types import HashBatch

__all__ = ["validate_batch"]

_INT_DTYPES = (torch.int32, torch.int64)


def _vec(name: str, x: torch.Tensor | None, length: int | None, device: torch.device) -> np.ndarray:
    if not isinstance(x, torch.Tensor):
        raise ValidationError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dim() != 1 or (length is not None and x.shape[0] != length):
        want = f"[{length}]" if length is not None else "1-D"
        raise ValidationError(f"{name} has shape {list(x.shape)}; expected {want}")
    if x.device != device:
        raise ValidationError(f"{name} is on {x.device}; expected {device} like input_ids")
    return x.detach().cpu().numpy()


def validate_batch(
    batch: HashBatch,
    *,
    vocab_size: int,
    max_ngram_size: int,
    history: object | None = None,
) -> None:
    """Raise :class:`ValidationError` naming the first field that breaks the contract."""
    from engramrt.hashing.history import RequestHistory, SlotHashCache

    device = batch.input_ids.device
    if batch.input_ids.dtype not in _INT_DTYPES:
        raise ValidationError(
            f"input_ids has dtype {batch.input_ids.dtype}; expected int32 or int64"
        )
    ids = _vec("input_ids", batch.input_ids, None, device)
    t_len = ids.shape[0]
    if t_len and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        raise ValidationError(
            f"input_ids[{bad}]={int(ids[bad])} is outside the tokenizer's ids [0, {vocab_size})"
        )
    positions = _vec("positions", batch.positions, t_len, device)
    qsl = _vec("query_start_loc", batch.query_start_loc, None, device).astype(np.int64)
    if qsl.shape[0] < 1:
        raise ValidationError("query_start_loc is empty; expected [R+1] boundaries")
    if qsl[0] != 0:
        raise ValidationError(f"query_start_loc[0]={int(qsl[0])}; expected 0")
    steps = np.diff(qsl)
    if (steps < 0).any():
        r = int(np.flatnonzero(steps < 0)[0])
        raise ValidationError(
            f"query_start_loc is not non-decreasing: [{r}]={int(qsl[r])} > [{r + 1}]={int(qsl[r + 1])}"
        )
    if qsl[-1] > t_len:
        raise ValidationError(
            f"query_start_loc[-1]={int(qsl[-1])} exceeds the {t_len} tokens of input_ids"
        )
    n_req = qsl.shape[0] - 1
    for r in range(n_req):
        a, b = int(qsl[r]), int(qsl[r + 1])
        if a == b:
            continue
        chunk = positions[a:b].astype(np.int64)
        if chunk[0] < 0:
            raise ValidationError(f"positions[{a}]={int(chunk[0])} of request {r} is negative")
        if not np.array_equal(chunk, chunk[0] + np.arange(b - a)):
            bad = a + int(np.flatnonzero(chunk != chunk[0] + np.arange(b - a))[0])
            raise ValidationError(
                f"positions of request {r} are not consecutive: positions[{bad}]="
                f"{int(positions[bad])}, expected {int(chunk[0]) + bad - a}"
            )
    if batch.dead_mask is not None:
        _vec("dead_mask", batch.dead_mask, t_len, device)
    for name in ("lookback_token_ids", "lookback_dead"):
        x = getattr(batch, name)
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or list(x.shape) != [n_req, max_ngram_size - 1]:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValidationError(
                f"{name} has shape {shape}; expected [R, N-1] = [{n_req}, {max_ngram_size - 1}]"
            )
        if x.device != device:
            raise ValidationError(f"{name} is on {x.device}; expected {device}")
    if batch.lookback_dead is not None and batch.lookback_token_ids is None:
        raise ValidationError("lookback_dead was given without lookback_token_ids")
    if batch.lookback_token_ids is not None:
        lb = batch.lookback_token_ids.detach().cpu().numpy()
        if lb.size and (lb.min() < -1 or lb.max() >= vocab_size):
            raise ValidationError(
                f"lookback_token_ids holds {int(lb.min())}..{int(lb.max())}; expected -1 "
                f"(unknown) or ids in [0, {vocab_size})"
            )
    if isinstance(history, SlotHashCache):
        if batch.slot_mapping is None or batch.block_table is None:
            raise ValidationError("a SlotHashCache needs slot_mapping and block_table in the batch")
        slots = _vec("slot_mapping", batch.slot_mapping, t_len, device)
        if slots.size and (slots.max() >= history.num_slots or slots.min() < -1):
            raise ValidationError(
                f"slot_mapping holds {int(slots.min())}..{int(slots.max())}; expected -1 or "
                f"slots in [0, {history.num_slots})"
            )
        bt = batch.block_table
        if bt.dim() != 2 or bt.shape[0] != n_req:
            raise ValidationError(f"block_table has shape {list(bt.shape)}; expected [{n_req}, *]")
        if bt.device != device or history.device != device:
            raise ValidationError(
                f"block_table ({bt.device}) and the cache ({history.device}) must be on {device}"
            )
        table = bt.detach().cpu().numpy()
        for r in range(n_req):
            a, b = int(qsl[r]), int(qsl[r + 1])
            if a == b:
                continue
            first = max(0, int(positions[a]) - (max_ngram_size - 1))
            blocks = np.arange(
                first // history.block_size, int(positions[a]) // history.block_size + 1
            )
            if blocks.size and blocks[-1] >= table.shape[1]:
                raise ValidationError(
                    f"block_table row {r} has {table.shape[1]} blocks; position {int(positions[a])} "
                    f"needs block {int(blocks[-1])}"
                )
            used = table[r, blocks]
            if used.size and (
                used.min() < 0 or used.max() * history.block_size >= history.num_slots
            ):
                raise ValidationError(
                    f"block_table[{r}] holds block ids {used.tolist()} outside the cache's "
                    f"{history.num_slots // history.block_size} blocks"
                )
    elif isinstance(history, RequestHistory):
        if batch.request_slots is None:
            raise ValidationError("a RequestHistory needs request_slots in the batch")
        rs = _vec("request_slots", batch.request_slots, n_req, device)
        if rs.size and (rs.min() < 0 or rs.max() >= history.max_requests):
            raise ValidationError(
                f"request_slots holds {int(rs.min())}..{int(rs.max())}; expected slots in "
                f"[0, {history.max_requests})"
            )
        if history.device != device:
            raise ValidationError(f"the RequestHistory is on {history.device}; expected {device}")
    elif history is not None:
        raise ValidationError(
            f"history={type(history).__name__} is not a SlotHashCache or RequestHistory"
        )
