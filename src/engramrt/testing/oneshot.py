"""Expected row ids: each request's sequence hashed in one shot (SPEC §4), vectorised.

The simulator compares every streamed step with these rows, which neither the
adapters nor the hasher computed: numpy array ops over all wanted rows at
once (a Python loop per token would cost a soak most of its time).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engramrt.hashing import HashConstants

__all__ = ["one_shot_rows"]


def one_shot_rows(
    sequences: Sequence[tuple[np.ndarray, np.ndarray, int, int]], consts: HashConstants
) -> np.ndarray:
    """Rows ``start..end-1`` of hashing each whole sequence at once, concatenated.

    Each entry is ``(compressed_ids [S], dead [S], start, end)`` with
    ``end <= S``; the result is ``[sum(end - start), L, C]`` int64, equal to
    ``concatenate([hash_sequence(ids[:end], consts, dead[:end])[start:end] ...])``
    (SPEC §4; a row depends only on its own and earlier positions), computed
    with numpy array ops over every requested row at once instead of a
    Python loop per token.
    """
    n, h = consts.max_ngram_size, consts.n_heads
    n_layers, n_cols = consts.n_layers, consts.n_cols
    lengths = [end - start for _, _, start, end in sequences]
    total = int(sum(lengths))
    out = np.empty((total, n_layers, n_cols), dtype=np.int64)
    if total == 0:
        return out
    flat = np.concatenate([np.asarray(ids[:end], np.int64) for ids, _, _, end in sequences])
    flat_dead = np.concatenate([np.asarray(dead[:end], bool) for _, dead, _, end in sequences])
    bases = np.cumsum([0] + [end for _, _, _, end in sequences[:-1]])
    index = np.concatenate(
        [
            base + np.arange(start, end)
            for base, (_, _, start, end) in zip(bases, sequences, strict=True)
        ]
    )  # [M] flat index of each wanted row
    positions = np.concatenate([np.arange(start, end) for _, _, start, end in sequences])
    mult = np.asarray(consts.multipliers, np.int64)  # [L, N]
    primes = np.asarray(consts.col_primes, np.int64)  # [L, C]
    offsets = np.asarray(consts.offsets, np.int64)  # [L, C]
    blocked = np.zeros(total, dtype=bool)
    rolling = np.zeros((total, n_layers), dtype=np.int64)
    with np.errstate(over="ignore"):
        for k in range(n):
            src = np.maximum(index - k, 0)
            blocked |= (positions - k < 0) | flat_dead[src]
            value = np.where(blocked, consts.pad_id, flat[src])  # [M]
            rolling ^= value[:, None] * mult[None, :, k]
            if k == 0:
                continue
            cols = slice((k - 1) * h, k * h)
            out[:, :, cols] = rolling[:, :, None] % primes[None, :, cols] + offsets[None, :, cols]
    return out
