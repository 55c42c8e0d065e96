"""Benchmark cases for n-gram hashing at DeepSeek-V4.1-Flash layout."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engramrt.bench.registry import Case, register


def _setup(device: torch.device, n_req: int, tokens_per_req: int, seed: int) -> dict[str, Any]:
    from engramrt.config import PRESETS
    from engramrt.hashing import HashBatch, HashConstants, NgramHasher
    from engramrt.tokenmap import TokenMap

    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_config(PRESETS["dsv41-flash"], token_map)
    rng = np.random.default_rng(seed)
    t_len = n_req * tokens_per_req
    starts = rng.integers(0, 4000, size=n_req)
    positions = (starts[:, None] + np.arange(tokens_per_req)[None, :]).reshape(-1)
    lookback = rng.integers(0, token_map.vocab_size, size=(n_req, 3))
    batch = HashBatch(
        input_ids=torch.tensor(rng.integers(0, token_map.vocab_size, size=t_len), device=device),
        positions=torch.tensor(positions, device=device),
        query_start_loc=torch.tensor(
            np.arange(n_req + 1) * tokens_per_req, dtype=torch.int32, device=device
        ),
        dead_mask=torch.tensor(rng.random(t_len) < 0.01, device=device),
        lookback_token_ids=torch.tensor(lookback, device=device),
    )
    hasher = NgramHasher(consts, token_map, device, backend="triton", validate=False)
    out = torch.empty((t_len, 2, 24), dtype=torch.int32, device=device)
    return {
        "batch": batch,
        "consts": consts,
        "token_map": token_map,
        "token_map_dev": torch.as_tensor(token_map.map, device=device),
        "hasher": hasher,
        "out": out,
    }


def _check(inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
    from engramrt.hashing import HashBatch, hash_batch_reference

    kernel = outputs["triton"].to(torch.int64)
    torch_eager = outputs["torch-eager"].to(torch.int64)
    if not torch.equal(kernel, torch_eager):
        bad = (kernel != torch_eager).nonzero()[:5].tolist()
        raise AssertionError(f"kernel and torch baseline differ at {bad}")
    # The numpy reference on a slice of whole requests (it is slow).
    batch: HashBatch = inputs["batch"]
    qsl = batch.query_start_loc.cpu()
    per_request = int(qsl[1] - qsl[0])
    n_req = min(batch.num_requests, max(1, 2048 // max(per_request, 1)))
    end = int(qsl[n_req])
    sub = HashBatch(
        input_ids=batch.input_ids[:end].cpu(),
        positions=batch.positions[:end].cpu(),
        query_start_loc=qsl[: n_req + 1],
        dead_mask=batch.dead_mask[:end].cpu() if batch.dead_mask is not None else None,
        lookback_token_ids=batch.lookback_token_ids[:n_req].cpu()
        if batch.lookback_token_ids is not None
        else None,
    )
    want = hash_batch_reference(sub, inputs["consts"], inputs["token_map"].map)
    got = kernel[:end].cpu().numpy()
    if not np.array_equal(got, want):
        raise AssertionError(
            f"kernel and numpy reference differ at {np.argwhere(got != want)[:5].tolist()}"
        )


@register
def hash_cases(quick: bool) -> list[Case]:
    from engramrt.hashing.vectorized import hash_batch_torch

    shapes = [("decode", 256, 1), ("prefill", 1, 8192), ("prefill", 8, 8192)]
    if quick:
        shapes = shapes[:2]
    cases = []
    impls: dict[str, Callable[[dict[str, Any]], Any]] = {
        "triton": lambda s: s["hasher"](s["batch"], out=s["out"]),
        "torch-eager": lambda s: hash_batch_torch(s["batch"], s["consts"], s["token_map_dev"]),
    }
    for kind, n_req, per in shapes:
        t_len = n_req * per
        cases.append(
            Case(
                name=f"hash/{kind} {n_req}x{per}",
                group="hash",
                params={
                    "requests": n_req,
                    "tokens_per_request": per,
                    "T": t_len,
                    "layout": "dsv41-flash",
                },
                make=functools.partial(
                    _setup, n_req=n_req, tokens_per_req=per, seed=n_req * 7 + per
                ),
                impls=impls,
                baseline="torch-eager",
                check=_check,
                # ids, positions read (8 B each), row ids written (2 layers x 24 x 4 B)
                bytes_moved=t_len * (8 + 8 + 1 + 2 * 24 * 4),
                items=t_len,
                item_name="tokens",
                graph=True,
                graph_impls=("triton",),
            )
        )
    return cases
