"""How far the hash heads of one n-gram order agree in a trained model (CPU or GPU).

    python -m engramrt_lab.models.heads [MODEL] [--random-sequences 64] [--json PATH]

An Engram layer's value is the sum, over its hash columns, of each column's row times
that column's block of the value projection (the last ``D`` rows of ``wkv``): one
*contribution* ``[D]`` per column. The ``K`` columns of an n-gram order are ``K`` hashes
of the same n-gram. Where training saw the n-gram, its rows were trained together and
their contributions can point one way; where it did not, each head's row was trained by
other n-grams, and theirs need not. Per Engram layer and n-gram order, over the
predicted positions of the model directory's held-out sample and of as many random
sequences of its kept vocabulary (almost every n-gram new), this reports:

- ``cosine``: the mean cosine between the contributions of two different heads
  (1: all alike; 0: unrelated directions);
- ``coherence``: ``|sum of the contributions| / sum of their norms`` (1: aligned;
  ``1/sqrt(K)`` for ``K`` orthogonal ones of one norm).

A model trained with ``--wkv-heads summed`` projects its heads' rows by one block, so its
contributions are that block times each head's row. ``MODEL``: a model directory or
``tiny-lm``, the shipped one (the default).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt.errors import EngramError
from engramrt.hashing import HashBatch
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import TablePlacement
from engramrt_lab.models.cli_parser import OneLineParser, report
from engramrt_lab.models.packaged import PACKAGED_MODEL

__all__ = ["agreement", "contributions", "head_agreement", "main"]

PROG = "python -m engramrt_lab.models.heads"


def contributions(model: Any, index: int, row_ids: torch.Tensor) -> torch.Tensor:
    """``[T, orders, K, D]`` fp32: each hash column's row of Engram layer ``index`` (by
    ``row_ids [T, C]``) times its block of the served value projection."""
    head = model.lm.engram_head(model.lm_config.engram_layer_ids[index])
    hc, dim = model.lm_config.hc_mult, model.lm_config.dim
    E, heads = model.config.head_dim, model.consts.n_heads
    rows = lookup_rows_reference(row_ids.cpu(), model.packed_tables[index], E).float()
    value = head.served_wkv().detach().float().cpu()[hc * dim :]  # [D, C*E]
    cols = rows.shape[1]
    out = torch.einsum("dce,tce->tcd", value.view(dim, cols, E), rows)
    return out.view(rows.shape[0], cols // heads, heads, dim)


def agreement(contrib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``contrib [T, orders, K, D]`` -> (``cosine``, ``coherence``), each ``[T, orders]``:
    the mean cosine over the ``K (K - 1)`` ordered pairs of different heads, and ``|sum| /
    sum of norms`` (0 where every contribution is zero)."""
    heads = contrib.shape[2]
    norms = contrib.norm(dim=-1)  # [T, O, K]
    unit = contrib / norms.clamp_min(1e-30)[..., None]
    sims = torch.einsum("tokd,tojd->tokj", unit, unit)
    pairs = sims.sum(dim=(-1, -2)) - sims.diagonal(dim1=-2, dim2=-1).sum(dim=-1)
    cosine = pairs / (heads * (heads - 1))
    total = norms.sum(dim=-1)
    coherence = contrib.sum(dim=2).norm(dim=-1) / total.clamp_min(1e-30)
    return cosine, torch.where(total > 0, coherence, torch.zeros_like(coherence))


def _summary(model: Any, row_ids: torch.Tensor, keep: torch.Tensor) -> dict[str, Any]:
    """Per Engram block, each order's mean ``cosine`` and ``coherence`` over ``keep``."""
    found: dict[str, Any] = {}
    for index, block in enumerate(model.lm_config.engram_layer_ids):
        cosine, coherence = agreement(contributions(model, index, row_ids[:, index]))
        found[str(block)] = {
            "cosine": [round(float(v), 4) for v in cosine[keep].mean(dim=0)],
            "coherence": [round(float(v), 4) for v in coherence[keep].mean(dim=0)],
        }
    return found


@torch.no_grad()
def head_agreement(model: Any, random_sequences: int = 64, seed: int = 0) -> dict[str, Any]:
    """:func:`agreement` over the held-out sample's predicted positions and over
    ``random_sequences`` random sequences of the kept vocabulary, as long as the sample's
    (see the module docstring)."""
    sample = model.sample
    seq = sample.tokens.shape[1]
    row_ids = model.segment_row_ids(sample).cpu()  # [M*S, L, C], hashed in their documents
    keep = torch.as_tensor(np.arange(seq)[None, :] < sample.lengths[:, None] - 1).reshape(-1)
    rng = np.random.default_rng(seed)
    kept = model.vocab.untrim(np.arange(model.vocab.num_kept))
    tokens = rng.choice(kept, size=(random_sequences, seq))
    batch = HashBatch(
        input_ids=torch.as_tensor(tokens.reshape(-1), device=model.device),
        positions=torch.as_tensor(np.tile(np.arange(seq), random_sequences), device=model.device),
        query_start_loc=torch.arange(
            0, (random_sequences + 1) * seq, seq, device=model.device, dtype=torch.int32
        ),
    )
    random_ids = model.hasher(batch).cpu()
    heads = model.consts.n_heads
    return {
        "orders": list(range(2, 2 + model.config.n_cols // heads)),
        "heads_per_order": heads,
        "sample": {"positions": int(keep.sum()), **_summary(model, row_ids, keep)},
        "random": {
            "positions": int(random_ids.shape[0]),
            **_summary(model, random_ids, torch.ones(random_ids.shape[0], dtype=torch.bool)),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    orders = result["orders"]
    lines = [
        "| block | positions | " + " | ".join(f"cosine {o}-gram" for o in orders) + " | "
        + " | ".join(f"coherence {o}-gram" for o in orders) + " |",
        "| --- | --- |" + " --- |" * (2 * len(orders)),
    ]  # fmt: skip
    for name in ("sample", "random"):
        part = result[name]
        for block, values in part.items():
            if block == "positions":
                continue
            cells = [f"{v:.3f}" for v in values["cosine"] + values["coherence"]]
            lines.append(
                f"| {block} ({name}) | {part['positions']:,} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=PACKAGED_MODEL)
    parser.add_argument("--random-sequences", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.random_sequences < 1:
        parser.error(f"--random-sequences={args.random_sequences} must be at least 1")
    from engramrt_lab.models.serve import load_model

    try:
        model = load_model(
            args.model,
            TablePlacement("device", device="cpu"),
            load_baseline=False,
            head_backend="reference",
        )
    except (EngramError, OSError) as exc:
        parser.error(f"model {args.model!r} cannot be loaded: {exc}")
    result = head_agreement(model, args.random_sequences)
    return report(result, args.json, markdown(result))


if __name__ == "__main__":
    raise SystemExit(main())
