"""Where the memory wins: held-out predictions split by what training saw.

A prediction is the next token at position ``t + 1`` of a held-out
sequence, from the context ending at ``t`` (tokenizer ids, the document's
tokens before the sequence included through its lookback ids). Training
"saw" an n-gram when those n tokens occur consecutively inside one of the
windows the models trained on (every model of a run trains on the same
windows).

Three views, each a partition of the predictions:

- ``longest_seen``: the longest ``n`` in 4, 3, 2 such that the n-gram
  ending at the target (``n - 1`` context tokens and the continuation) was
  seen: ``"4-gram seen"``, ``"3-gram seen, 4-gram not"``, ``"2-gram seen,
  3-gram not"``, ``"bigram unseen"`` (n-grams reaching before the document's
  start count as unseen).
- ``context``: the 3-token context (the n-gram Engram's 4-gram head hashes at
  ``t``): ``"context seen, continuation seen"`` (its 4-gram was seen),
  ``"context seen, continuation new"``, ``"context unseen"``.
- ``file``: the held-out file a prediction's sequence was cut from
  (:func:`file_masks`): a set's mean over a few files can hang on one of
  them, and this view shows which.

:func:`category_masks` gives the masks; :func:`category_losses` the count,
share and each model's mean loss per category and, beside them, each Engram
model's mean gate per category and Engram block (:func:`gate_column`): the
gate of the position a prediction is made from (averaged over the ``hc``
streams), which read the rows of that prediction's context. The gate cannot
see the target, so the ``context`` view is the one it can answer to; in
``longest_seen`` the seen n-gram includes the target.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from engramrt.errors import ValidationError

__all__ = [
    "category_losses",
    "category_masks",
    "file_masks",
    "gate_column",
    "gate_column_parts",
    "ngram_keys",
    "training_ngrams",
]

_MULT = np.uint64(0x9E3779B97F4A7C15)


def ngram_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """64-bit keys of every n-gram along the last axis of ``tokens [..., L]`` (int64,
    negative = no token): ``[..., L - n + 1]`` uint64; an n-gram holding a negative
    id gets key 0. Keys are a polynomial in ``id + 1`` with an odd 64-bit multiplier
    (distinct n-grams collide, or reach 0, with probability about 2^-64 per pair)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    length = tokens.shape[-1]
    if length < n:
        return np.zeros((*tokens.shape[:-1], 0), dtype=np.uint64)
    key = np.zeros((*tokens.shape[:-1], length - n + 1), dtype=np.uint64)
    missing = np.zeros(key.shape, dtype=bool)
    with np.errstate(over="ignore"):
        for i in range(n):
            part = tokens[..., i : length - n + 1 + i]
            missing |= part < 0
            key = key * _MULT + (part.astype(np.uint64) + np.uint64(1))
        key = key * _MULT
    key[missing] = 0
    return key


def training_ngrams(
    windows: np.ndarray, orders: tuple[int, ...] = (2, 3, 4)
) -> dict[int, np.ndarray]:
    """Sorted distinct keys of every n-gram inside the training windows ``[W, S+1]``."""
    return {n: np.unique(ngram_keys(windows, n).reshape(-1)) for n in orders}


def _member(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    if table.size == 0:
        return np.zeros(keys.shape, dtype=bool)
    at = np.searchsorted(table, keys).clip(max=table.size - 1)
    return (table[at] == keys) & (keys != 0)


def category_masks(
    tokens: np.ndarray,
    lengths: np.ndarray,
    lookback: np.ndarray,
    seen: Mapping[int, np.ndarray],
) -> dict[str, dict[str, np.ndarray]]:
    """Masks ``[M, S-1]`` (prediction ``j`` targets token ``j + 1``) per view and category.

    ``tokens [M, S]``, ``lengths [M]`` and ``lookback [M, 3]`` as in
    :class:`~engramrt_lab.models.corpus.EvalSegments` (tokenizer ids); ``seen``
    from :func:`training_ngrams`. Invalid predictions are in no category.
    """
    seq = tokens.shape[1]
    back = lookback.shape[1]
    ext = np.concatenate([lookback[:, ::-1], tokens], axis=1)  # oldest first
    valid = np.arange(1, seq)[None, :] < lengths[:, None]
    hits = {}
    for n in (2, 3, 4):
        # the n-gram ending at the target j + 1 (ext index j + 1 + back) starts at
        # ext index j + 1 + back - (n - 1)
        keys = ngram_keys(ext, n)  # key at ext start index i
        first = 1 + back - (n - 1)
        hits[n] = _member(keys[:, first : first + seq - 1], seen[n])
    context_keys = ngram_keys(ext, 3)  # the 3 tokens ending at j: ext start j + back - 2
    context = _member(context_keys[:, back - 2 : back - 2 + seq - 1], seen[3])
    longest = {
        "4-gram seen": hits[4],
        "3-gram seen, 4-gram not": hits[3] & ~hits[4],
        "2-gram seen, 3-gram not": hits[2] & ~hits[3] & ~hits[4],
        "bigram unseen": ~hits[2] & ~hits[3] & ~hits[4],
    }
    views = {
        "longest_seen": longest,
        "context": {
            "context seen, continuation seen": context & hits[4],
            "context seen, continuation new": context & ~hits[4],
            "context unseen": ~context,
        },
    }
    return {
        view: {name: mask & valid for name, mask in cats.items()} for view, cats in views.items()
    }


def file_masks(
    width: int,
    lengths: np.ndarray,
    starts: np.ndarray,
    doc_starts: np.ndarray,
    files: Sequence[str],
) -> dict[str, np.ndarray]:
    """The ``file`` view: masks ``[M, S-1]`` of each file's valid predictions, in the
    order of ``files`` (files no sequence comes from are left out).

    ``width`` is ``S``, the sequences' padded length; ``lengths [M]`` and ``starts [M]`` as in
    :class:`~engramrt_lab.models.corpus.EvalSegments`, ``doc_starts [D+1]`` and
    ``files [D]`` as in :class:`~engramrt_lab.models.corpus.Split` (the split the
    sequences were cut from): sequence ``i`` lies inside the document that holds
    token ``starts[i]``.
    """
    lengths = np.asarray(lengths)
    starts = np.asarray(starts)
    doc_starts = np.asarray(doc_starts)
    if doc_starts.shape != (len(files) + 1,):
        raise ValidationError(
            f"doc_starts has shape {doc_starts.shape}; expected ({len(files) + 1},), one "
            f"offset per file and the end"
        )
    if starts.size and (starts.min() < 0 or starts.max() >= doc_starts[-1]):
        raise ValidationError(
            f"starts holds offsets in [{starts.min()}, {starts.max()}]; expected offsets in "
            f"[0, {doc_starts[-1]}), the split's tokens"
        )
    doc = np.searchsorted(doc_starts, starts, side="right") - 1
    valid = np.arange(1, width)[None, :] < lengths[:, None]
    return {files[d]: valid & (doc == d)[:, None] for d in np.unique(doc)}


def gate_column(model: str, block: int) -> str:
    """The key of ``model``'s mean gate at Engram block ``block`` in a category row."""
    return f"{model} gate (block {block})"


_GATE_COLUMN = re.compile(r"(.+) gate \(block (\d+)\)")


def gate_column_parts(column: str) -> tuple[str, int] | None:
    """The model and block of a :func:`gate_column` key; None for any other key (a
    model's loss, ``predictions``, ``share``)."""
    match = _GATE_COLUMN.fullmatch(column)
    return None if match is None else (match.group(1), int(match.group(2)))


def category_losses(
    masks: Mapping[str, Mapping[str, np.ndarray]],
    losses: Mapping[str, np.ndarray],
    gates: Mapping[str, Mapping[int, np.ndarray]] | None = None,
) -> dict[str, dict[str, dict[str, float | int | None]]]:
    """Per view and category: ``predictions``, ``share``, each model's mean loss and
    each Engram model's mean gate per block (key :func:`gate_column`).

    ``losses[model]`` is ``[M, S-1]`` per prediction, NaN where invalid;
    ``gates[model][block]`` the same shape, the gate of the prediction's
    position averaged over the streams (``token_losses_and_gates`` of
    :mod:`engramrt_lab.models.train`). Every mean is over the same masked
    predictions, so its count is the row's ``predictions``: a NaN inside a
    category (a value missing for a valid prediction) is an error.
    """
    columns = dict(losses)
    for model, blocks in (gates or {}).items():
        for block, values in blocks.items():
            columns[gate_column(model, block)] = values
    out: dict[str, dict[str, dict[str, float | int | None]]] = {}
    for view, cats in masks.items():
        total = sum(int(m.sum()) for m in cats.values())
        out[view] = {}
        for name, mask in cats.items():
            n = int(mask.sum())
            row: dict[str, float | int | None] = {
                "predictions": n,
                "share": round(n / total, 4) if total else 0.0,
            }
            for column, values in columns.items():
                if values.shape != mask.shape:
                    raise ValidationError(
                        f"{column!r} has shape {values.shape}; expected the masks' {mask.shape}"
                    )
                chosen = values[mask]
                missing = int(np.isnan(chosen).sum())
                if missing:
                    raise ValidationError(
                        f"{column!r} is NaN at {missing} of the {n} predictions of {view} / "
                        f"{name!r}; expected a value at every valid prediction"
                    )
                row[column] = round(float(chosen.mean()), 4) if n else None
            out[view][name] = row
    return out
