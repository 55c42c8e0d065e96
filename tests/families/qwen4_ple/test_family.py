"""Qwen4-Exp PLE described as a memory family: its tables are its hash constants', its
checkpoint names are the reference's, its fingerprint follows the hash."""

from __future__ import annotations

import pytest

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.family import Qwen4PleFamily
from engramrt.families.qwen4_ple.ids import PleConstants
from engramrt.family import BF16, MemoryFamily, resolve_family


def _config(**changes) -> PleConfig:
    fields = {"ple_layer_ids": (2, 3), "ple_embed_dim": 32, "hidden_size": 16, "hc_count": 2,
              "heads_per_ngram": 2, "ngram_size": 3, "vocab_size": 101,
              "ngram_vocab_size_base": 50, "eos_token_id": 1, "num_hidden_layers": 4}  # fmt: skip
    return PleConfig(**{**fields, **changes})


def test_tables_are_the_hash_constants() -> None:
    cfg = _config()
    family = resolve_family("qwen4-ple")(cfg)
    assert isinstance(family, Qwen4PleFamily) and isinstance(family, MemoryFamily)
    consts = PleConstants.from_config(cfg)
    tables = family.tables()
    assert [t.layer_id for t in tables] == [2, 3] and family.history_window == 2
    for index, table in enumerate(tables):
        assert table.row_format is BF16 and table.shard == "width"
        assert table.width == 32 // 4 and table.row_bytes == 16
        assert table.rows == consts.table_rows[index] and table.rows % 128 == 0
        assert list(table.col_rows) == consts.head_sizes[index].tolist()
        assert table.col_offsets[0] == 0
        assert table.col_offsets[-1] + table.col_rows[-1] == consts.addressed_rows[index]


def test_the_default_constants_make_a_95_gib_table() -> None:
    """SPEC-quoted figure: l = 0 at the default constants has 320,001,536 rows; at d = 160
    (E = 2560, C = 16) that is 95.4 GiB of bf16."""
    cfg = PleConfig(ple_layer_ids=(2,), ple_embed_dim=2560, eos_token_id=248_044)
    (table,) = Qwen4PleFamily(cfg).tables()
    assert table.rows == 320_001_536 and table.width == 160
    assert round(table.nbytes / 2**30, 1) == 95.4


def test_tensor_roles_follow_the_checkpoint_names() -> None:
    family = Qwen4PleFamily(_config())
    roles = {(r.layer_id, r.role): r for r in family.tensor_roles()}
    table = roles[(2, "table")]
    assert table.name == "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.weight"
    assert roles[(3, "conv1d")].name == "model.language_model.layers.2.ple.conv1d.weight"
    assert roles[(3, "conv1d")].shape == (2 * 16, 1, 4)
    assert roles[(2, "key_proj")].shape == (2 * 16, 32)
    assert roles[(2, "value_proj")].shape == (16, 32)
    assert roles[(2, "ngram_heads_offsets")].optional and not table.optional
    text_only = Qwen4PleFamily(_config(), prefix="model.")
    assert text_only.tensor_roles()[0].name.startswith("model.layers.1.ple.")
    with pytest.raises(ValidationError, match=r"prefix='x.'; expected one of"):
        Qwen4PleFamily(_config(), prefix="x.")


def test_names_match_the_oracle_modules_parameters(oracle) -> None:
    """Every role is a state-dict key of the reference's PLE layer, with the same shape (a
    checkpoint stores the table as row shards; the loader concatenates them)."""
    from transformers import Qwen4ExpTextConfig

    cfg = _config()
    text = Qwen4ExpTextConfig(**cfg.to_hf_dict())
    layer = oracle.Qwen4ExpTextPLELayer(text, layer_idx=1, ple_layer_index=0)
    state = {f"model.layers.1.ple.{k}": v for k, v in layer.state_dict().items()}
    roles = [r for r in Qwen4PleFamily(cfg, prefix="model.").tensor_roles() if r.layer_id == 2]
    for role in roles:
        assert role.name in state, role.name
        assert tuple(state[role.name].shape) == role.shape, role.name


def test_fingerprint_follows_the_hash() -> None:
    base = Qwen4PleFamily(_config()).fingerprint()
    assert Qwen4PleFamily(_config()).fingerprint() == base
    for changed in (_config(seed=7), _config(eos_token_id=2), _config(ngram_vocab_size_base=60)):
        assert Qwen4PleFamily(changed).fingerprint() != base
    with pytest.raises(ValidationError, match=r"ple_layer_ids=\[\] \(PLE off\)"):
        Qwen4PleFamily(_config(ple_layer_ids=()))
