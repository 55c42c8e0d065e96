"""Inputs of the hashing step: the engine's batch and the hash constants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engramrt.step import EngineStep

if TYPE_CHECKING:
    from engramrt.config import EngramConfig
    from engramrt.layout import EngramLayout
    from engramrt.tokenmap import TokenMap

__all__ = ["DEAD", "EMPTY", "HashBatch", "HashConstants", "clamp_token_ids", "host_array"]

HashBatch = EngineStep
"""The engine step's older name (:class:`engramrt.step.EngineStep`, the same class)."""

# Codes a history store holds besides compressed ids (which are >= 0).
EMPTY = -1  # nothing known about this position: hashes as pad
DEAD = -2  # a dead token (image span): blocks n-grams through it


def host_array(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a tensor (copied to the host if it lives on a device) or an array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


@dataclass(frozen=True)
class HashConstants:
    """What hashing needs from the layout and token map, as int64 arrays.

    Attributes:
        multipliers: ``[L, N]``; col_primes, offsets: ``[L, C]``.
        pad_id: compressed pad id (``token_map[engram_pad_token_id]``).
        n_heads: H (columns of order n are ``(n-2)*H .. (n-1)*H - 1``).
    """

    multipliers: np.ndarray
    col_primes: np.ndarray
    offsets: np.ndarray
    pad_id: int
    n_heads: int

    @property
    def n_layers(self) -> int:
        return int(self.multipliers.shape[0])

    @property
    def max_ngram_size(self) -> int:
        return int(self.multipliers.shape[1])

    @property
    def n_cols(self) -> int:
        return int(self.col_primes.shape[1])

    @property
    def max_row_id(self) -> int:
        return int((self.offsets + self.col_primes - 1).max())

    @classmethod
    def from_layout(cls, layout: EngramLayout, pad_id: int) -> HashConstants:
        return cls(
            multipliers=np.array(layout.multipliers, dtype=np.int64),
            col_primes=np.array(layout.col_primes, dtype=np.int64),
            offsets=np.array(layout.offsets, dtype=np.int64),
            pad_id=int(pad_id),
            n_heads=layout.n_heads,
        )

    @classmethod
    def from_config(
        cls, config: EngramConfig, token_map: TokenMap, seed: int | None = None
    ) -> HashConstants:
        from engramrt.layout import EngramLayout

        return cls.from_layout(EngramLayout(config, seed), token_map.pad_id(config))

    def packed(self, device: torch.device | str) -> torch.Tensor:
        """``[L, N + 2C]`` int64 on ``device``: multipliers | primes | offsets per layer.

        One tensor so the kernel takes one pointer for all constants.
        """
        packed = np.concatenate([self.multipliers, self.col_primes, self.offsets], axis=1)
        return torch.as_tensor(np.ascontiguousarray(packed), device=device)


def clamp_token_ids(ids: np.ndarray | int, vocab_size: int) -> np.ndarray:
    """Token ids clamped into ``[0, vocab_size)``: the rule for ids outside the vocabulary.

    Both backends read the token map at ``min(max(id, 0), V - 1)``, so an
    unchecked id never reads outside the map (``check_ids`` refuses such ids
    instead, naming them).
    """
    return np.clip(np.asarray(ids, dtype=np.int64), 0, vocab_size - 1)
