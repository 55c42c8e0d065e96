"""Shared fixtures: configs, random float tables and their reference quantisation.

Checkpoints "as DeepSeek stores them" are written here with
``safetensors.torch.save_file`` (not with engramrt's own writer), so the
reader is tested against files it did not produce.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engramrt.config import PRESETS, EngramConfig
from engramrt.layout import EngramLayout
from engramrt.lookup import pack_rows
from engramrt.quant import quantize_rows

WEIGHT = "layers.{layer}.engram.embed.weight"
SCALE = "layers.{layer}.engram.embed.weight_scale_inv"


def synthetic_config(extra_rows: Sequence[int] = (0, 0, 0), head_dim: int = 96) -> EngramConfig:
    """Three layers, N=3, H=3 (C=6), E=96 (three scale blocks), tiny primes.

    ``num_embeddings`` is the layout's sum plus ``extra_rows`` per layer.
    """
    base = EngramConfig(
        layer_ids=(0, 5, 7),
        vocab_size=(37, 41),
        num_embeddings=(1, 1, 1),
        max_ngram_size=3,
        n_heads=3,
        head_dim=head_dim,
        compressed_vocab_size=1000,
        pad_token_id=0,
        hidden_size=64,
        hc_mult=2,
        name="synthetic",
    )
    needed = EngramLayout(base, check_num_embeddings=False).num_embeddings
    return base.replace(
        num_embeddings=tuple(n + e for n, e in zip(needed, extra_rows, strict=True))
    )


@pytest.fixture(scope="session")
def tiny() -> EngramConfig:
    return PRESETS["tiny"]


@pytest.fixture(scope="session")
def small() -> EngramConfig:
    return synthetic_config()


def float_tables(config: EngramConfig, seed: int, dtype: torch.dtype = torch.float32):
    """One random table ``[num_embeddings, E]`` per layer, with varied magnitudes per row."""
    generator = torch.Generator().manual_seed(seed)
    tables = []
    for rows in config.num_embeddings:
        table = torch.randn(rows, config.head_dim, generator=generator)
        magnitude = torch.exp2(torch.randint(-12, 12, (rows, 1), generator=generator).float())
        tables.append((table * magnitude).to(dtype))
    return tables


def reference_packed(tables) -> list[torch.Tensor]:
    """``quantize_rows`` (the reference) of each table, packed ``[rows, E + E/32]``."""
    return [pack_rows(*quantize_rows(t, backend="reference")) for t in tables]


def write_deepseek_checkpoint(
    path: Path,
    config: EngramConfig,
    packed: Sequence[torch.Tensor],
    *,
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """An fp8 checkpoint written by ``safetensors`` itself, DeepSeek's names and dtypes."""
    from safetensors.torch import save_file

    E = config.head_dim
    tensors = dict(extra or {})
    for layer, table in zip(config.layer_ids, packed, strict=True):
        tensors[WEIGHT.format(layer=layer)] = table[:, :E].contiguous().view(torch.float8_e4m3fn)
        tensors[SCALE.format(layer=layer)] = table[:, E:].contiguous().view(scale_dtype)
    save_file(tensors, str(path))
    return path


def write_sharded_directory(
    directory: Path,
    files: dict[str, dict[str, torch.Tensor]],
    *,
    index: bool,
) -> Path:
    """A Hugging Face style multi-file checkpoint, with ``model.safetensors.index.json`` or not."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file_name, tensors in files.items():
        save_file(tensors, str(directory / file_name))
        weight_map.update(dict.fromkeys(tensors, file_name))
    if index:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    return directory


@pytest.fixture(scope="session")
def tiny_tables(tiny):
    """fp32 source tables of ``tiny`` and their reference packed quantisation."""
    tables = float_tables(tiny, seed=1)
    return tables, reference_packed(tables)


@pytest.fixture(scope="session")
def small_tables(small):
    tables = float_tables(small, seed=2, dtype=torch.bfloat16)
    return tables, reference_packed(tables)


def bytes_without_conversion_id(path: Path) -> bytes:
    """The file's bytes with its conversion id (unique per conversion) blanked out.

    Two conversions of the same tables differ only there; the id has a fixed
    length, so every other byte keeps its offset.
    """
    from engramrt.checkpoint.conversion_set import META_CONVERSION_ID
    from engramrt.checkpoint.safetensors_format import read_header

    data = path.read_bytes()
    conversion_id = read_header(path).metadata[META_CONVERSION_ID].encode()
    assert data.count(conversion_id) == 1
    return data.replace(conversion_id, b"0" * len(conversion_id))
