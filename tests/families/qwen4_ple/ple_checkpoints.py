"""Tiny Qwen4-Exp PLE checkpoints, written here with ``safetensors.torch.save_file`` the way
``save_pretrained`` writes them (the oracle test of ``test_checkpoint.py`` checks that it
does): two PLE layers, either prefix, the table as ``torch.chunk`` shards or whole, the hash
buffers and the layer weights. Shared by the reader's and the loader's tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.ids import PleConstants
from engramrt.families.qwen4_ple.layer import PleLayerWeights

COMPOSITE, TEXT_ONLY = "model.language_model.", "model."
D, HC, E, K = 32, 2, 16, 4  # C = (N-1)*H = 4 heads, so d = E / C = 4

FIELDS = dict(
    vocab_size=97,
    hidden_size=D,
    hc_count=HC,
    num_hidden_layers=3,
    layer_types=["linear_attention"] * 3,
    ple_layer_ids=[1, 3],  # PLE index 0 at decoder layer 0, index 1 at decoder layer 2
    ple_embed_dim=E,
    ngram_size=3,
    heads_per_ngram=2,
    ple_conv_kernel_size=K,
    ngram_vocab_size_base=101,
    make_ngram_vocab_size_divisible_by=8,
    eos_token_id=5,
    split_ngram_parts=7,
)
CONFIG = PleConfig.from_hf(FIELDS)
CONSTS = PleConstants.from_config(CONFIG)
ROWS = CONSTS.table_rows  # (424, 512): neither divisible by 7
WIDTH = CONFIG.table_width
LAYERS = CONFIG.decoder_layer_indices  # (0, 2)
BUFFERS = {  # stored buffer -> the config's constants, [L, N] or [L, C]
    "layer_multipliers": CONSTS.multipliers,
    "ngram_heads_vocab_sizes": CONSTS.head_sizes,
    "ngram_heads_offsets": CONSTS.offsets,
}


def base(prefix: str, ple_index: int) -> str:
    return f"{prefix}layers.{LAYERS[ple_index]}.ple."


def table_name(prefix: str, ple_index: int, shard: int | None = None) -> str:
    emb = f"{base(prefix, ple_index)}ple_embedding.ngram_embedding."
    return f"{emb}weight" if shard is None else f"{emb}shard_{shard}.weight"


def random_table(ple_index: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + ple_index)
    return torch.randn(ROWS[ple_index], WIDTH, generator=g).to(dtype)


def random_weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    shapes = dict(
        key_proj=(HC * D, E),
        value_proj=(D, E),
        norm_key=(HC * D,),
        norm_query=(HC * D,),
        norm_conv=(HC * D,),
        conv1d=(HC * D, 1, K),
    )
    return {field: torch.randn(shape, generator=g).to(dtype) for field, shape in shapes.items()}


def checkpoint_state(
    prefix: str,
    *,
    parts: int = 7,
    dtype: torch.dtype = torch.bfloat16,
    buffers: bool = True,
    sharded: bool = True,
) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for both PLE layers: ``torch.chunk(table, parts)`` as
    ``shard_<k>`` (or the whole table), the int64 buffers and the layer weights."""
    state: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(LAYERS):
        table = random_table(index, dtype)
        if sharded:
            for k, shard in enumerate(torch.chunk(table, parts)):
                state[table_name(prefix, index, k)] = shard.contiguous()
        else:
            state[table_name(prefix, index)] = table
        if buffers:
            for buffer, constants in BUFFERS.items():
                name = f"{base(prefix, index)}ple_embedding.{buffer}"
                state[name] = torch.tensor(constants[index].tolist(), dtype=torch.int64)
        names = PleLayerWeights.checkpoint_names(layer, prefix)
        for field, tensor in random_weights(dtype, index).items():
            state[names[field]] = tensor
    return state


def save(directory: Path, state: dict[str, torch.Tensor], *, files: int = 1) -> Path:
    """``state`` in ``files`` files (round robin) with an HF index when more than one."""
    directory.mkdir(parents=True, exist_ok=True)
    if files == 1:
        save_file(state, str(directory / "model.safetensors"))
        return directory
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    weight_map = {}
    for position, (name, tensor) in enumerate(sorted(state.items())):
        groups[position % files][name] = tensor
        weight_map[name] = f"model-{position % files + 1:05d}-of-{files:05d}.safetensors"
    for number, group in enumerate(groups):
        save_file(group, str(directory / f"model-{number + 1:05d}-of-{files:05d}.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """NaN everywhere, so an element the reader leaves unwritten fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype)
