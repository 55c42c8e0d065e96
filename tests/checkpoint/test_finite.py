"""Non-finite tables and weights are refused at load, naming the tensor and the row.

Each case plants one bad byte (or value) in otherwise valid rows and loads
them through :func:`load_table` (a DeepSeek-style file) and through
:class:`EngramWeightLoader` (an engine's tensor stream). Whether a row is
non-finite is decided here independently, by dequantising its bytes with
torch's own fp8 and float arithmetic (SPEC §6: ``value * 2**(b - 127)``).
Controls: a scale byte of 0xFE with small values stays finite and loads.
"""

from __future__ import annotations

import pytest
import torch

from engramrt.checkpoint import EngramWeightLoader, load_layer, load_table
from engramrt.errors import CheckpointError

from .conftest import SCALE, WEIGHT, write_deepseek_checkpoint
from .test_engine_loading import CONFIG, TABLES, E, _loader, placed, v41_tensors

ROW, COL = 1234, 37  # a row of layer 1 (rank 0 of tp = 1 reads every row)
LAYER = CONFIG.layer_ids[0]


def dequantised_row(table: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row`` of packed ``table`` in fp32, by torch's fp8 conversion (not engramrt's)."""
    values = table[row, :E].view(torch.float8_e4m3fn).to(torch.float32)
    scales = torch.exp2(table[row, E:].to(torch.float32) - 127).repeat_interleave(32)
    return values * scales


def planted(kind: str) -> torch.Tensor:
    table = TABLES[0].clone()
    if kind == "value 0x7f":
        table[ROW, COL] = 0x7F
    elif kind == "value 0xff":
        table[ROW, COL] = 0xFF
    elif kind == "scale 0xff":
        table[ROW, E + 1] = 0xFF
    elif kind == "scale 0xfe":  # 2**127 times a large value: inf
        table[ROW, E + 1] = 0xFE
        table[ROW, 32 + 5] = 0x7E  # 448
    elif kind == "scale 0xf7":  # the first byte that can overflow: 2**120 * 448 >= 2**128
        table[ROW, E + 1] = 0xF7
        table[ROW, 32 + 5] = 0x7E
    elif kind == "scale 0xfe, small values":  # the control: finite
        table[ROW, E + 1] = 0xFE
        table[ROW, 32:64] = 0x01  # 2**-9 each
    return table


BAD = ["value 0x7f", "value 0xff", "scale 0xff", "scale 0xfe", "scale 0xf7"]
NAMES = {"value": WEIGHT.format(layer=LAYER), "scale": SCALE.format(layer=LAYER)}


@pytest.mark.parametrize("kind", BAD)
def test_bad_rows_are_really_non_finite(kind: str) -> None:
    """The independent check: each planted row dequantises to NaN or inf."""
    assert not torch.isfinite(dequantised_row(planted(kind), ROW)).all()
    assert torch.isfinite(dequantised_row(planted("scale 0xfe, small values"), ROW)).all()
    assert torch.isfinite(dequantised_row(TABLES[0], ROW)).all()


@pytest.mark.parametrize("kind", BAD)
def test_load_table_refuses_non_finite_rows(tmp_path, kind: str) -> None:
    packed = [planted(kind), *TABLES[1:]]
    path = write_deepseek_checkpoint(tmp_path / "model.safetensors", CONFIG, packed)
    name = NAMES[kind.split()[0]]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' row {ROW}\b") as caught:
        load_table(path, CONFIG, 0, placed(), block_rows=500)
    assert str(caught.value).count("\n") == 0
    # The control: the same file with the small-values row loads and serves it as stored.
    packed = [planted("scale 0xfe, small values"), *TABLES[1:]]
    path = write_deepseek_checkpoint(tmp_path / "control.safetensors", CONFIG, packed)
    store = load_table(path, CONFIG, 0, placed())
    assert torch.equal(store.gather_packed(torch.tensor([ROW]))[0], packed[0][ROW])


def _table_stream(table: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = v41_tensors("", "weight_scale_inv", scale_dtype=torch.uint8)
    base = f"layers.{LAYER}.engram.embed."
    tensors[base + "weight"] = table[:, :E].contiguous().view(torch.float8_e4m3fn)
    tensors[base + "weight_scale_inv"] = table[:, E:].contiguous()
    return tensors


@pytest.mark.parametrize("kind", BAD)
def test_the_engine_loader_refuses_non_finite_rows(kind: str) -> None:
    loader = _loader(1, 0)
    name = f"layers.{LAYER}.engram.embed." + (
        "weight" if kind.startswith("value") else "weight_scale_inv"
    )
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' row {ROW}\b"):
        loader.load_weights(_table_stream(planted(kind)))


HEAD_CASES = [
    ("wkv.weight", "nan", "finite values"),
    ("q_weight", "inf", "finite values"),
    ("k_weight", "-inf", "finite values"),
    ("wkv.weight_scale_inv", "0", "finite scales > 0"),
    ("wkv.weight_scale_inv", "-1", "finite scales > 0"),
]


@pytest.mark.parametrize(("role", "value", "expected"), HEAD_CASES)
def test_the_engine_loader_refuses_non_finite_head_weights(role, value, expected) -> None:
    tensors = v41_tensors("", "weight_scale_inv", scale_dtype=torch.uint8)
    name = f"layers.{LAYER}.engram.{role}"
    bad = tensors[name].clone()
    if bad.dtype == torch.float8_e4m3fn:  # an fp8 wkv holds NaN as the byte 0x7f
        bad.view(torch.uint8)[0, 3] = 0x7F
    else:
        bad.view(-1)[3] = float(value)
    tensors[name] = bad
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds .* expected {expected}"):
        _loader(1, 0).load_weights(tensors)


@pytest.mark.parametrize(("role", "value", "expected"), HEAD_CASES)
def test_load_layer_refuses_non_finite_head_weights(tmp_path, role, value, expected) -> None:
    """load_layer reads head weights through the same checks as the engine loader (it is a
    call of it); the control loads the same checkpoint without the planted value."""
    from safetensors.torch import save_file

    tensors = v41_tensors("", "weight_scale_inv", scale_dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "good.safetensors"))
    layer = load_layer(tmp_path / "good.safetensors", CONFIG, 0, placed("device"), max_tokens=4)
    assert torch.equal(layer.head.q_weight.cpu(), tensors[f"layers.{LAYER}.engram.q_weight"])
    name = f"layers.{LAYER}.engram.{role}"
    bad = tensors[name].clone()
    if bad.dtype == torch.float8_e4m3fn:  # an fp8 wkv holds NaN as the byte 0x7f
        bad.view(torch.uint8)[0, 3] = 0x7F
    else:
        bad.view(-1)[3] = float(value)
    tensors[name] = bad
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds .* expected {expected}"):
        load_layer(tmp_path / "bad.safetensors", CONFIG, 0, placed("device"), max_tokens=4)


def test_engine_loader_misuse_gets_one_clear_error() -> None:
    tensors = v41_tensors("", "weight_scale_inv", scale_dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"weights item 0 is a tuple of 2 \(int, Tensor\)"):
        _loader(1, 0).load_weights([(5, torch.zeros(1))])
    with pytest.raises(CheckpointError, match=r"weights item 0 is a str; expected a \(name"):
        _loader(1, 0).load_weights(["layers.1.engram.q_weight"])
    name = f"layers.{LAYER}.engram.embed.weight"
    meta = {name: tensors[name].to("meta")}
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' .* is on the meta device"):
        _loader(1, 0).load_weights(meta)
    loader = _loader(1, 0)
    with pytest.raises(CheckpointError, match=r"stores read before finish\(\)"):
        _ = loader.stores
    # A mapping is read through its items, like the list of pairs.
    assert loader.load_weights(tensors) == set(tensors)
    stores = loader.finish()
    assert loader.stores == stores
    assert isinstance(loader, EngramWeightLoader)
