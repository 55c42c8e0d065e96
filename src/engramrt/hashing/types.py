"""Inputs of the hashing step: the engine's batch and the hash constants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engramrt.config import EngramConfig
    from engramrt.layout import EngramLayout
    from engramrt.tokenmap import TokenMap

__all__ = ["DEAD", "EMPTY", "HashBatch", "HashConstants", "clamp_token_ids", "host_array"]

# Codes a history store holds besides compressed ids (which are >= 0).
EMPTY = -1  # nothing known about this position: hashes as pad
DEAD = -2  # a dead token (image span): blocks n-grams through it


def host_array(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a tensor (copied to the host if it lives on a device) or an array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


@dataclass
class HashBatch:
    """One engine step, flattened and ragged (SPEC §5). All tensors on one device.

    Attributes:
        input_ids: ``[T]`` tokenizer ids (int32/int64). Rows after
            ``query_start_loc[-1]`` are padding (e.g. CUDA-graph padding).
        positions: ``[T]`` position of each token in its request; a
            request's chunk holds consecutive positions.
        query_start_loc: ``[R+1]`` request r owns tokens
            ``qsl[r] .. qsl[r+1]-1``; padded requests repeat the last boundary.
        dead_mask: optional ``[T]`` bool, True for dead tokens (image spans).
        lookback_token_ids: optional ``[R, N-1]`` tokenizer ids; column j is
            the token at position ``chunk_start - 1 - j``, -1 where unknown.
        lookback_dead: optional ``[R, N-1]`` bool dead mask of the lookback ids.
        slot_mapping: ``[T]`` KV slot of each token (-1: none), for a
            :class:`SlotHashCache`.
        block_table: ``[R, max_blocks]`` KV blocks of each request, for a
            :class:`SlotHashCache`.
        request_slots: ``[R]`` row of each request in a :class:`RequestHistory`.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    dead_mask: torch.Tensor | None = None
    lookback_token_ids: torch.Tensor | None = None
    lookback_dead: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    request_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.query_start_loc.shape[0]) - 1

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> HashBatch:
        """The same batch with every tensor on ``device``."""
        moved = {k: v.to(device) if v is not None else None for k, v in vars(self).items()}
        return HashBatch(**moved)  # type: ignore[arg-type]

    @classmethod
    def single(
        cls, token_ids: np.ndarray | list[int], start: int = 0, device: str | torch.device = "cpu"
    ) -> HashBatch:
        """A batch of one request: ``token_ids`` at positions ``start, start+1, ...``."""
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=device)
        t_len = int(ids.shape[0])
        return cls(
            input_ids=ids,
            positions=torch.arange(start, start + t_len, device=device, dtype=torch.int64),
            query_start_loc=torch.tensor([0, t_len], device=device, dtype=torch.int32),
        )


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
