"""Benchmark cases for Qwen4-Exp PLE row ids at the shipped hash constants.

The kernel (``PleHasher``, every PLE layer in one launch) beside the reference's own torch
path: transformers' ``Qwen4ExpTextNGramEmbedding`` (one module per PLE layer, its table
swapped for an identity so only the ids are timed; no cache, so each request starts from
an EOS context, which skips the cache's clone and update: a lower bound on the
reference's time), and engramrt's plain torch path (``ple_row_ids_torch``) on the device.
The transformers path runs where transformers 5.23.0 is installed; otherwise the torch
path is the baseline.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engramrt.bench.registry import Case, register

PLE_LAYER_IDS = {1: (2,), 2: (2, 6)}
"""PLE layers by count: layer 2 is the one reported for the released model (unverified,
docs/families.md §1); a second shows the one-launch kernel across layers."""


def _config(n_layers: int) -> Any:
    from engramrt.families.qwen4_ple.config import PleConfig

    return PleConfig(
        ple_layer_ids=PLE_LAYER_IDS[n_layers],
        ple_embed_dim=2560,
        eos_token_id=248_044,
        num_hidden_layers=8,
        layer_types=("linear_attention",) * 8,
    )


def _oracle_available() -> bool:
    if importlib.util.find_spec("transformers") is None:
        return False
    import transformers

    return bool(transformers.__version__ == "5.23.0")


class _RowIdsOut(torch.nn.Module):
    """Stands in for the oracle's ``ngram_embedding``: returns the row ids it is given."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, device=device), requires_grad=False)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        return row_ids


def _oracle_modules(cfg: Any, device: torch.device) -> list[torch.nn.Module]:
    """One ``Qwen4ExpTextNGramEmbedding`` per PLE layer, built with one value per row
    (E = C) so the table it allocates is small, then swapped for :class:`_RowIdsOut`."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as oracle

    fields = cfg.replace(ple_embed_dim=cfg.n_cols).to_hf_dict()
    del fields["model_type"]
    hf_config = oracle.Qwen4ExpTextConfig(**fields)
    modules: list[torch.nn.Module] = []
    for ple_index, decoder_layer in enumerate(cfg.decoder_layer_indices):
        module = oracle.Qwen4ExpTextNGramEmbedding(
            hf_config, embedding_dim=cfg.n_cols, layer_idx=decoder_layer, ple_layer_index=ple_index
        )
        module.ngram_embedding = _RowIdsOut(device)  # type: ignore[assignment]
        modules.append(module.to(device))
    return modules


def _setup(device: torch.device, n_layers: int, n_req: int, per: int, seed: int) -> dict[str, Any]:
    from engramrt.families.qwen4_ple.ops import PleHasher

    cfg = _config(n_layers)
    rng = np.random.default_rng(seed)
    t_len = n_req * per
    hasher = PleHasher(cfg, device, backend="triton", validate=False)
    inputs: dict[str, Any] = {
        "cfg": cfg,
        "hasher": hasher,
        "token_ids": torch.tensor(rng.integers(0, cfg.vocab_size, size=t_len), device=device),
        "query_start_loc": torch.tensor(
            np.arange(n_req + 1) * per, dtype=torch.int32, device=device
        ),
        "contexts": hasher.start_contexts(n_req),  # fresh requests: the oracle's start
        "out": torch.empty((t_len, n_layers, cfg.n_cols), dtype=torch.int64, device=device),
        "next_context": torch.empty((n_req, cfg.ngram_size - 1), dtype=torch.int64, device=device),
        "packed": hasher.consts.packed(device),
        "shape": (n_req, per),
    }
    if _oracle_available():
        inputs["oracle"] = _oracle_modules(cfg, device)
    return inputs


def _triton(s: dict[str, Any]) -> torch.Tensor:
    s["hasher"](
        s["token_ids"],
        s["query_start_loc"],
        s["contexts"],
        out=s["out"],
        next_context=s["next_context"],
    )
    return s["out"]


def _torch(s: dict[str, Any]) -> torch.Tensor:
    from engramrt.families.qwen4_ple.ids import ple_row_ids_torch

    cfg = s["cfg"]
    rows, _ = ple_row_ids_torch(
        s["token_ids"],
        s["query_start_loc"],
        s["contexts"],
        s["packed"],
        cfg.heads_per_ngram,
        cfg.eos,
    )
    return rows


@torch.no_grad()
def _transformers(s: dict[str, Any]) -> torch.Tensor:
    n_req, per = s["shape"]
    ids = s["token_ids"].view(n_req, per)
    rows = [module(ids, None).view(n_req * per, -1) for module in s["oracle"]]
    return torch.stack(rows, dim=1)


def _check(inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
    from engramrt.families.qwen4_ple.ids import ple_row_ids_batch_reference

    hasher = inputs["hasher"]
    n_check = min(inputs["token_ids"].shape[0], 4096)
    n_req = int((inputs["query_start_loc"].cpu() <= n_check).sum()) - 1
    end = int(inputs["query_start_loc"][n_req])
    want, _ = ple_row_ids_batch_reference(
        inputs["token_ids"][:end].cpu(),
        inputs["query_start_loc"][: n_req + 1].cpu(),
        inputs["contexts"][:n_req].cpu(),
        hasher.consts,
        hasher.eos,
    )
    for name, output in outputs.items():
        got = output[:end].cpu().to(torch.int64)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].tolist()
            raise AssertionError(f"{name} and the reference differ at {bad}")


@register
def ple_cases(quick: bool) -> list[Case]:
    shapes = [(1, "decode", 256, 1), (2, "decode", 256, 1), (2, "prefill", 1, 8192)]
    if quick:
        shapes = shapes[1:2]
    oracle = _oracle_available()
    impls: dict[str, Callable[[dict[str, Any]], Any]] = {"triton": _triton, "torch-eager": _torch}
    if oracle:
        impls["transformers"] = _transformers
    cases = []
    for n_layers, kind, n_req, per in shapes:
        t_len = n_req * per
        cases.append(
            Case(
                name=f"ple/ids {kind} {n_req}x{per} L={n_layers}",
                params={
                    "requests": n_req,
                    "tokens_per_request": per,
                    "T": t_len,
                    "ple_layers": n_layers,
                    "C": 16,
                    "constants": "Qwen4-Exp defaults (head sizes from 20,000,003)",
                },
                make=functools.partial(
                    _setup, n_layers=n_layers, n_req=n_req, per=per, seed=t_len + n_layers
                ),
                impls=impls,
                check=_check,
                # ids read (8 B), contexts read and written (2 x 16 B a request), row ids
                # written (L x 16 x 8 B a token)
                bytes_moved=t_len * (8 + n_layers * 16 * 8) + n_req * 32,
                items=t_len,
                item_name="tokens",
                baseline="transformers" if oracle else "torch-eager",
                graph=True,
                graph_impls=("triton",),
            )
        )
    return cases
