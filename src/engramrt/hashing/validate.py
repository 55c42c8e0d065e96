"""Checks of a hashing batch, in two halves.

- :func:`check_batch_metadata`: types, shapes, dtypes and devices of every
  field, on the host; reads no tensor's contents, so it never synchronises
  with the device (the hasher's ``validate``, on by default).
- :func:`check_batch_contents`: the values (token ids in the vocabulary,
  request boundaries, consecutive positions, lookback ids, history slots and
  block tables); copies tensors to the host, so it synchronises (the
  hasher's ``check_ids``, off on the hot path). It assumes the metadata
  half passed.
"""

from __future__ import annotations

import numpy as np
import torch

from engramrt.errors import ValidationError
from engramrt.hashing.types import HashBatch

__all__ = ["check_batch_contents", "check_batch_metadata"]

_INT_DTYPES = (torch.int32, torch.int64)
_INT_NAMES = "torch.int32 or torch.int64"


def _field(
    name: str,
    x: object,
    shape: tuple[int | None, ...],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    expected_dtype: str,
) -> torch.Tensor:
    """``x`` itself once its type, shape (None: any length), dtype and device are right."""
    if not isinstance(x, torch.Tensor):
        raise ValidationError(f"{name} is {type(x).__name__}; expected a torch.Tensor")
    if x.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(x.shape, shape, strict=True)
    ):
        want_text = "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"
        raise ValidationError(f"{name} has shape {list(x.shape)}; expected {want_text}")
    if x.dtype not in dtypes:
        raise ValidationError(f"{name} has dtype {x.dtype}; expected {expected_dtype}")
    if x.device != device:
        raise ValidationError(f"{name} is on {x.device}; expected {device} like input_ids")
    return x


def check_batch_metadata(
    batch: HashBatch, *, max_ngram_size: int, history: object | None = None
) -> None:
    """Raise :class:`ValidationError` naming the first field whose type, shape, dtype or
    device breaks the contract. Reads no tensor's contents: never synchronises."""
    from engramrt.hashing.history import RequestHistory, SlotHashCache

    if not isinstance(batch.input_ids, torch.Tensor):
        raise ValidationError(
            f"input_ids is {type(batch.input_ids).__name__}; expected a torch.Tensor"
        )
    device = batch.input_ids.device
    ids = _field("input_ids", batch.input_ids, (None,), device, _INT_DTYPES, _INT_NAMES)
    t_len = ids.shape[0]
    _field("positions", batch.positions, (t_len,), device, _INT_DTYPES, _INT_NAMES)
    qsl = _field("query_start_loc", batch.query_start_loc, (None,), device, _INT_DTYPES, _INT_NAMES)
    if qsl.shape[0] < 1:
        raise ValidationError("query_start_loc is empty; expected [R+1] boundaries")
    n_req = qsl.shape[0] - 1
    if batch.dead_mask is not None:
        _field("dead_mask", batch.dead_mask, (t_len,), device, (torch.bool,), "torch.bool")
    lookback_shape = (n_req, max_ngram_size - 1)
    if batch.lookback_token_ids is not None:
        _field(
            "lookback_token_ids",
            batch.lookback_token_ids,
            lookback_shape,
            device,
            _INT_DTYPES,
            _INT_NAMES,
        )
    if batch.lookback_dead is not None:
        if batch.lookback_token_ids is None:
            raise ValidationError("lookback_dead was given without lookback_token_ids")
        _field(
            "lookback_dead",
            batch.lookback_dead,
            lookback_shape,
            device,
            (torch.bool,),
            "torch.bool",
        )
    if isinstance(history, SlotHashCache):
        if batch.slot_mapping is None or batch.block_table is None:
            raise ValidationError("a SlotHashCache needs slot_mapping and block_table in the batch")
        _field("slot_mapping", batch.slot_mapping, (t_len,), device, _INT_DTYPES, _INT_NAMES)
        _field("block_table", batch.block_table, (n_req, None), device, _INT_DTYPES, _INT_NAMES)
        if history.device != device:
            raise ValidationError(f"the SlotHashCache is on {history.device}; expected {device}")
    elif isinstance(history, RequestHistory):
        if batch.request_slots is None:
            raise ValidationError("a RequestHistory needs request_slots in the batch")
        _field("request_slots", batch.request_slots, (n_req,), device, _INT_DTYPES, _INT_NAMES)
        if history.device != device:
            raise ValidationError(f"the RequestHistory is on {history.device}; expected {device}")
    elif history is not None:
        raise ValidationError(
            f"history={type(history).__name__} is not a SlotHashCache or RequestHistory"
        )


def _host(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy().astype(np.int64)


def check_batch_contents(
    batch: HashBatch,
    *,
    vocab_size: int,
    max_ngram_size: int,
    history: object | None = None,
) -> None:
    """Raise :class:`ValidationError` naming the first value that breaks the contract.

    Copies the batch to the host (synchronises). Assumes
    :func:`check_batch_metadata` passed.
    """
    from engramrt.hashing.history import RequestHistory, SlotHashCache

    ids = _host(batch.input_ids)
    t_len = ids.shape[0]
    if t_len and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        raise ValidationError(
            f"input_ids[{bad}]={int(ids[bad])} is outside the tokenizer's ids [0, {vocab_size})"
        )
    positions = _host(batch.positions)
    qsl = _host(batch.query_start_loc)
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
    if batch.lookback_token_ids is not None:
        lb = _host(batch.lookback_token_ids)
        if lb.size and (lb.min() < -1 or lb.max() >= vocab_size):
            raise ValidationError(
                f"lookback_token_ids holds {int(lb.min())}..{int(lb.max())}; expected -1 "
                f"(unknown) or ids in [0, {vocab_size})"
            )
    if isinstance(history, SlotHashCache):
        assert batch.slot_mapping is not None and batch.block_table is not None
        slots = _host(batch.slot_mapping)
        if slots.size and (slots.max() >= history.num_slots or slots.min() < -1):
            raise ValidationError(
                f"slot_mapping holds {int(slots.min())}..{int(slots.max())}; expected -1 or "
                f"slots in [0, {history.num_slots})"
            )
        table = _host(batch.block_table)
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
        assert batch.request_slots is not None
        rs = _host(batch.request_slots)
        if rs.size and (rs.min() < 0 or rs.max() >= history.max_requests):
            raise ValidationError(
                f"request_slots holds {int(rs.min())}..{int(rs.max())}; expected slots in "
                f"[0, {history.max_requests})"
            )
