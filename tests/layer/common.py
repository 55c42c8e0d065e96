"""Inputs shared by the layer tests (and the sequence-parallel worker processes).

Everything is drawn fresh from seeded generators on the CPU and moved to
the test device: packed tables of random rows (finite: the e4m3fn NaN codes
are remapped), row ids inside each hash column's bucket range (as hashing
produces them, so a rank's column shard serves exactly its ids), random
``wkv`` weights (bf16, or fp8 e4m3fn with DeepSeek-style 128 x 128 block
scales) and norm weights near 1.
"""

from __future__ import annotations

import os

import torch
from tests.helpers import finite_packed_table

from engramrt._backend import interpreter_enabled
from engramrt.config import PRESETS, EngramConfig
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import RowStore, TablePlacement, make_store

CUDA = torch.cuda.is_available()
DEVICE = torch.device(os.environ.get("ENGRAMRT_TEST_DEVICE", "cuda" if CUDA else "cpu"))
CONFIG: EngramConfig = PRESETS["tiny"]  # D=256, hc=4, E=64, C=12, ~50k rows per layer
LAYER_INDEX = 0
# Triton's CPU interpreter stores bf16 by truncation (see engramrt.gate.reference).
TRUNCATING_STORE = DEVICE.type == "cpu" and interpreter_enabled()


def layout(config: EngramConfig = CONFIG) -> EngramLayout:
    return EngramLayout(config)


def layer_table(config: EngramConfig = CONFIG, seed: int = 7) -> torch.Tensor:
    """The packed table of layer ``LAYER_INDEX`` (CPU)."""
    return finite_packed_table(config.num_embeddings[LAYER_INDEX], config.head_dim, seed)


def random_row_ids(num_tokens: int, seed: int, config: EngramConfig = CONFIG) -> torch.Tensor:
    """``[T, C]`` int64: column c's id in ``[offset_c, offset_c + prime_c)``."""
    lay = layout(config)
    g = torch.Generator().manual_seed(seed)
    offsets = torch.from_numpy(lay.offsets[LAYER_INDEX].copy())
    primes = torch.from_numpy(lay.col_primes[LAYER_INDEX].copy())
    fraction = torch.rand(num_tokens, config.n_cols, generator=g, dtype=torch.float64)
    return offsets + (fraction * primes).long().clamp_max(primes - 1)


def full_store(table: torch.Tensor, device: torch.device = DEVICE) -> RowStore:
    return make_store(TablePlacement("device", device=device), packed=table)


def shard_store(table: torch.Tensor, tp: int, rank: int, device: torch.device = DEVICE) -> RowStore:
    """Rank ``rank``'s column shard (SPEC §7) as a device-tier store."""
    placement = TablePlacement("device", device=device, tp=tp, rank=rank)
    shard = placement.shard(layout(), LAYER_INDEX)
    return make_store(placement, packed=table[shard.row_begin : shard.row_end], shard=shard)


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[out, in]`` weight -> (fp8 e4m3fn weight, fp32 ``[ceil(out/128), ceil(in/128)]``
    scales), one scale per 128 x 128 block (amax / 448, not a power of two: as
    DeepSeek's checkpoints)."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // 128), -(-in_features // 128)
    padded = torch.zeros(rows * 128, cols * 128, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    blocks = padded.view(rows, 128, cols, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [rows, cols]
    quantized = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    fp8 = quantized.view(rows * 128, cols * 128)[:out_features, :in_features].contiguous()
    return fp8, scale.contiguous()


def random_weights(seed: int, *, fp8: bool, config: EngramConfig = CONFIG) -> dict:
    """Checkpoint-style tensors for ``EngramLayer.load_weights`` (CPU)."""
    hc, dim = config.hc_mult, config.hidden_size
    width = config.n_cols * config.head_dim
    g = torch.Generator().manual_seed(seed)
    wkv = torch.randn((hc + 1) * dim, width, generator=g) / width**0.5
    weights: dict = {
        "q_weight": (1.0 + 0.2 * torch.randn(hc, dim, generator=g)).bfloat16(),
        "k_weight": (1.0 + 0.2 * torch.randn(hc, dim, generator=g)).bfloat16(),
    }
    if fp8:
        weights["wkv"], weights["wkv_scale"] = quantize_block_fp8(wkv)
    else:
        weights["wkv"] = wkv.bfloat16()
    return weights


def random_hidden(num_tokens: int, seed: int, config: EngramConfig = CONFIG) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, config.hc_mult, config.hidden_size, generator=g) * 2 + 0.1
    return hidden.bfloat16()


def exact_wkv(weights: dict) -> torch.Tensor:
    """The checkpoint's exact ``wkv`` (float64 dequantisation for fp8)."""
    from engramrt.layer import dequantize_block_fp8_reference

    if weights.get("wkv_scale") is None:
        return weights["wkv"].double()
    return dequantize_block_fp8_reference(weights["wkv"], weights["wkv_scale"], dtype=torch.float64)


def check_head_step(head, weights: dict, hidden, rows, kv, out, token_mask=None) -> None:
    """kv and out of one step of ``head`` on ``rows`` against the float reference, within
    the derived tolerances (:func:`engramrt.layer.assert_layer_within_tolerance`)."""
    from engramrt.layer import assert_layer_within_tolerance

    assert_layer_within_tolerance(
        hidden=hidden,
        rows=rows,
        kv=kv,
        out=out,
        wkv_exact=exact_wkv(weights).to(hidden.device),
        q_weight=head.q_weight,
        k_weight=head.k_weight,
        eps=head.eps,
        token_mask=token_mask,
        weight_rounding=head.wkv.weight_rounding,
        truncating_store=hidden.device.type == "cpu" and interpreter_enabled(),
    )
