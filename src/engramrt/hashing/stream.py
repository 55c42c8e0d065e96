"""Feed one sequence through the streaming path in chunks, as an engine would.

Used by ``engramrt hash`` and the demo: each chunk is one engine step whose
history comes from lookback ids, a slot cache or a request history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engramrt.errors import ValidationError
from engramrt.hashing.history import RequestHistory, SlotHashCache
from engramrt.hashing.ops import NgramHasher
from engramrt.hashing.types import HashBatch

__all__ = ["HISTORY_MODES", "split_chunks", "stream_sequence"]

HISTORY_MODES = ("lookback", "slot", "request")


def split_chunks(total: int, chunks: Sequence[int] | None) -> list[int]:
    """Chunk sizes covering ``total`` tokens; a shorter list gets one last chunk for the rest."""
    if not chunks:
        return [total] if total else []
    sizes = [int(c) for c in chunks]
    if any(c <= 0 for c in sizes):
        raise ValidationError(f"chunks={sizes} must all be positive")
    if sum(sizes) > total:
        raise ValidationError(
            f"chunks={sizes} add up to {sum(sizes)}, more than the {total} tokens"
        )
    if sum(sizes) < total:
        sizes.append(total - sum(sizes))
    return sizes


def stream_sequence(
    hasher: NgramHasher,
    token_ids: np.ndarray,
    chunks: Sequence[int] | None = None,
    *,
    history: str = "lookback",
    dead: np.ndarray | None = None,
    block_size: int = 16,
) -> np.ndarray:
    """Row ids ``[T, L, C]`` int64 of ``token_ids`` hashed chunk by chunk."""
    if history not in HISTORY_MODES:
        raise ValidationError(f"history={history!r} is not one of {', '.join(HISTORY_MODES)}")
    ids = np.asarray(token_ids, dtype=np.int64)
    dead_mask = np.zeros(ids.shape[0], dtype=bool) if dead is None else np.asarray(dead, dtype=bool)
    n = hasher.consts.max_ngram_size
    device = hasher.device
    num_blocks = max(1, -(-ids.shape[0] // block_size))
    store: SlotHashCache | RequestHistory | None = None
    if history == "slot":
        store = SlotHashCache(num_blocks * block_size, block_size, device)
    elif history == "request":
        store = RequestHistory(1, n, device=device)
    results = []
    start = 0
    for size in split_chunks(ids.shape[0], chunks):
        end = start + size
        batch = HashBatch.single(ids[start:end], start=start, device=device)
        batch.dead_mask = torch.as_tensor(dead_mask[start:end], device=device)
        if history == "lookback":
            lookback = [ids[start - 1 - j] if start - 1 - j >= 0 else -1 for j in range(n - 1)]
            lb_dead = [
                bool(dead_mask[start - 1 - j]) if start - 1 - j >= 0 else False
                for j in range(n - 1)
            ]
            batch.lookback_token_ids = torch.tensor([lookback], dtype=torch.int64, device=device)
            batch.lookback_dead = torch.tensor([lb_dead], dtype=torch.bool, device=device)
        elif history == "slot":
            batch.slot_mapping = torch.arange(start, end, dtype=torch.int64, device=device)
            batch.block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
        else:
            batch.request_slots = torch.zeros(1, dtype=torch.int32, device=device)
        results.append(hasher(batch, store).to(torch.int64).cpu().numpy())
        start = end
    if not results:
        return np.zeros((0, hasher.consts.n_layers, hasher.consts.n_cols), dtype=np.int64)
    return np.concatenate(results)
