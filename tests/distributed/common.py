"""Inputs shared by the distributed tests and their worker processes.

Configs: the ``tiny`` preset (C = 12 columns of E = 64, ~50k rows per layer,
every tp of 1..4 divides C) and synthetic ones built here: C = 10 columns of
E = 32 (33-byte rows; tp = 3 and 4 pad the last rank's column block) and
C = 6 (tp = 4 leaves a rank without a column). Tables are random packed
rows (finite fp8, scale bytes 118..131), never zeros; row ids fall inside
each hash column's bucket range, as hashing produces them.
"""

from __future__ import annotations

import hashlib

import torch
from tests.helpers import finite_packed_table

from engramrt.config import PRESETS, EngramConfig
from engramrt.layout import EngramLayout
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import DeviceOptions, RowStore, TablePlacement, make_store

TINY: EngramConfig = PRESETS["tiny"]


def synthetic_config(max_ngram_size: int, n_heads: int, head_dim: int, name: str) -> EngramConfig:
    """A one-layer config of small buckets whose ``num_embeddings`` is exactly what its primes need."""
    draft = EngramConfig(
        layer_ids=(2,),
        vocab_size=(509,) * (max_ngram_size - 1),
        num_embeddings=(1,),
        max_ngram_size=max_ngram_size,
        n_heads=n_heads,
        head_dim=head_dim,
        compressed_vocab_size=99_092,
        pad_token_id=2,
        hidden_size=64,
        hc_mult=4,
        name=name,
    )
    rows = int(EngramLayout(draft, check_num_embeddings=False).rows_needed[0])
    return draft.replace(num_embeddings=(rows,))


C10 = synthetic_config(3, 5, 32, "c10")  # C = 10, E = 32
C6 = synthetic_config(3, 3, 32, "c6")  # C = 6: tp = 4 is refused
CONFIGS: dict[str, EngramConfig] = {"tiny": TINY, "c10": C10, "c6": C6}


def layer_table(config: EngramConfig, layer_index: int = 0, seed: int = 11) -> torch.Tensor:
    """The whole packed table of one layer (CPU), the same in every process."""
    return finite_packed_table(
        config.num_embeddings[layer_index], config.head_dim, seed + 7919 * layer_index
    )


def random_row_ids(
    config: EngramConfig, num_tokens: int, seed: int, layer_index: int = 0
) -> torch.Tensor:
    """``[T, C]`` int64: column c's id in ``[offset_c, offset_c + prime_c)``."""
    layout = EngramLayout(config)
    g = torch.Generator().manual_seed(seed)
    offsets = torch.from_numpy(layout.offsets[layer_index].copy())
    primes = torch.from_numpy(layout.col_primes[layer_index].copy())
    fraction = torch.rand(num_tokens, config.n_cols, generator=g, dtype=torch.float64)
    return offsets + (fraction * primes).long().clamp_max(primes - 1)


def reference_rows(
    config: EngramConfig, row_ids: torch.Tensor, layer_index: int = 0
) -> torch.Tensor:
    """The single-process definition: the unsharded table's rows ``[T, C, E]``."""
    return lookup_rows_reference(row_ids, layer_table(config, layer_index), config.head_dim)


def shard_store(config: EngramConfig, tp: int, rank: int, layer_index: int = 0) -> RowStore:
    """Rank ``rank``'s column shard (SPEC §7) as a CPU store served by the reference."""
    shard = EngramLayout(config).column_shard(layer_index, tp, rank)
    table = layer_table(config, layer_index)
    placement = TablePlacement(
        DeviceOptions(backend="reference"), device="cpu", tp=shard.tp, rank=shard.rank
    )
    return make_store(placement, packed=table[shard.row_begin : shard.row_end].clone(), shard=shard)


def sha256_of(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Equal shapes and bit patterns (bf16 compared as int16); the first mismatches on failure."""
    assert actual.shape == expected.shape, f"{label}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{label}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.contiguous().view(torch.int16) if actual.dtype == torch.bfloat16 else actual
    e = expected.contiguous().view(torch.int16) if expected.dtype == torch.bfloat16 else expected
    bad = torch.nonzero(a != e)
    if bad.numel():
        shown = [
            (tuple(i), actual[tuple(i)].item(), expected[tuple(i)].item()) for i in bad[:5].tolist()
        ]
        raise AssertionError(
            f"{label}: {bad.shape[0]} elements differ; first (index, got, want): {shown}"
        )


class CountingLoader:
    """Fills the rows from ``table`` and counts its calls."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.calls = 0

    def __call__(self, target: torch.Tensor) -> None:
        self.calls += 1
        target.copy_(self.table)
