"""Row ids on the host, in vectorized numpy, for lookups that never wait for the device.

A source that gathers rows on the CPU (the ``host`` and ``disk`` tiers) must
learn a step's row ids on the host. Hashed by the GPU, they reach the host
only after the step's hashing has run, a host synchronisation that costs a
decode step more than the rows' whole gather. An engine that keeps its
requests' token ids on the host (most do: they detokenise them) can hand the
step to :func:`hash_batch_host` instead, which computes the same ids, bit for
bit, before the step is launched (an :class:`~engramrt.step.EngineStep`'s host mirror).

The batch's history must come from the chunk and ``lookback_token_ids``
(``lookback_dead``): a history store lives on the device, and reading it
would be the wait this module exists to avoid (:func:`check_host_batch`
names a request whose lookback ids leave a position the store would supply
unknown). Ids outside the vocabulary are clamped, as by every backend
(:func:`~engramrt.hashing.types.clamp_token_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engramrt.errors import ValidationError
from engramrt.hashing.types import HashBatch, HashConstants, host_array

__all__ = ["check_host_batch", "hash_batch_host"]


def hash_batch_host(
    batch: HashBatch,
    consts: HashConstants,
    token_map: np.ndarray,
    layers: Sequence[int] | None = None,
) -> np.ndarray:
    """``[T, len(layers), C]`` int64 row ids of ``batch`` on the host, without a history store.

    The same ids as :func:`~engramrt.hashing.reference.hash_batch_reference` with no
    history (SPEC §5): each token's n-gram reaches back through its chunk, then the
    request's ``lookback_token_ids`` (-1: unknown, hashing as pad); a dead token blocks
    every n-gram through it; padding rows hash as sequence starts. ``layers``: which
    Engram layers (positions in the config) to hash; None: all of them. A batch's
    tensors are read where they are (a device batch is copied to the host first).
    """
    n = consts.max_ngram_size
    vocab = int(token_map.shape[0])
    ids = host_array(batch.input_ids)
    positions = host_array(batch.positions).astype(np.int64, copy=False)
    qsl = host_array(batch.query_start_loc).astype(np.int64, copy=False)
    t_len, n_req = ids.shape[0], qsl.shape[0] - 1
    shifts = np.arange(n)  # k: the token k places back
    token = np.arange(t_len)
    request = np.searchsorted(qsl[1:], token, side="right")  # == n_req: a padding row
    padding_row = request >= n_req
    request[padding_row] = 0
    offset = token - qsl[request]
    offset[padding_row] = 0  # a padding row starts its own sequence
    back = offset[:, None] - shifts  # [T, N]: the place in the chunk, < 0 before it
    in_chunk = back >= 0
    before_start = (positions[:, None] - shifts) < 0
    # One pool of token ids, the chunk's then the lookback ids, and per n-gram slot the
    # index of its id in it: the chunk's token k back, or lookback column -back - 1.
    index = token[:, None] - shifts
    lookback = batch.lookback_token_ids
    known = in_chunk
    if lookback is None:
        pool = ids
    else:
        width = n - 1
        column = -back - 1
        reach = ~in_chunk & (column < width) & ~before_start
        reach[padding_row] = False
        pool = np.concatenate([ids, host_array(lookback).reshape(-1)])
        index = np.where(reach, t_len + request[:, None] * width + column, index)
    index[index < 0] = 0
    values = pool[index]
    if lookback is not None:
        known = in_chunk | (reach & (values >= 0))
    values = token_map[np.clip(values, 0, vocab - 1)]
    blocks = before_start
    blocks[padding_row, 1:] = True
    if batch.dead_mask is not None or batch.lookback_dead is not None:
        dead_pool = [_flags(batch.dead_mask, t_len)]
        if lookback is not None:
            dead_pool.append(_flags(batch.lookback_dead, lookback.numel()))
        blocks |= np.concatenate(dead_pool)[index] & known
    blocked = np.logical_or.accumulate(blocks, axis=1)
    values[blocked | ~known] = consts.pad_id
    return _row_ids(values, consts, range(consts.n_layers) if layers is None else layers)


def _flags(mask: object, size: int) -> np.ndarray:
    """A dead mask as a flat bool array (all False when there is none)."""
    if mask is None:
        return np.zeros(size, dtype=bool)
    return host_array(mask).astype(bool, copy=False).reshape(-1)  # type: ignore[arg-type]


def _row_ids(values: np.ndarray, consts: HashConstants, layers: Sequence[int]) -> np.ndarray:
    """The reference's hash of padded values (``reference._hash_values``, SPEC §4) for
    ``layers``, in a few whole-array operations: every shift's rolling xor at once, then
    one remainder per column."""
    layers = list(layers)
    order = np.repeat(np.arange(1, consts.max_ngram_size), consts.n_heads)  # each column's shift
    with np.errstate(over="ignore"):
        terms = values[:, None, :] * consts.multipliers[layers][None]  # [T, L', N]
        rolling = np.bitwise_xor.accumulate(terms, axis=2)[:, :, order]  # [T, L', C]
        return rolling % consts.col_primes[layers] + consts.offsets[layers]


def check_host_batch(batch: HashBatch, device_batch: HashBatch, *, has_history: bool) -> None:
    """Check that ``batch`` (on the host) can stand for ``device_batch`` in
    :func:`hash_batch_host`: the same step's shape and fields, on the CPU, and, where a
    history store would supply positions before a chunk (``has_history``), lookback ids
    for every one of them. Reads host arrays only (no device synchronisation).

    Raises:
        ValidationError: naming the field, or the request and lookback column, that
            does not fit.
    """
    if not isinstance(batch, HashBatch):
        raise ValidationError(
            f"host_batch is a {type(batch).__name__}; expected a HashBatch on the CPU"
        )
    if batch.device.type != "cpu":
        raise ValidationError(
            f"host_batch is on {batch.device}; expected the step's token ids on the CPU "
            f"(the point of a host batch is that the host already has them)"
        )
    shape = (batch.num_tokens, batch.num_requests)
    expected = (device_batch.num_tokens, device_batch.num_requests)
    if shape != expected:
        raise ValidationError(
            f"host_batch has {shape[0]} tokens and {shape[1]} requests; expected the step's "
            f"{expected[0]} tokens and {expected[1]} requests (the same step as batch)"
        )
    for name in ("dead_mask", "lookback_dead"):
        if (getattr(batch, name) is None) != (getattr(device_batch, name) is None):
            raise ValidationError(
                f"host_batch.{name} is {'missing' if getattr(batch, name) is None else 'set'} "
                f"and batch.{name} is not; expected the same fields in both"
            )
    if has_history:
        _check_lookback_covers(batch)


def _check_lookback_covers(batch: HashBatch) -> None:
    """Every position a chunk's n-grams reach before its start has a lookback id."""
    qsl = host_array(batch.query_start_loc).astype(np.int64, copy=False)
    positions = host_array(batch.positions).astype(np.int64, copy=False)
    firsts = qsl[:-1][qsl[:-1] < qsl[1:]]  # requests with tokens this step
    requests = np.flatnonzero(qsl[:-1] < qsl[1:])
    if requests.size == 0:
        return
    chunk_start = positions[firsts]
    if batch.lookback_token_ids is None:
        needy = requests[chunk_start > 0]
        if needy.size:
            raise ValidationError(
                f"host_batch has no lookback_token_ids, but request {int(needy[0])} starts at "
                f"position {int(chunk_start[needy[0] == requests][0])}; expected lookback ids "
                f"for the positions before each chunk (the runtime's history lives on the "
                f"device, where the host cannot read it)"
            )
        return
    lookback = host_array(batch.lookback_token_ids)
    width = lookback.shape[1]
    needed = np.arange(width)[None, :] < np.minimum(chunk_start, width)[:, None]  # [R', N-1]
    missing = needed & (lookback[requests] < 0)
    if missing.any():
        row, column = (int(i) for i in np.argwhere(missing)[0])
        raise ValidationError(
            f"host_batch.lookback_token_ids[{int(requests[row])}, {column}] = -1 (position "
            f"{int(chunk_start[row]) - 1 - column}); expected every position before the "
            f"chunk within {width} tokens: the runtime's history lives on the device, where "
            f"the host cannot read it"
        )
