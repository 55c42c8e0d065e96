"""Row ids with vectorized torch ops: the eager baseline the kernel is measured against.

Same contract as the reference for batches whose history comes from the
chunk and ``lookback_token_ids`` (no history store). About 15 small ops per
shift and layer, each a kernel launch on a GPU.
"""

from __future__ import annotations

import torch

from engramrt.hashing.types import HashBatch, HashConstants

__all__ = ["hash_batch_torch"]


def hash_batch_torch(
    batch: HashBatch,
    consts: HashConstants,
    token_map: torch.Tensor,
    out_dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """``[T, L, C]`` row ids of a stateless batch (lookback ids only), in torch ops."""
    device = batch.input_ids.device
    n = consts.max_ngram_size
    t_len = batch.num_tokens
    token_map = token_map.to(device=device, dtype=torch.int64)
    mult = torch.as_tensor(consts.multipliers, device=device)  # [L, N]
    primes = torch.as_tensor(consts.col_primes, device=device)  # [L, C]
    offsets = torch.as_tensor(consts.offsets, device=device)  # [L, C]
    ids = batch.input_ids.to(torch.int64)
    positions = batch.positions.to(torch.int64)
    qsl = batch.query_start_loc.to(torch.int64)
    n_req = qsl.shape[0] - 1
    idx = torch.arange(t_len, device=device)
    req = torch.searchsorted(qsl[1:].contiguous(), idx, right=True)  # [T]; == R: padding row
    padding_row = req >= n_req
    req_safe = torch.where(padding_row, torch.zeros_like(req), req)
    start = torch.where(padding_row, idx, qsl[req_safe])
    chunk_start_pos = positions - (idx - start)
    dead = batch.dead_mask.to(torch.bool) if batch.dead_mask is not None else None

    blocked = torch.zeros(t_len, dtype=torch.bool, device=device)
    rolling = torch.zeros(t_len, consts.n_layers, dtype=torch.int64, device=device)
    out = torch.empty(t_len, consts.n_layers, consts.n_cols, dtype=out_dtype, device=device)
    h = consts.n_heads
    for k in range(n):
        src = idx - k
        in_chunk = src >= start
        value = token_map[ids[src.clamp(min=0)]]
        known = in_chunk.clone()
        is_dead = dead[src.clamp(min=0)] & in_chunk if dead is not None else torch.zeros_like(known)
        if k > 0:
            pos = positions - k
            outside = ~in_chunk & ~padding_row & (pos >= 0)
            if batch.lookback_token_ids is not None:
                j = (chunk_start_pos - 1 - pos).clamp(0, n - 2)
                lb = batch.lookback_token_ids.to(torch.int64)[req_safe, j]
                lb_known = outside & (chunk_start_pos - 1 - pos < n - 1) & (lb >= 0)
                value = torch.where(lb_known, token_map[lb.clamp(min=0)], value)
                if batch.lookback_dead is not None:
                    lb_dead = batch.lookback_dead.to(torch.bool)[req_safe, j]
                    is_dead = torch.where(lb_known, lb_dead, is_dead)
                known = known | lb_known
            blocked = blocked | (pos < 0) | padding_row
        blocked = blocked | (known & is_dead)
        value = torch.where(blocked | ~known, torch.full_like(value, consts.pad_id), value)
        rolling = rolling ^ (value[:, None] * mult[None, :, k])
        if k > 0:
            cols = slice((k - 1) * h, k * h)
            row = rolling[:, :, None] % primes[None, :, cols] + offsets[None, :, cols]
            out[:, :, cols] = row.to(out_dtype)
    return out
