"""PleWeightLoader: a Qwen4-Exp checkpoint's PLE tensors as an engine streams them.

The pairs of the tiny checkpoints (``ple_checkpoints``: two PLE layers, the table in 7
``torch.chunk`` shards or whole, the hash buffers, the layer weights) in shuffled order,
beside tensors of the rest of the model, fill device-tier stores and heads: every row
equals the table's, bit for bit (whole rows at tp=1, a rank's values at tp=2), and the
heads hold the weights. Each door check names its tensor.
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.families.qwen4_ple import ple_checkpoints as ckpt

from engramrt.errors import CheckpointError, ValidationError
from engramrt.families.qwen4_ple.engine_loading import PleWeightLoader
from engramrt.families.qwen4_ple.layer import PleLayerWeights
from engramrt.families.qwen4_ple.serving import PleHead
from engramrt.families.qwen4_ple.streaming import PleStatePool
from engramrt.family import BF16
from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store
from engramrt.plan import width_slice

CONFIG = ckpt.CONFIG


def make(tp: int = 1, rank: int = 0, heads: bool = True):
    begin, end = width_slice(CONFIG.table_width, tp, rank)
    stores = [
        make_store(
            TablePlacement(DeviceOptions(), device="cpu"),
            num_rows=rows,
            E=end - begin,
            row_format=BF16,
        )
        for rows in ckpt.ROWS
    ]
    pool = PleStatePool(CONFIG, max_requests=2)
    zeros = {
        field: torch.zeros_like(tensor)
        for field, tensor in ckpt.random_weights(torch.bfloat16).items()
    }
    built = [
        PleHead.from_pool(pool, index, PleLayerWeights(**zeros), backend="reference")
        for index in range(CONFIG.n_layers)
    ] if heads else []  # fmt: skip
    return PleWeightLoader(CONFIG, stores, built, tp=tp, rank=rank), stores, built


def stream(state: dict[str, torch.Tensor], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in a shuffled order, with tensors of the rest of a model."""
    others = [
        ("model.language_model.layers.0.mlp.gate.weight", torch.ones(2, 2)),
        ("model.language_model.embed_tokens.weight", torch.ones(3, 2)),
    ]
    pairs = [*state.items(), *others]
    random.Random(seed).shuffle(pairs)
    return pairs


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_stream_fills_stores_and_heads(sharded: bool, tp: int, rank: int) -> None:
    state = ckpt.checkpoint_state(ckpt.COMPOSITE, sharded=sharded)
    loader, stores, heads = make(tp, rank)
    taken = loader.load_weights(stream(state))
    assert taken == set(state)  # every PLE tensor, nothing of the rest of the model
    loader.finish()
    begin, end = width_slice(CONFIG.table_width, tp, rank)
    for index, store in enumerate(stores):
        table = ckpt.random_table(index, torch.bfloat16)
        rows = store.gather_packed(torch.arange(store.num_rows)).view(torch.bfloat16)
        assert torch.equal(
            rows.view(torch.int16), table[:, begin:end].contiguous().view(torch.int16)
        )
        names = PleLayerWeights.checkpoint_names(ckpt.LAYERS[index], ckpt.COMPOSITE)
        for field, name in names.items():
            assert torch.equal(getattr(heads[index].layer.weights, field), state[name]), field


def test_text_only_prefix_and_tables_only() -> None:
    """Names match from ``layers.{i}.ple.`` on (any prefix); without heads the weights are
    checked and dropped, and nothing but the tables is missing."""
    state = ckpt.checkpoint_state(ckpt.TEXT_ONLY)
    loader, _, _ = make(heads=False)
    loader.load_weights((name.removeprefix("model."), t) for name, t in stream(state))
    loader.finish()


def test_missing_tensors_are_named() -> None:
    state = ckpt.checkpoint_state(ckpt.COMPOSITE)
    dropped = {
        ckpt.table_name(ckpt.COMPOSITE, 1, 3),
        ckpt.base(ckpt.COMPOSITE, 0) + "norm_conv.weight",
    }
    loader, _, _ = make()
    loader.load_weights((n, t) for n, t in state.items() if n not in dropped)
    with pytest.raises(CheckpointError) as info:
        loader.finish()
    assert "PLE layer 1: norm_conv" in str(info.value)
    assert "PLE layer 3: table shards [3]" in str(info.value)
    loader, _, _ = make()
    with pytest.raises(CheckpointError, match=r"PLE layer 1: its table \(whole or in shards\)"):
        loader.finish()


def _one(name: str, tensor: torch.Tensor) -> None:
    loader, _, _ = make()
    loader.load_weights([(name, tensor)])


def test_door_checks_name_the_tensor() -> None:
    p = ckpt.COMPOSITE
    table = ckpt.random_table(0, torch.bfloat16)
    shard0 = torch.chunk(table, 7)[0].contiguous()
    with pytest.raises(CheckpointError, match=r"decoder layer 1 has no PLE"):
        _one(f"{p}layers.1.ple.key_proj.weight", torch.zeros(64, 16))
    with pytest.raises(CheckpointError, match=r"matches no PLE role"):
        _one(f"{p}layers.0.ple.gate_proj.weight", torch.zeros(2))
    with pytest.raises(CheckpointError, match=r"expected torch.bfloat16 \[61, 4\]"):
        _one(ckpt.table_name(p, 0, 0), shard0[:60])
    with pytest.raises(CheckpointError, match=r"expected torch.bfloat16"):
        _one(ckpt.table_name(p, 0, 0), shard0.float())
    with pytest.raises(CheckpointError, match=r"expected shards 0..6"):
        _one(ckpt.table_name(p, 0, 7), shard0)
    poisoned = shard0.clone()
    poisoned[3, 1] = float("nan")
    with pytest.raises(CheckpointError, match=r"holds NaN or inf"):
        _one(ckpt.table_name(p, 0, 0), poisoned)
    with pytest.raises(CheckpointError, match=r"key_proj.weight' has .*expected shape \[64, 16\]"):
        _one(f"{p}layers.0.ple.key_proj.weight", torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"another config's checkpoint"):
        _one(
            f"{p}layers.0.ple.ple_embedding.ngram_heads_offsets", torch.zeros(4, dtype=torch.int64)
        )
    loader, _, _ = make()
    loader.load_weights([(ckpt.table_name(p, 0, 0), shard0)])
    with pytest.raises(CheckpointError, match=r"given twice"):
        loader.load_weights([(ckpt.table_name(p, 0, 0), shard0)])
    with pytest.raises(CheckpointError, match=r"both whole and as shards"):
        loader.load_weights([(ckpt.table_name(p, 0), table)])


def test_stores_must_fit_the_rank() -> None:
    stores = [
        make_store(TablePlacement(DeviceOptions(), device="cpu"), num_rows=r, E=4, row_format=BF16)
        for r in ckpt.ROWS
    ]
    with pytest.raises(
        ValidationError, match=r"stores\[0\] holds 424 rows of 4 values; expected .* 2 values"
    ):
        PleWeightLoader(CONFIG, stores, tp=2, rank=0)
    with pytest.raises(ValidationError, match=r"1 stores and 0 heads"):
        PleWeightLoader(CONFIG, stores[:1])
