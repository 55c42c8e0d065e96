"""Tensor-name rules: defaults, format strings, lists, per-layer mappings, JSON files."""

from __future__ import annotations

import json

import pytest

from engramrt.checkpoint import (
    DEFAULT_HEAD_NAMES,
    DEFAULT_SCALE_NAMES,
    DEFAULT_WEIGHT_NAMES,
    TensorNames,
    load_names,
)
from engramrt.errors import CheckpointError


def test_defaults_are_deepseek_v41_names(tiny) -> None:
    """The names a V4.1 checkpoint uses, written out (not derived from the constants)."""
    names = TensorNames()
    assert names.candidates("weight", 14, 1) == (
        "layers.14.engram.embed.weight",
        "model.layers.14.engram.embed.weight",
    )
    assert names.candidates("scale", 1, 0) == (
        "layers.1.engram.embed.weight_scale_inv",
        "model.layers.1.engram.embed.weight_scale_inv",
        "layers.1.engram.embed.scale",
        "model.layers.1.engram.embed.scale",
    )
    source = names.candidates("source", 3, 1)
    assert source[:2] == ("layers.3.engram.embed.weight", "model.layers.3.engram.embed.weight")
    assert "engram.3.weight" in source
    assert [n[0] for n in names.per_layer("weight", tiny)] == [
        "layers.1.engram.embed.weight",
        "layers.3.engram.embed.weight",
    ]
    head = {role: tuple(t.format(layer=1) for t in ts) for role, ts in DEFAULT_HEAD_NAMES.items()}
    assert head == {
        "wkv": ("layers.1.engram.wkv.weight", "model.layers.1.engram.wkv.weight"),
        "wkv_scale": (
            "layers.1.engram.wkv.weight_scale_inv",
            "model.layers.1.engram.wkv.weight_scale_inv",
            "layers.1.engram.wkv.scale",
            "model.layers.1.engram.wkv.scale",
        ),
        "q_weight": ("layers.1.engram.q_weight", "model.layers.1.engram.q_weight"),
        "k_weight": ("layers.1.engram.k_weight", "model.layers.1.engram.k_weight"),
    }


def test_overrides_as_template_list_and_mapping(tiny) -> None:
    names = TensorNames.from_spec(
        {
            "weight": "blocks.{index}.table",
            "scale": ["a.{layer}.s", "b.{layer}.s"],
            "source": {"1": "first", 3: "second"},
        }
    )
    assert names.candidates("weight", 3, 1) == ("blocks.1.table",)
    assert names.candidates("scale", 3, 1) == ("a.3.s", "b.3.s")
    assert names.candidates("source", 1, 0) == ("first",)
    assert names.candidates("source", 3, 1) == ("second",)
    assert TensorNames.from_spec(names.to_dict()) == names
    # Roles left out keep their defaults.
    kept = TensorNames.from_spec({"source": "x.{layer}"})
    assert (kept.weight, kept.scale) == (DEFAULT_WEIGHT_NAMES, DEFAULT_SCALE_NAMES)


def test_names_json_file(tmp_path) -> None:
    path = tmp_path / "names.json"
    path.write_text(json.dumps({"source": "engram.{index}.weight"}))
    assert load_names(path).candidates("source", 14, 1) == ("engram.1.weight",)
    assert TensorNames.from_spec(str(path)) == load_names(path)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"wieght": "x"}, r"role\(s\) \['wieght'\]"),
        ({"weight": "x.{layr}"}, r"\['layr'\]"),
        ({"weight": "x.{layer"}, "not a format string"),
        ({"weight": ""}, "non-empty"),
        ({"weight": 3}, "format string, a list"),
        ({"weight": {"one": "x"}}, "layer id"),
    ],
)
def test_bad_name_specs_are_refused(spec, needle) -> None:
    with pytest.raises(CheckpointError, match=needle):
        TensorNames.from_spec(spec)


def test_missing_layer_and_shared_names_are_refused(tiny) -> None:
    with pytest.raises(CheckpointError, match=r"no entry for layer 3; it names layers \[1\]"):
        TensorNames.from_spec({"weight": {1: "a"}}).per_layer("weight", tiny)
    with pytest.raises(CheckpointError, match="layers 1 and 3 to the same tensor 'same'"):
        TensorNames.from_spec({"weight": "same"}).per_layer("weight", tiny)


def test_bad_names_files(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_names(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_names(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(CheckpointError, match="JSON list; expected an object"):
        load_names(tmp_path / "list.json")
