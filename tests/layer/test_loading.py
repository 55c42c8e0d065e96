"""An EngramLayer built from a checkpoint equals one built from the same tensors by hand."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from tests.layer.common import (
    CONFIG,
    DEVICE,
    finite_packed_table,
    full_store,
    layer_table,
    random_hidden,
    random_row_ids,
    random_weights,
)

from engramrt.checkpoint import save_tables
from engramrt.errors import CheckpointError
from engramrt.layer import EngramLayer, load_layer
from engramrt.lookup.tiers import TablePlacement

ON_DEVICE = TablePlacement("device", device=DEVICE)


def _checkpoint(
    tmp_path,
    weights: dict,
    drop: str | None = None,
    prefix: str = "model.",
    scale: str = "weight_scale_inv",
):
    tables = [layer_table(), finite_packed_table(CONFIG.num_embeddings[1], CONFIG.head_dim, 9)]
    save_tables(tmp_path / "engram.safetensors", tables, CONFIG)
    layer_id = CONFIG.layer_ids[0]
    named = {
        f"{prefix}layers.{layer_id}.engram.wkv.weight": weights["wkv"],
        f"{prefix}layers.{layer_id}.engram.q_weight": weights["q_weight"],
        f"{prefix}layers.{layer_id}.engram.k_weight": weights["k_weight"],
    }
    if weights.get("wkv_scale") is not None:
        named[f"{prefix}layers.{layer_id}.engram.wkv.{scale}"] = weights["wkv_scale"]
    if drop is not None:
        named = {k: v for k, v in named.items() if drop not in k}
    save_file(named, str(tmp_path / "model-00001.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("fp8", "prefix", "scale"),
    [
        (False, "model.", "weight_scale_inv"),
        (True, "model.", "weight_scale_inv"),
        (True, "", "weight_scale_inv"),
        (True, "", "scale"),
        (True, "model.", "scale"),
    ],
)
def test_load_layer_matches_a_hand_built_layer(
    tmp_path, fp8: bool, prefix: str, scale: str
) -> None:
    weights = random_weights(3, fp8=fp8)
    ckpt = _checkpoint(tmp_path, weights, prefix=prefix, scale=scale)
    loaded = load_layer(ckpt, CONFIG, 0, max_tokens=16, placement=ON_DEVICE)
    by_hand = EngramLayer(CONFIG, full_store(layer_table()), max_tokens=16)
    by_hand.load_weights(**weights)
    row_ids, hidden = random_row_ids(9, seed=4).to(DEVICE), random_hidden(9, seed=5).to(DEVICE)
    got = loaded(hidden, row_ids).clone()
    want = by_hand(hidden, row_ids)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_load_layer_names_missing_tensors(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path, random_weights(3, fp8=False), drop="k_weight")
    with pytest.raises(
        CheckpointError,
        match=r"k_weight tensor \(tried 'layers\.1\.engram\.k_weight', "
        r"'model\.layers\.1\.engram\.k_weight'\)",
    ):
        load_layer(ckpt, CONFIG, 0, max_tokens=4, placement=ON_DEVICE)
    ckpt_fp8 = _checkpoint(tmp_path / "fp8", random_weights(3, fp8=True), drop="weight_scale_inv")
    with pytest.raises(CheckpointError, match="wkv_scale"):
        load_layer(ckpt_fp8, CONFIG, 0, max_tokens=4, placement=ON_DEVICE)
    with pytest.raises(CheckpointError, match="weight_names has"):
        load_layer(ckpt, CONFIG, 0, max_tokens=4, weight_names={"wq": "x"})


def test_load_layer_renamed_tensors(tmp_path) -> None:
    weights = random_weights(5, fp8=False)
    ckpt = _checkpoint(tmp_path, weights)
    save_file({"blocks.1.qn": weights["q_weight"]}, str(tmp_path / "extra.safetensors"))
    layer = load_layer(
        ckpt,
        CONFIG,
        0,
        ON_DEVICE,
        max_tokens=4,
        weight_names={"q_weight": "blocks.{layer}.qn"},
    )
    assert torch.equal(layer.head.q_weight.cpu(), weights["q_weight"])
