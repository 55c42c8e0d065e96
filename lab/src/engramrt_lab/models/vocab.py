"""The trimmed vocabulary: the model's input and output ids.

The model embeds and predicts only the K most frequent tokenizer ids of
the training split plus one ``<other>`` id; the Engram hashing never sees
these ids (it hashes the real DeepSeek-V4 tokenizer ids through the token
map, exactly as a full-size model would).

How the K ids are chosen (:meth:`Vocab.from_counts`): the document-start
token (``<｜begin▁of▁sentence｜>``, id 0) gets trimmed id 0, whatever its
count; then the other tokenizer ids that occur in the training split, by
count descending, ties by tokenizer id ascending, up to K ids in all.
Trimmed id ``i < K`` is ``token_ids[i]``; every other tokenizer id maps to
``other_id = K`` (the K actually kept: fewer when the split has fewer
distinct tokens). ``<other>`` is a prediction target like any id (the loss
counts it), but greedy generation never emits it: it has no text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engramrt.errors import ValidationError

__all__ = ["BOS_TOKEN_ID", "Vocab"]

BOS_TOKEN_ID = 0
"""``<｜begin▁of▁sentence｜>`` of the DeepSeek-V4 tokenizer: starts every document."""


@dataclass(frozen=True)
class Vocab:
    """Tokenizer ids kept by the model, in trimmed-id order.

    Attributes:
        token_ids: ``[K]`` tokenizer ids; trimmed id ``i`` is ``token_ids[i]``.
        tokenizer_vocab_size: ids of the tokenizer (the map's length).
    """

    token_ids: tuple[int, ...]
    tokenizer_vocab_size: int

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValidationError("token_ids=() must hold at least one id")
        if ids.min() < 0 or ids.max() >= self.tokenizer_vocab_size:
            raise ValidationError(
                f"token_ids hold ids outside [0, {self.tokenizer_vocab_size}) (the tokenizer's)"
            )
        if np.unique(ids).size != ids.size:
            raise ValidationError("token_ids holds repeated ids; expected each id once")
        trim = np.full(self.tokenizer_vocab_size, ids.size, dtype=np.int64)
        trim[ids] = np.arange(ids.size)
        trim.setflags(write=False)
        object.__setattr__(self, "_trim", trim)

    @property
    def num_kept(self) -> int:
        """K, the tokenizer ids with an id of their own."""
        return len(self.token_ids)

    @property
    def other_id(self) -> int:
        """The trimmed id of every id not kept (K)."""
        return len(self.token_ids)

    @property
    def size(self) -> int:
        """K + 1: the model's vocabulary."""
        return len(self.token_ids) + 1

    @property
    def trim_map(self) -> np.ndarray:
        """``[tokenizer_vocab_size]`` int64: tokenizer id -> trimmed id."""
        trim: np.ndarray = object.__getattribute__(self, "_trim")
        return trim

    def trim(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Trimmed ids (int64) of tokenizer ids."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.tokenizer_vocab_size):
            raise ValidationError(
                f"token ids outside [0, {self.tokenizer_vocab_size}) cannot be trimmed"
            )
        return self.trim_map[ids]

    def untrim(self, trimmed: Sequence[int] | np.ndarray) -> np.ndarray:
        """Tokenizer ids of trimmed ids < K (``<other>`` has none: refused)."""
        ids = np.asarray(trimmed, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_kept):
            raise ValidationError(
                f"trimmed ids must be in [0, K={self.num_kept}) to have a tokenizer id"
            )
        return np.asarray(self.token_ids, dtype=np.int64)[ids]

    @classmethod
    def from_counts(cls, counts: np.ndarray, k: int) -> Vocab:
        """The trimmed vocabulary of a training split's token ``counts [V]`` (see the
        module docstring for the rule)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValidationError(f"k={k!r} must be a positive integer")
        counts = np.asarray(counts, dtype=np.int64)
        order = np.lexsort((np.arange(counts.size), -counts))  # count desc, id asc
        rest = [int(i) for i in order if counts[i] > 0 and i != BOS_TOKEN_ID][: k - 1]
        return cls((BOS_TOKEN_ID, *rest), int(counts.size))

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "other_id": self.other_id,
            "tokenizer_vocab_size": self.tokenizer_vocab_size,
            "rule": "bos first, then training-split counts descending, ties by id ascending",
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Vocab:
        return cls(tuple(int(i) for i in data["token_ids"]), int(data["tokenizer_vocab_size"]))
