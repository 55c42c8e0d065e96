"""PleConfig against transformers 5.23.0's ``Qwen4ExpTextConfig`` (the oracle, conftest's
``oracle`` fixture; tests that need it skip where it is not installed): loading
from nested and flat ``config.json`` dicts and files, derived sizes, and validation that
refuses what the reference refuses, naming the field and the value."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from engramrt.errors import ConfigError, EngramError
from engramrt.families.qwen4_ple.config import PleConfig, default_layer_types

LIN, IDX = "linear_attention", "indexed_attention"

TEXT = {
    "vocab_size": 97,
    "hidden_size": 32,
    "num_hidden_layers": 6,
    "layer_types": [LIN, LIN, LIN, IDX, LIN, LIN],
    "ple_layer_ids": [5, 2, 2],
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 50,
    "hc_count": 2,
    "eos_token_id": [7, 9],
}
"""A small text config: PLE on decoder layers 1 and 4 (ids 2 and 5, given unsorted with a
repeat), C = 4, E = hidden_size = 32, an EOS list."""


def oracle_text(oracle: ModuleType, fields: dict[str, Any]) -> Any:
    """The oracle's ``Qwen4ExpTextConfig`` of ``fields`` (it validates on construction)."""
    return oracle.Qwen4ExpTextConfig(**fields)


def assert_agrees(oracle: ModuleType, ours: PleConfig, theirs: Any) -> None:
    """Every field and derived value equals the reference's."""
    assert list(ours.ple_layer_ids) == theirs.ple_layer_ids
    assert ours.embed_dim == theirs.ple_embed_dim
    assert list(ours.kinds) == theirs.layer_types
    eos = theirs.eos_token_id
    assert ours.eos_token_id == (eos[0] if isinstance(eos, list) and eos else eos or None)
    for name in (
        "ngram_size",
        "heads_per_ngram",
        "ngram_vocab_size_base",
        "make_ngram_vocab_size_divisible_by",
        "seed",
        "split_ngram_parts",
        "ple_conv_kernel_size",
        "vocab_size",
        "hidden_size",
        "hc_count",
        "rms_norm_eps",
        "num_hidden_layers",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.n_layers == len(theirs.ple_layer_ids)
    assert (3 if ours.enabled else 1) == theirs.number_of_conv_states
    for ple_index, layer_index in enumerate(ours.decoder_layer_indices):
        # Qwen4ExpTextDecoderLayer's rule: ple_layer_index = ple_layer_ids.index(i + 1).
        assert theirs.ple_layer_ids.index(layer_index + 1) == ple_index
        assert theirs.layer_types[layer_index] == LIN
        ple = oracle.Qwen4ExpTextPLELayer(theirs, layer_idx=layer_index, ple_layer_index=ple_index)
        assert ple.ple_embedding.ngram_heads == ours.n_cols
        assert ple.ple_embedding.context_len == ours.context_len
        assert ple.ple_embedding.ngram_embedding.embedding_dim == ours.table_width
        assert ple.ple_embedding.eos_token_id == ours.eos
        assert ple.short_conv_state_len == ours.conv_state_len
        assert ple.key_proj.weight.shape == (ours.hc_count * ours.hidden_size, ours.embed_dim)


# -- loading ------------------------------------------------------------------------------


def test_flat_text_config_agrees_with_the_oracle(oracle: ModuleType) -> None:
    theirs = oracle_text(oracle, TEXT)
    ours = PleConfig.from_hf(theirs.to_dict())
    assert ours.ple_layer_ids == (2, 5)
    assert ours.decoder_layer_indices == (1, 4)
    assert (ours.eos, ours.n_cols, ours.table_width, ours.context_len) == (7, 4, 8, 2)
    assert ours.conv_state_len == (4 - 1) * 3
    assert_agrees(oracle, ours, theirs)


def test_nested_config_reads_text_config(oracle: ModuleType) -> None:
    composite = oracle.Qwen4ExpConfig(text_config=dict(TEXT))
    data = composite.to_dict()
    assert data["model_type"] == "qwen4_exp" and "eos_token_id" not in data
    ours = PleConfig.from_hf(data)
    assert ours == PleConfig.from_hf(oracle_text(oracle, TEXT).to_dict())
    assert_agrees(oracle, ours, composite.text_config)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_from_a_path_saved_by_the_oracle(tmp_path: Path, where: str, oracle: ModuleType) -> None:
    oracle.Qwen4ExpConfig(text_config=dict(TEXT)).save_pretrained(tmp_path)
    source = tmp_path / "config.json" if where == "file" else tmp_path
    ours = PleConfig.from_hf(source if where == "file" else str(source))
    import transformers

    assert_agrees(oracle, ours, transformers.AutoConfig.from_pretrained(tmp_path).text_config)


def test_defaults_equal_the_oracle_defaults(oracle: ModuleType) -> None:
    theirs = oracle.Qwen4ExpTextConfig()
    assert PleConfig() == PleConfig.from_hf({}) == PleConfig.from_hf(theirs.to_dict())
    assert_agrees(oracle, PleConfig(), theirs)
    # A composite config without a text_config builds the default text config.
    assert PleConfig.from_hf({"model_type": "qwen4_exp"}) == PleConfig()


def test_ple_off_is_valid_with_no_layers(oracle: ModuleType) -> None:
    fields = {**TEXT, "ple_layer_ids": None, "eos_token_id": None, "ple_embed_dim": 30}
    ours = PleConfig.from_hf(fields)
    assert (ours.n_layers, ours.enabled, ours.decoder_layer_indices) == (0, False, ())
    assert ours.eos_token_id is None
    assert_agrees(oracle, ours, oracle_text(oracle, fields))
    with pytest.raises(ConfigError, match="eos_token_id is not set"):
        _ = ours.eos


@pytest.mark.parametrize(
    "layer_types",
    [
        None,
        [LIN, "mamba", LIN, "full_attention", LIN, LIN],
        [LIN, LIN, LIN, "qwen_sparse_attention", LIN, LIN],
    ],
)
def test_layer_types_are_normalised_as_the_oracle_does(
    layer_types: list[str] | None, oracle: ModuleType
) -> None:
    fields = {**TEXT, "layer_types": layer_types, "num_hidden_layers": 6}
    ours = PleConfig.from_hf(fields)
    assert_agrees(oracle, ours, oracle_text(oracle, fields))


def test_full_attention_interval_shapes_the_default_layer_types(oracle: ModuleType) -> None:
    fields = {**TEXT, "layer_types": None, "full_attention_interval": 3, "ple_layer_ids": [2]}
    ours = PleConfig.from_hf(fields)
    assert ours.kinds == default_layer_types(6, 3) == (LIN, LIN, IDX, LIN, LIN, IDX)
    assert_agrees(oracle, ours, oracle_text(oracle, fields))


def test_hf_round_trip_and_extra_fields_ignored(tmp_path: Path, oracle: ModuleType) -> None:
    ours = PleConfig.from_hf(TEXT)
    data = ours.to_hf_dict()
    assert PleConfig.from_hf(data | {"num_experts": 8, "architectures": ["X"]}) == ours
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen4_exp", "text_config": data}))
    assert PleConfig.from_hf(path) == ours
    text_only = {k: v for k, v in data.items() if k != "model_type"}
    assert_agrees(oracle, ours, oracle_text(oracle, text_only))
    assert ours.replace(seed=5).seed == 5


def test_an_eos_int_and_a_list_give_the_same_eos() -> None:
    assert PleConfig.from_hf({**TEXT, "eos_token_id": 7}).eos == 7
    assert PleConfig.from_hf({**TEXT, "eos_token_id": [7, 9, 11]}).eos == 7


# -- validation ---------------------------------------------------------------------------

REFUSED_BY_BOTH: list[tuple[dict[str, Any], str, str]] = [
    # (changes, what our error says, what the oracle's error says)
    (
        {"ple_layer_ids": [0, 2]},
        "ple_layer_ids has 0; expected one-indexed ids in [1, num_hidden_layers=6]",
        "ple_layer_ids must contain one-indexed ids in [1, 6], got [0]",
    ),
    ({"ple_layer_ids": [7]}, "ple_layer_ids has 7", "got [7]"),
    (
        {"ple_layer_ids": [4]},
        "ple_layer_ids has 4, whose layer_types entry is 'indexed_attention'",
        "only supported on linear_attention layers, got PLE on layers [4]",
    ),
    (
        {"ple_embed_dim": 30},
        "ple_embed_dim=30 must be a multiple of the n-gram head count C = ",
        "30 % 4 != 0",
    ),
    ({"heads_per_ngram": 3}, "ple_embed_dim=32 must be a multiple", "32 % 6 != 0"),
    ({"ngram_size": 1}, "ngram_size=1 must be at least 2", "32 % 0 != 0"),
    ({"eos_token_id": None}, "eos_token_id=None", "eos_token_id must be set"),
    ({"eos_token_id": []}, "eos_token_id=None (null or [])", "eos_token_id must be set"),
    ({"eos_token_id": True}, "eos_token_id=True", "Field 'eos_token_id'"),
    ({"eos_token_id": [7, "x"]}, "eos_token_id=[7, 'x']", "Field 'eos_token_id'"),
    ({"hc_count": 1}, "hc_count=1", "requires hc_count > 1, got 1"),
    ({"vocab_size": 2.5}, "vocab_size=2.5", "Field 'vocab_size' expected int"),
    ({"hidden_size": "32"}, "hidden_size='32'", "Field 'hidden_size' expected int"),
    ({"vocab_size": None}, "vocab_size=None", "Field 'vocab_size' expected int"),
    ({"ple_layer_ids": [2, "5"]}, "ple_layer_ids[1]='5'", "Field 'ple_layer_ids'"),
    (
        {"layer_types": [LIN] * 5},
        "layer_types has 5 entries; expected num_hidden_layers=6",
        "must be equal to the number of `layer_types` (5)",
    ),
    (
        {"layer_types": [LIN, "attention", LIN, IDX, LIN, LIN]},
        "layer_types[1]='attention'",
        "Unsupported Qwen4-Exp layer types: ['full_attention']",
    ),
    (
        {"layer_types": [LIN, LIN, LIN, "sliding_attention", LIN, LIN]},
        "layer_types[3]='sliding_attention'",
        "Unsupported Qwen4-Exp layer types: ['sliding_attention']",
    ),
]


@pytest.mark.parametrize(
    ("changes", "needle", "oracle_says"), REFUSED_BY_BOTH, ids=lambda v: str(v)[:40]
)
def test_refuses_what_the_oracle_refuses_naming_field_and_value(
    changes: dict[str, Any], needle: str, oracle_says: str, oracle: ModuleType
) -> None:
    fields = {**TEXT, **changes}
    with pytest.raises(ConfigError) as info:
        PleConfig.from_hf(fields)
    assert needle in str(info.value), str(info.value)
    assert isinstance(info.value, EngramError)
    from huggingface_hub.errors import StrictDataclassError

    with pytest.raises((ValueError, TypeError, StrictDataclassError)) as refused:
        oracle_text(oracle, fields)
    assert oracle_says in str(refused.value), str(refused.value)


STRICTER: list[tuple[dict[str, Any], str]] = [
    ({"ple_conv_kernel_size": 0}, "ple_conv_kernel_size=0 must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"eos_token_id": -3}, "eos_token_id=-3 must be a non-negative integer"),
    ({"make_ngram_vocab_size_divisible_by": 0}, "make_ngram_vocab_size_divisible_by=0"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be a finite positive number"),
    ({"seed": 1.5}, "seed=1.5 must be an integer"),
]


@pytest.mark.parametrize(("changes", "needle"), STRICTER, ids=lambda v: str(v)[:40])
def test_refuses_values_the_oracle_accepts_but_cannot_run(
    changes: dict[str, Any], needle: str
) -> None:
    """Stricter than the reference: sizes it would take and then crash on (a kernel of 0
    taps, a divisor of 0), or hash into nonsense (a negative EOS)."""
    fields = {**TEXT, **changes}
    with pytest.raises(ConfigError) as info:
        PleConfig.from_hf(fields)
    assert needle in str(info.value), str(info.value)


def test_control_the_valid_base_config_passes_both(oracle: ModuleType) -> None:
    """The refusals above come from each change, not from the base config."""
    assert_agrees(oracle, PleConfig.from_hf(TEXT), oracle_text(oracle, TEXT))


def test_ple_checks_apply_only_when_ple_is_on(oracle: ModuleType) -> None:
    """As in the reference: with no PLE layer, E, N and the EOS are not checked."""
    fields = {**TEXT, "ple_layer_ids": [], "ple_embed_dim": 30, "eos_token_id": None}
    assert_agrees(oracle, PleConfig.from_hf(fields), oracle_text(oracle, fields))


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ({"model_type": "deepseek_v4"}, "model_type='deepseek_v4'; expected 'qwen4_exp'"),
        (
            {"model_type": "qwen4_exp", "text_config": [1]},
            "text_config=[1]; expected a JSON object",
        ),
    ],
)
def test_refuses_other_models_and_malformed_nesting(source: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        PleConfig.from_hf(source)
    assert needle in str(info.value)


def test_refuses_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        PleConfig.from_hf(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="does not exist"):
        PleConfig.from_hf(tmp_path)  # a directory without config.json
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        PleConfig.from_hf(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object; got list"):
        PleConfig.from_hf(bad)
