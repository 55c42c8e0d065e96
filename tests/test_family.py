"""The memory family as a value: row formats, table specs, the registry, and DeepSeek Engram
described by one (checked against the layout and config that compute it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.families.deepseek_engram import DeepSeekEngramFamily
from engramrt.family import (
    BF16,
    FP8_UE8M0,
    MemoryFamily,
    TableSpec,
    family_names,
    register_family,
    resolve_family,
)
from engramrt.layout import EngramLayout


def test_row_formats_bytes() -> None:
    assert FP8_UE8M0.row_bytes(256) == 256 + 8  # 264 B, DeepSeek-V4.1's row
    assert BF16.row_bytes(160) == 320
    assert {FP8_UE8M0.kernel_id, BF16.kernel_id} == {0, 1}
    with pytest.raises(ValidationError, match=r"width=100 for row format 'fp8-ue8m0-32'"):
        FP8_UE8M0.row_bytes(100)
    for bad in (0, -32, True, 32.0):
        with pytest.raises(ValidationError, match=r"width=.*expected a positive int"):
            BF16.row_bytes(bad)  # type: ignore[arg-type]


def test_table_spec_refuses_rows_its_columns_overrun() -> None:
    spec = TableSpec(7, rows=30, width=32, row_format=FP8_UE8M0, col_offsets=(0, 11),
                     col_rows=(11, 13))  # fmt: skip
    assert spec.num_cols == 2 and spec.row_bytes == 33 and spec.nbytes == 30 * 33
    with pytest.raises(ValidationError, match=r"rows=23 for layer 7; .* up to 24"):
        dataclasses.replace(spec, rows=23)
    with pytest.raises(ValidationError, match=r"expected one per hash column"):
        dataclasses.replace(spec, col_rows=(11,))
    with pytest.raises(ValidationError, match=r"shard='rows'; expected one of"):
        dataclasses.replace(spec, shard="rows")


def test_registry_resolves_by_name_and_names_what_it_knows(monkeypatch) -> None:
    import engramrt.family as family_module

    monkeypatch.setattr(family_module, "_REGISTRY", dict(family_module._REGISTRY))
    assert {"deepseek-engram", "qwen4-ple"} <= set(family_names())
    assert resolve_family("deepseek-engram") is DeepSeekEngramFamily
    with pytest.raises(ValidationError, match=r"family='llama'; expected one of .*deepseek-engram"):
        resolve_family("llama")
    with pytest.raises(ValidationError, match=r"target='no_colon'.*'package.module:Class'"):
        register_family("broken", "no_colon")
    register_family("missing-module", "engramrt.no_such_module:Family")
    with pytest.raises(ValidationError, match=r"'missing-module' is registered as .*cannot be"):
        resolve_family("missing-module")


def test_naming_a_family_imports_nothing() -> None:
    """The registry holds strings: importing it loads no family module."""
    code = (
        "import sys, engramrt.family as f; f.family_names(); "
        "print(sorted(m for m in sys.modules if m.startswith('engramrt.families')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = code.replace("f.family_names()", "f.resolve_family('deepseek-engram')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "engramrt.families.deepseek_engram" in out.stdout  # control: resolving imports it


@pytest.mark.parametrize("preset", ["tiny", "dsv41-flash"])
def test_deepseek_tables_are_the_layouts(preset: str) -> None:
    family = DeepSeekEngramFamily(preset)
    assert isinstance(family, MemoryFamily)
    cfg, layout = PRESETS[preset], EngramLayout(PRESETS[preset])
    tables = family.tables()
    assert [t.layer_id for t in tables] == list(cfg.layer_ids) == list(family.layer_ids)
    assert family.history_window == cfg.max_ngram_size - 1
    for index, table in enumerate(tables):
        assert table.row_format is FP8_UE8M0 and table.width == cfg.head_dim
        assert table.rows == cfg.num_embeddings[index]
        assert table.nbytes == layout.table_bytes(index)
        assert list(table.col_offsets) == layout.offsets[index].tolist()
        assert sum(table.col_rows) == layout.num_embeddings[index]
        shard = layout.column_shard(index, 2, 1)
        assert table.col_offsets[shard.col_begin] == shard.row_begin
    if preset == "dsv41-flash":
        assert round(tables[0].nbytes / 2**30, 1) == 94.4


def test_deepseek_tensor_roles_follow_the_checkpoint_names() -> None:
    family = DeepSeekEngramFamily("tiny")
    cfg = PRESETS["tiny"]
    roles = {(r.layer_id, r.role): r for r in family.tensor_roles()}
    layer = cfg.layer_ids[0]
    table = roles[(layer, "table")]
    assert table.name == f"layers.{layer}.engram.embed.weight"
    assert table.shape == (cfg.num_embeddings[0], cfg.head_dim)
    assert roles[(layer, "scale")].shape == (cfg.num_embeddings[0], cfg.head_dim // 32)
    assert roles[(layer, "wkv")].shape == (
        (cfg.hc_mult + 1) * cfg.hidden_size,
        cfg.n_cols * cfg.head_dim,
    )
    assert roles[(layer, "wkv_scale")].optional and not table.optional
    assert len(roles) == 6 * cfg.n_layers


def test_deepseek_fingerprint_follows_the_hash(token_map) -> None:
    tiny = PRESETS["tiny"]
    assert DeepSeekEngramFamily(tiny).fingerprint() == DeepSeekEngramFamily("tiny").fingerprint()
    reseeded = dataclasses.replace(tiny, hash_seed=tiny.hash_seed + 1)
    assert DeepSeekEngramFamily(reseeded).fingerprint() != DeepSeekEngramFamily(tiny).fingerprint()
    with_map = DeepSeekEngramFamily(tiny, token_map).fingerprint()
    assert with_map != DeepSeekEngramFamily(tiny).fingerprint()
    with pytest.raises(ValidationError, match=r"config='huge'; expected one of"):
        DeepSeekEngramFamily("huge")
