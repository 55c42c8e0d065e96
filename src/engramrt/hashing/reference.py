"""Reference n-gram hashing (SPEC §4 and §5), in numpy int64.

Two functions define what every kernel must return, bit for bit:

- :func:`hash_sequence` hashes one whole sequence at once (SPEC §4);
- :func:`hash_batch_reference` hashes one engine step: a ragged batch of
  chunks whose history comes from the chunk, ``lookback_token_ids`` or a
  history store (SPEC §5), updating that store as the kernel does.

They are written for reading, not speed: loops over tokens and shifts.

Inputs that break the batch contract (what ``check_ids`` refuses) still
have one defined result, the kernel's: a token id outside ``[0, V)`` (in
the batch or the lookback ids) is clamped to ``0`` or ``V - 1`` before the
token map is read; a history entry outside the store (a block table column
past its width, a block id outside the cache, a request slot outside the
rings) is unknown, hashing as pad, and nothing is written there; a
``slot_mapping`` entry outside ``[0, num_slots)`` is not written (see
:func:`clamp_token_ids`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engramrt.hashing.types import (
    DEAD,
    EMPTY,
    HashBatch,
    HashConstants,
    clamp_token_ids,
    host_array,
)

if TYPE_CHECKING:
    from engramrt.hashing.history import RequestHistory, SlotHashCache

__all__ = ["clamp_token_ids", "hash_batch_reference", "hash_sequence"]


def _hash_values(values: np.ndarray, consts: HashConstants) -> np.ndarray:
    """Row ids ``[T, L, C]`` of T tokens from their N (already padded) values ``[T, N]``.

    ``values[t, k]`` is token t's compressed id at shift k, or the pad id. The
    n-gram of size k + 1 is the xor of ``values[t, j] * multipliers[l, j]`` for
    j <= k (int64, wrapping); head h of it is that hash modulo its prime plus
    the column's offset (SPEC §4).
    """
    values = np.asarray(values, dtype=np.int64).reshape(-1, consts.max_ngram_size)
    heads = consts.n_heads
    out = np.empty((values.shape[0], consts.n_layers, consts.n_cols), dtype=np.int64)
    with np.errstate(over="ignore"):
        for li in range(consts.n_layers):
            rolling = values[:, 0] * consts.multipliers[li, 0]  # [T]
            for k in range(1, consts.max_ngram_size):
                rolling = np.bitwise_xor(rolling, values[:, k] * consts.multipliers[li, k])
                cols = slice((k - 1) * heads, k * heads)  # the heads of the (k+1)-gram
                out[:, li, cols] = (
                    rolling[:, None] % consts.col_primes[li, cols] + consts.offsets[li, cols]
                )
    return out


def hash_sequence(
    compressed_ids: np.ndarray, consts: HashConstants, dead: np.ndarray | None = None
) -> np.ndarray:
    """Row ids ``[T, L, C]`` int64 of one whole sequence (SPEC §4).

    Args:
        compressed_ids: ``[T]`` compressed ids of the sequence from position 0.
        consts: multipliers, primes, offsets and the pad id.
        dead: optional ``[T]`` bool; a dead token (an image span) hashes as
            pad and blocks every n-gram that reaches through it.
    """
    ids = np.asarray(compressed_ids, dtype=np.int64)
    t_len = ids.shape[0]
    dead_mask = np.zeros(t_len, dtype=bool) if dead is None else np.asarray(dead, dtype=bool)
    values = np.empty((t_len, consts.max_ngram_size), dtype=np.int64)
    for p in range(t_len):
        blocked = False
        for k in range(consts.max_ngram_size):
            blocked = blocked or p - k < 0 or bool(dead_mask[p - k])
            values[p, k] = consts.pad_id if blocked else ids[p - k]
    return _hash_values(values, consts)


def hash_batch_reference(
    batch: HashBatch,
    consts: HashConstants,
    token_map: np.ndarray,
    history: SlotHashCache | RequestHistory | None = None,
) -> np.ndarray:
    """Row ids ``[T, L, C]`` int64 of one engine step (SPEC §5).

    History of a token comes, in order of precedence, from the chunk itself,
    ``batch.lookback_token_ids`` (column j = position ``chunk_start - 1 - j``,
    -1 unknown), then the history store (a :class:`SlotHashCache` read through
    ``block_table``, or a :class:`RequestHistory` read through
    ``request_slots``). Unknown history hashes as pad. Tokens after
    ``query_start_loc[-1]`` are padding rows: they hash as a sequence start.

    With a history store, the step's tokens are written to it afterwards,
    exactly as the kernel path does.
    """
    from engramrt.hashing.history import RequestHistory, SlotHashCache

    n = consts.max_ngram_size
    ids = host_array(batch.input_ids)
    positions = host_array(batch.positions)
    qsl = host_array(batch.query_start_loc)
    t_len, n_req = ids.shape[0], qsl.shape[0] - 1
    dead = host_array(batch.dead_mask).astype(bool) if batch.dead_mask is not None else None
    lookback = (
        host_array(batch.lookback_token_ids) if batch.lookback_token_ids is not None else None
    )
    lookback_dead = (
        host_array(batch.lookback_dead).astype(bool) if batch.lookback_dead is not None else None
    )
    block_table = host_array(batch.block_table) if batch.block_table is not None else None
    request_slots = host_array(batch.request_slots) if batch.request_slots is not None else None
    store = (
        host_array(history.slots) if isinstance(history, (SlotHashCache, RequestHistory)) else None
    )
    tags = host_array(history.tags) if isinstance(history, RequestHistory) else None

    vocab = int(token_map.shape[0])

    def compressed(token_id: int) -> int:
        return int(token_map[min(max(token_id, 0), vocab - 1)])  # clamp_token_ids, one id

    def lookup_history(r: int, pos: int) -> tuple[bool, int, bool]:
        """(known, compressed id, dead) of position ``pos`` of request r from the store.

        An entry outside the store is unknown (the kernel masks the same loads).
        """
        if isinstance(history, SlotHashCache):
            assert block_table is not None and store is not None
            bs = history.block_size
            if pos // bs >= block_table.shape[1]:
                return False, 0, False
            block = int(block_table[r, pos // bs])
            if not 0 <= block < history.num_slots // bs:
                return False, 0, False
            code = int(store[block * bs + pos % bs])
        elif isinstance(history, RequestHistory):
            assert request_slots is not None and store is not None and tags is not None
            ring = int(request_slots[r])
            if not 0 <= ring < history.max_requests:
                return False, 0, False
            slot = ring * history.window + pos % history.window
            code = int(store[slot]) if int(tags[slot]) == pos else EMPTY
        else:
            return False, 0, False
        if code == EMPTY:
            return False, 0, False
        return True, max(code, 0), code == DEAD

    values = np.empty((t_len, n), dtype=np.int64)  # [T, N] padded compressed ids
    for i in range(t_len):
        r = int(np.searchsorted(qsl[1:], i, side="right"))  # request owning token i
        padding_row = r >= n_req
        start = i if padding_row else int(qsl[r])
        p = int(positions[i])
        chunk_start_pos = p - (i - start)
        blocked = False
        for k in range(n):
            pos = p - k
            if i - k >= start:  # 1. the chunk itself
                known = True
                value = compressed(int(ids[i - k]))
                is_dead = dead is not None and bool(dead[i - k])
            else:
                known, value, is_dead = False, 0, False
                if padding_row or pos < 0:
                    pass
                else:
                    j = chunk_start_pos - 1 - pos
                    if lookback is not None and j < n - 1 and lookback[r, j] >= 0:  # 2.
                        known = True
                        value = compressed(int(lookback[r, j]))
                        is_dead = lookback_dead is not None and bool(lookback_dead[r, j])
                    else:  # 3. the history store
                        known, value, is_dead = lookup_history(r, pos)
            blocked = blocked or pos < 0 or (padding_row and k > 0) or (known and is_dead)
            values[i, k] = consts.pad_id if blocked or not known else value
    out = _hash_values(values, consts)

    if history is not None:
        history.commit_reference(batch, token_map)
    return out
