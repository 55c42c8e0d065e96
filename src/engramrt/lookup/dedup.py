"""Sorted unique row ids with their inverse, without a host synchronisation.

``torch.unique(ids, sorted=True, return_inverse=True)`` on a GPU waits for
the device once to size its result, and the host tiers then wait a second
time to bring the unique ids over. :func:`sorted_unique` instead returns the
unique ids in a buffer as long as the input (the first ``count`` entries
valid) plus ``count`` as a one-element device tensor, so one copy of both to
the host and one wait suffice. Results equal ``torch.unique``'s.
"""

from __future__ import annotations

import torch

__all__ = ["sorted_unique"]


def sorted_unique(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort and deduplicate ``ids`` on their device, queueing work only.

    Args:
        ids: ``[n]`` integer ids, ``n >= 1``.

    Returns:
        ``(unique, inverse, count)``: ``unique [n]`` of ``ids``' dtype whose
        first ``count`` entries are the distinct ids in ascending order (the
        rest unspecified); ``inverse [n]`` int32 with
        ``unique[inverse[i]] == ids[i]``; ``count [1]`` int32.
    """
    n = ids.shape[0]
    keys, order = torch.sort(ids)
    starts = torch.empty(n, dtype=torch.bool, device=ids.device)
    starts[:1] = True
    torch.ne(keys[1:], keys[:-1], out=starts[1:])
    position = torch.cumsum(starts, 0)  # int64, 1-based rank of each sorted id
    position -= 1
    inverse = torch.empty(n, dtype=torch.int32, device=ids.device)
    inverse[order] = position.to(torch.int32)
    unique = torch.empty_like(keys)
    # Equal keys write equal values to the same slot, so the scatter is
    # deterministic in its result whatever order the writes land in.
    unique[position] = keys
    count = (position[-1:] + 1).to(torch.int32)
    return unique, inverse, count
