from __future__ import annotations

import json

import pytest

from engramrt.config import PRESETS, EngramConfig, load_config
from engramrt.errors import ConfigError, EngramError


def test_dsv41_flash_preset_matches_spec() -> None:
    cfg = PRESETS["dsv41-flash"]
    assert cfg.layer_ids == (1, 14)
    assert cfg.vocab_size == (16_000_000, 16_000_000, 16_000_000)
    assert cfg.num_embeddings == (384_006_168, 384_016_682)
    assert (cfg.max_ngram_size, cfg.n_heads, cfg.n_cols, cfg.head_dim) == (4, 8, 24, 256)
    assert (cfg.compressed_vocab_size, cfg.pad_token_id) == (99_092, 2)
    assert (cfg.hidden_size, cfg.hc_mult) == (5120, 4)
    assert cfg.row_bytes == 264


def test_hf_round_trip_and_extra_fields_ignored(tmp_path) -> None:
    cfg = PRESETS["tiny"]
    data = cfg.to_hf_dict() | {
        "num_hidden_layers": 43,
        "vocab_size": 129280,
        "architectures": ["X"],
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert load_config(path) == cfg
    assert load_config(tmp_path) == cfg  # a model directory
    assert load_config(data) == cfg


@pytest.mark.parametrize("name", ["tiny", "dsv41-flash"])
def test_hf_dict_writes_vocab_size_as_engines_read_it(name: str) -> None:
    # SGLang's and vLLM's config readers compute config.engram_vocab_size - 1: an int
    # (tests/engines/ runs both readers on this dict).
    cfg = PRESETS[name]
    data = json.loads(json.dumps(cfg.to_hf_dict()))
    assert data["engram_vocab_size"] == cfg.vocab_size[0]
    assert type(data["engram_vocab_size"]) is int
    assert EngramConfig.from_hf_dict(data) == cfg
    mixed = cfg.replace(vocab_size=(cfg.vocab_size[0], *[v + 1 for v in cfg.vocab_size[1:]]))
    assert EngramConfig.from_hf_dict(mixed.to_hf_dict()) == mixed


def test_vocab_size_int_is_broadcast_per_order() -> None:
    data = PRESETS["tiny"].to_hf_dict() | {"engram_vocab_size": 4096}
    assert EngramConfig.from_hf_dict(data).vocab_size == (4096, 4096, 4096)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("engram_n_heads", 0, "engram_n_heads=0"),
        ("engram_n_heads", -3, "engram_n_heads=-3"),
        ("engram_head_dim", 48, "multiple of 32"),
        ("engram_max_ngram_size", 1, "at least 2"),
        ("engram_vocab_size", [10, 20], "has 2 values; expected 3"),
        ("engram_num_embeddings", [5], "has 1 values; expected 2"),
        ("engram_layer_ids", [], "at least one layer"),
        ("engram_layer_ids", [3, 3], "repeated"),
        ("engram_compressed_vocab_size", "many", "'many'"),
        ("rms_norm_eps", 0.0, "rms_norm_eps"),
        ("engram_pad_token_id", -1, "engram_pad_token_id=-1"),
    ],
)
def test_bad_fields_name_field_and_value(field: str, value: object, needle: str) -> None:
    data = PRESETS["tiny"].to_hf_dict() | {field: value}
    with pytest.raises(ConfigError, match=None) as info:
        EngramConfig.from_hf_dict(data)
    assert needle in str(info.value)
    assert isinstance(info.value, EngramError)


def test_missing_field_is_named() -> None:
    data = PRESETS["tiny"].to_hf_dict()
    del data["engram_n_heads"]
    with pytest.raises(ConfigError, match="engram_n_heads"):
        EngramConfig.from_hf_dict(data)


def test_unknown_preset_and_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config("dsv99")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(arr)
