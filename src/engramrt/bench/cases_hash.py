"""Benchmark cases for n-gram hashing at DeepSeek-V4.1-Flash layout."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engramrt.bench.registry import Case, Tuning, register

if TYPE_CHECKING:
    from engramrt.hashing.config import HashKernelConfig


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

    torch_eager = outputs["torch-eager"].to(torch.int64)
    for name, output in outputs.items():
        got_all = output.to(torch.int64)
        if not torch.equal(got_all, torch_eager):
            bad = (got_all != torch_eager).nonzero()[:5].tolist()
            raise AssertionError(f"{name} and the torch baseline differ at {bad}")
    kernel = outputs["triton"].to(torch.int64)
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


# Launch settings swept by the "hash/sweep ..." cases, as (block_t, num_warps,
# scan_tile, fast_mod, speculate_decode) of HashKernelConfig; scan_tile=0 is
# the binary request search. One GPU run of `engramrt bench --group hash`
# compares them by the graph cold time (one call per CUDA graph, L2 flushed)
# and the eager wall time; with --write-config DIR the fastest by graph cold
# time at each shape becomes the entry for its token-count bucket
# (SWEEP_BUCKETS) in DIR/ngram_hash.<device>.json.
SWEEP: tuple[tuple[int, int, int, bool, bool], ...] = (
    (8, 1, 8192, True, True),
    (16, 1, 8192, True, True),
    (16, 2, 8192, True, True),
    (16, 4, 8192, True, True),
    (32, 1, 8192, True, True),
    (32, 2, 8192, True, True),
    (32, 4, 8192, True, True),
    (64, 2, 16384, True, True),
    (64, 4, 16384, True, True),
    (128, 4, 16384, True, True),
    (128, 8, 32768, True, True),
    (256, 8, 32768, True, True),
    (16, 2, 0, True, True),
    (64, 4, 0, True, True),
    (16, 2, 8192, False, True),
    (64, 4, 8192, False, True),
    (128, 4, 16384, False, True),
    (16, 2, 8192, True, False),
    (64, 4, 8192, True, False),
    (64, 4, 0, False, False),  # the earlier kernel's search, remainder and load order
)


SWEEP_BUCKETS: dict[int, dict[str, Any]] = {
    256: {"num_tokens": {"max": 1024}},
    8192: {"num_tokens": {"max": 16384}},
    65536: {},
}
"""The token-count bucket each swept batch size stands for in the tuned file: decode
sizes, one long prefill chunk, and every larger batch."""


def _sweep_config(
    block_t: int, num_warps: int, scan_tile: int, fast_mod: bool, speculate: bool
) -> HashKernelConfig:
    from engramrt.hashing.config import HashKernelConfig

    return HashKernelConfig(
        block_t=block_t,
        num_warps=num_warps,
        scan_tile=scan_tile,
        fast_mod=fast_mod,
        speculate_decode=speculate,
    )


def _sweep_name(
    block_t: int, num_warps: int, scan_tile: int, fast_mod: bool, speculate: bool
) -> str:
    scan = f"-scan{scan_tile}" if scan_tile else "-bsearch"
    mod = "" if fast_mod else "-intmod"
    spec = "" if speculate else "-nospec"
    return f"bt{block_t}w{num_warps}{scan}{mod}{spec}"


def _with_sweep(device: torch.device, **kwargs: Any) -> dict[str, Any]:
    from engramrt.hashing import NgramHasher

    inputs = _setup(device, **kwargs)
    for settings in SWEEP:
        config = _sweep_config(*settings)
        inputs[_sweep_name(*settings)] = NgramHasher(
            inputs["consts"],
            inputs["token_map"],
            device,
            backend="triton",
            validate=False,
            kernel_config=config,
        )
    return inputs


def _sweep_impl(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s[name](s["batch"], out=s["out"])


@register
def hash_cases(quick: bool) -> list[Case]:
    from engramrt.hashing.vectorized import hash_batch_torch

    shapes = [("decode", 256, 1), ("prefill", 1, 8192), ("prefill", 8, 8192)]
    if quick:
        shapes = shapes[:2]
    impls: dict[str, Callable[[dict[str, Any]], Any]] = {
        "triton": lambda s: s["hasher"](s["batch"], out=s["out"]),
        "torch-eager": lambda s: hash_batch_torch(s["batch"], s["consts"], s["token_map_dev"]),
    }

    def case(
        prefix: str,
        shape: tuple[str, int, int],
        setup: Callable[..., dict[str, Any]],
        case_impls: dict[str, Callable[[dict[str, Any]], Any]],
        tuning: Tuning | None = None,
        **extra: str,
    ) -> Case:
        kind, n_req, per = shape
        t_len = n_req * per
        return Case(
            name=f"{prefix}{kind} {n_req}x{per}",
            params={
                "requests": n_req,
                "tokens_per_request": per,
                "T": t_len,
                "layout": "dsv41-flash",
                **extra,
            },
            make=functools.partial(setup, n_req=n_req, tokens_per_req=per, seed=n_req * 7 + per),
            impls=case_impls,
            check=_check,
            # ids, positions read (8 B each), row ids written (2 layers x 24 x 4 B)
            bytes_moved=t_len * (8 + 8 + 1 + 2 * 24 * 4),
            items=t_len,
            item_name="tokens",
            graph=True,
            tuning=tuning,
        )

    cases = [case("hash/", shape, _setup, impls) for shape in shapes]
    if quick:
        return cases
    sweep_impls = dict(impls)
    for settings in SWEEP:
        sweep_impls[_sweep_name(*settings)] = _sweep_impl(_sweep_name(*settings))
    sweep = (
        "HashKernelConfig: bt<block_t>w<num_warps>, -scan<scan_tile> or -bsearch, -intmod: "
        "fast_mod off, -nospec: speculate_decode off"
    )
    configs = {_sweep_name(*settings): _sweep_config(*settings) for settings in SWEEP}
    for shape in shapes:
        tuning = Tuning(
            kernel="ngram_hash",
            key_fields=("num_tokens",),
            match=SWEEP_BUCKETS[shape[1] * shape[2]],
            configs=configs,
            metric="graph_cold_us",
            measured="BENCHMARKS.md#hash",
        )
        cases.append(case("hash/sweep ", shape, _with_sweep, sweep_impls, tuning, sweep=sweep))
    return cases
