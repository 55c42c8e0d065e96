"""A small runtime over random tables and heads, for replays, demos and examples."""

from __future__ import annotations

from typing import Any

import torch

from engramrt.config import EngramConfig
from engramrt.hashing import NgramHasher
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout

__all__ = ["random_heads", "synthetic_runtime"]


def random_heads(
    config: EngramConfig, device: torch.device | str, *, seed: int = 0, backend: str = "auto"
) -> list[EngramHead]:
    """One :class:`EngramHead` per Engram layer with random bf16 weights (``wkv`` scaled by
    ``1/sqrt(C*E)`` so kv stays O(1); norm weights near 1); ``backend``: the gate's."""
    gen = torch.Generator().manual_seed(seed)
    hc, dim, width = config.hc_mult, config.hidden_size, config.n_cols * config.head_dim
    heads = []
    for _ in range(config.n_layers):
        head = EngramHead(config, device=device, backend=backend)
        head.load_weights(
            wkv=(torch.randn((hc + 1) * dim, width, generator=gen) / width**0.5).bfloat16(),
            q_weight=(1 + 0.1 * torch.randn(hc, dim, generator=gen)).bfloat16(),
            k_weight=(1 + 0.1 * torch.randn(hc, dim, generator=gen)).bfloat16(),
        )
        heads.append(head)
    return heads


def synthetic_runtime(
    config: EngramConfig,
    hasher: NgramHasher,
    history: Any,
    *,
    max_tokens: int,
    max_requests: int,
    tier: str = "device",
    seed: int = 0,
    head_backend: str = "auto",
) -> Any:
    """An :class:`~engramrt.runtime.EngramRuntime` over random tables of ``tier``
    (:func:`~engramrt.runtime.synthetic_stores`) and :func:`random_heads`, hashing with
    ``hasher`` into ``history`` (``head_backend``: the heads' gate backend)."""
    from engramrt.lookup.tiers import TablePlacement
    from engramrt.runtime import EngramRuntime, synthetic_stores

    placement = TablePlacement(tier, device=hasher.device)
    stores = synthetic_stores(EngramLayout(config), placement, seed=seed)
    return EngramRuntime(
        hasher,
        stores,
        heads=random_heads(config, hasher.device, seed=seed, backend=head_backend),
        max_tokens=max_tokens,
        max_requests=max_requests,
        history=history,
    )
