"""The PLE checkpoint reader against the oracle's ``save_pretrained`` and hand-written shards.

- Oracle (transformers 5.23.0): a composite (bf16) and a text-only (fp32) tiny model with two
  PLE layers, randomised, saved by ``save_pretrained``; its files hold
  ``ngram_embedding.shard_<k>.weight`` = ``torch.chunk(table, split_ngram_parts)`` (unequal,
  16 shards and, at P = 100, fewer shards than P), and the reader returns the oracle's
  ``ngram_embedding.weight`` bit for bit, whole, by rows, by tensor-parallel value slices,
  with its buffers accepted and its layer weights equal; a config with another seed is
  refused by the oracle's own buffers.
- Without the oracle, files written here the way ``save_pretrained`` writes them (the oracle
  test checks that they are): both prefixes, one file or several with an index, the
  un-sharded name, shards in numeric order (a lexicographic reader would differ: control),
  any region and block size (hypothesis), and each refusal the reader makes: a missing
  shard, a gap, a repeat, a wrong width, a row sum that is not ``R``, fp8, mixed or rounding
  dtypes, a buffer that differs (absent buffers are fine), non-finite rows and weights.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tests.families.qwen4_ple.conftest import ORACLE_MODEL_FIELDS
from tests.families.qwen4_ple.ple_checkpoints import (
    BUFFERS,
    COMPOSITE,
    CONFIG,
    FIELDS,
    LAYERS,
    ROWS,
    TEXT_ONLY,
    WIDTH,
    D,
    E,
    base,
    checkpoint_state,
    poisoned,
    random_table,
    random_weights,
    save,
    table_name,
)

from engramrt.checkpoint import SafetensorsCheckpoint
from engramrt.errors import CheckpointError, ValidationError
from engramrt.families.qwen4_ple.checkpoint import (
    PleTableRegion,
    check_ple_buffers,
    find_ple_prefix,
    iter_ple_table_blocks,
    plan_ple_table,
    read_ple_layer_weights,
    read_ple_table,
)
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.layer import PleLayerWeights

# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("prefix", [COMPOSITE, TEXT_ONLY])
@pytest.mark.parametrize("ple_index", [0, 1])
@pytest.mark.parametrize("files", [1, 3])
def test_whole_table_both_prefixes(tmp_path: Path, prefix: str, ple_index: int, files: int) -> None:
    path = save(tmp_path, checkpoint_state(prefix), files=files)
    expected = random_table(ple_index, torch.bfloat16)
    assert find_ple_prefix(path, LAYERS[ple_index]) == prefix
    out = poisoned((ROWS[ple_index], WIDTH), torch.bfloat16)
    assert read_ple_table(path, CONFIG, ple_index, out=out, block_rows=10) is out
    assert torch.equal(out, expected)
    source = path / "model.safetensors" if files == 1 else path  # a file, or a directory
    found = read_ple_table(source, CONFIG, ple_index)
    assert found.dtype == torch.bfloat16 and torch.equal(found, expected)


def test_config_from_a_directory_and_a_dict(tmp_path: Path) -> None:
    path = save(tmp_path / "ckpt", checkpoint_state(TEXT_ONLY))
    (tmp_path / "ckpt" / "config.json").write_text(
        json.dumps({"model_type": "qwen4_exp", "text_config": FIELDS})
    )
    expected = random_table(1, torch.bfloat16)
    for config in (path, str(path / "config.json"), FIELDS, CONFIG):
        assert torch.equal(read_ple_table(path, config, 1), expected)


def test_unsharded_runtime_name_is_accepted(tmp_path: Path) -> None:
    path = save(tmp_path, checkpoint_state(COMPOSITE, sharded=False))
    plan = plan_ple_table(SafetensorsCheckpoint(path), CONFIG, 0)
    assert not plan.sharded and len(plan.pieces) == 1
    assert torch.equal(read_ple_table(path, CONFIG, 0), random_table(0, torch.bfloat16))


@pytest.mark.parametrize("parts", [1, 7, 16, 100])
def test_unequal_and_fewer_shards(tmp_path: Path, parts: int) -> None:
    """torch.chunk's shards: ceil(R/P) rows, the last shorter; at P = 100 only 85 and 86."""
    path = save(tmp_path, checkpoint_state(TEXT_ONLY, parts=parts))
    with SafetensorsCheckpoint(path) as ckpt:
        for index in (0, 1):
            plan = plan_ple_table(ckpt, CONFIG, index)
            sizes = [p.row_end - p.row_begin for p in plan.pieces]
            assert sizes == [len(c) for c in torch.chunk(torch.arange(ROWS[index]), parts)]
            assert torch.equal(
                read_ple_table(ckpt, CONFIG, index), random_table(index, torch.bfloat16)
            )
    if parts == 100:
        assert len(sizes) == 86 < parts and sizes[-1] == 2
    if parts == 7:
        assert len(set(sizes)) == 2  # unequal


def test_shards_concatenate_in_numeric_order(tmp_path: Path) -> None:
    path = save(tmp_path, checkpoint_state(COMPOSITE, parts=16))
    expected = random_table(0, torch.bfloat16)
    plan = plan_ple_table(SafetensorsCheckpoint(path), CONFIG, 0)
    assert [p.name.rsplit(".", 2)[-2] for p in plan.pieces][:3] == ["shard_0", "shard_1", "shard_2"]
    assert torch.equal(read_ple_table(path, CONFIG, 0), expected)
    # Control: the names sorted as strings (shard_10 before shard_2) give another table.
    shards = torch.chunk(expected, 16)
    lexicographic = sorted(range(16), key=str)
    assert lexicographic[:3] == [0, 1, 10]
    assert not torch.equal(torch.cat([shards[k] for k in lexicographic]), expected)


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("fp32"), checkpoint_state(COMPOSITE, dtype=torch.float32))


@settings(max_examples=40, deadline=None)
@given(
    ple_index=st.integers(0, 1),
    rows=st.tuples(st.integers(0, 512), st.integers(0, 512)),
    values=st.tuples(st.integers(0, WIDTH), st.integers(0, WIDTH)),
    block_rows=st.integers(1, 80),
    into_full=st.booleans(),
)
def test_any_region_in_any_blocks(
    fp32_checkpoint: Path,
    ple_index: int,
    rows: tuple[int, int],
    values: tuple[int, int],
    block_rows: int,
    into_full: bool,
) -> None:
    row_begin, row_end = sorted(min(r, ROWS[ple_index]) for r in rows)
    region = PleTableRegion(row_begin, row_end, *sorted(values))
    table = random_table(ple_index, torch.float32)
    expected = table[row_begin:row_end, region.value_begin : region.value_end]
    if into_full:
        out = poisoned((ROWS[ple_index], WIDTH), torch.float32)
        read_ple_table(
            fp32_checkpoint, CONFIG, ple_index, region=region, out=out, block_rows=block_rows
        )
        part = out[row_begin:row_end, region.value_begin : region.value_end]
        assert torch.equal(part, expected)
        outside = torch.ones_like(out, dtype=torch.bool)
        outside[row_begin:row_end, region.value_begin : region.value_end] = False
        assert bool(out[outside].isnan().all())  # nothing else was touched
    else:
        found = read_ple_table(
            fp32_checkpoint, CONFIG, ple_index, region=region, block_rows=block_rows
        )
        assert found.shape == region.shape and torch.equal(found, expected)
    plan = plan_ple_table(fp32_checkpoint, CONFIG, ple_index)
    local = 0
    for local_row, block in iter_ple_table_blocks(plan, region, block_rows=block_rows):
        assert local_row == local and 1 <= block.shape[0] <= block_rows
        local += block.shape[0]
    assert local == (region.num_rows if region.num_values else 0)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5])
def test_width_shards_follow_torch_chunk_and_reassemble(fp32_checkpoint: Path, tp: int) -> None:
    table = random_table(1, torch.float32)
    pieces = [PleTableRegion.width_shard(ROWS[1], WIDTH, tp, rank) for rank in range(tp)]
    chunks = torch.chunk(torch.arange(WIDTH), tp)
    for rank, region in enumerate(pieces):
        chunk = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(region.value_begin, region.value_end)) == chunk
        assert region.row_begin == 0 and region.row_end == ROWS[1]
    parts = [read_ple_table(fp32_checkpoint, CONFIG, 1, region=r) for r in pieces]
    assert torch.equal(torch.cat(parts, dim=1), table)
    # A rank's view of a bigger tensor is filled in place.
    out = poisoned((ROWS[1], WIDTH), torch.float32)
    for region in pieces:
        read_ple_table(
            fp32_checkpoint,
            CONFIG,
            1,
            region=region,
            out=out[:, region.value_begin : region.value_end],
        )
    assert torch.equal(out, table)
    with pytest.raises(ValidationError, match=r"tp=2, rank=2"):
        PleTableRegion.width_shard(ROWS[1], WIDTH, 2, 2)


def test_bf16_reads_into_an_fp32_model_exactly(tmp_path: Path) -> None:
    path = save(tmp_path, checkpoint_state(TEXT_ONLY))
    found = read_ple_table(path, CONFIG, 0, dtype=torch.float32)
    assert found.dtype == torch.float32
    assert torch.equal(found, random_table(0, torch.bfloat16).float())
    weights = read_ple_layer_weights(path, CONFIG, 0, dtype=torch.float32)
    assert weights.dtype == torch.float32


def test_rounding_dtypes_are_refused(fp32_checkpoint: Path) -> None:
    with pytest.raises(
        ValidationError, match=r"stored in torch.float32; reading it as torch.bfloat16"
    ):
        read_ple_table(fp32_checkpoint, CONFIG, 0, dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match=r"stored in torch.float32"):
        read_ple_table(
            fp32_checkpoint, CONFIG, 0, out=torch.empty(ROWS[0], WIDTH, dtype=torch.float16)
        )
    with pytest.raises(ValidationError, match=r"key_proj.weight' is stored in torch.float32"):
        read_ple_layer_weights(fp32_checkpoint, CONFIG, 0, dtype=torch.bfloat16)


# --------------------------------------------------------------------------- refusals


def rewrite(
    tmp_path: Path,
    edit: Callable[[dict[str, torch.Tensor]], None],
    *,
    prefix: str = TEXT_ONLY,
    parts: int = 7,
) -> Path:
    state = checkpoint_state(prefix, parts=parts)
    edit(state)
    return save(tmp_path, state)


def test_control_the_unedited_checkpoint_reads(tmp_path: Path) -> None:
    """Every refusal below edits this checkpoint; unedited, it reads."""
    path = rewrite(tmp_path, lambda state: None)
    for index in (0, 1):
        assert torch.equal(read_ple_table(path, CONFIG, index), random_table(index, torch.bfloat16))
        assert len(check_ple_buffers(path, CONFIG, index)) == 3


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    path = rewrite(tmp_path, lambda s: s.pop(table_name(TEXT_ONLY, 0, 3)))
    with pytest.raises(CheckpointError, match=r"shard_3\.weight is missing: .* shards 0-2, 4-6"):
        read_ple_table(path, CONFIG, 0)
    # The other layer is whole and reads.
    assert torch.equal(read_ple_table(path, CONFIG, 1), random_table(1, torch.bfloat16))


def test_missing_last_shard_is_refused_by_the_row_sum(tmp_path: Path) -> None:
    path = rewrite(tmp_path, lambda s: s.pop(table_name(TEXT_ONLY, 0, 6)))
    with pytest.raises(CheckpointError, match=r"6 piece\(s\) .* hold 366 rows .* expected R = 424"):
        read_ple_table(path, CONFIG, 0)


def test_gap_in_the_shard_numbers_is_refused(tmp_path: Path) -> None:
    def renumber(state: dict[str, torch.Tensor]) -> None:
        state[table_name(TEXT_ONLY, 0, 9)] = state.pop(table_name(TEXT_ONLY, 0, 6))

    path = rewrite(tmp_path, renumber)
    with pytest.raises(CheckpointError, match=r"shard_6\.weight is missing: .* shards 0-5, 9"):
        read_ple_table(path, CONFIG, 0)


def test_repeated_shard_number_is_refused(tmp_path: Path) -> None:
    def repeat(state: dict[str, torch.Tensor]) -> None:
        repeated = table_name(TEXT_ONLY, 0).replace(".weight", ".shard_01.weight")
        state[repeated] = state[table_name(TEXT_ONLY, 0, 1)].clone()

    with pytest.raises(CheckpointError, match=r"are both shard 1"):
        read_ple_table(rewrite(tmp_path, repeat), CONFIG, 0)


def test_extra_rows_are_refused(tmp_path: Path) -> None:
    def extra(state: dict[str, torch.Tensor]) -> None:
        state[table_name(TEXT_ONLY, 0, 7)] = torch.zeros(8, WIDTH, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"8 piece\(s\) .* hold 432 rows .* expected R = 424"):
        read_ple_table(rewrite(tmp_path, extra), CONFIG, 0)


def test_short_shard_is_refused(tmp_path: Path) -> None:
    def cut(state: dict[str, torch.Tensor]) -> None:
        name = table_name(TEXT_ONLY, 1, 2)
        state[name] = state[name][:-1].contiguous()

    with pytest.raises(CheckpointError, match=r"hold 511 rows .* expected R = 512"):
        read_ple_table(rewrite(tmp_path, cut), CONFIG, 1)


def test_wrong_width_is_refused(tmp_path: Path) -> None:
    def widen(state: dict[str, torch.Tensor]) -> None:
        name = table_name(TEXT_ONLY, 0, 4)
        state[name] = torch.zeros(state[name].shape[0], WIDTH + 1, dtype=torch.bfloat16)

    with pytest.raises(
        CheckpointError,
        match=r"shard_4\.weight' in model.safetensors has shape \[61, 5\]; "
        r"expected \[rows, 4\] \(d = ple_embed_dim / C = 16 / 4 = 4\)",
    ):
        read_ple_table(rewrite(tmp_path, widen), CONFIG, 0)


def test_both_forms_of_the_table_are_refused(tmp_path: Path) -> None:
    def both(state: dict[str, torch.Tensor]) -> None:
        state[table_name(TEXT_ONLY, 0)] = random_table(0, torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"holds both .*ngram_embedding\.weight' and 7 shard"):
        read_ple_table(rewrite(tmp_path, both), CONFIG, 0)


def test_missing_table_and_unknown_names_are_refused(tmp_path: Path) -> None:
    def drop(state: dict[str, torch.Tensor]) -> None:
        for k in range(7):
            state.pop(table_name(TEXT_ONLY, 0, k))

    with pytest.raises(CheckpointError, match=r"no PLE table in .*shard_<k>\.weight"):
        read_ple_table(rewrite(tmp_path / "a", drop), CONFIG, 0)

    def odd(state: dict[str, torch.Tensor]) -> None:
        state[table_name(TEXT_ONLY, 0, 0).replace("shard_0", "shard_x")] = torch.zeros(1, WIDTH)

    with pytest.raises(CheckpointError, match=r"shard_x\.weight' is not a PLE table name"):
        read_ple_table(rewrite(tmp_path / "b", odd), CONFIG, 0)


def test_fp8_table_is_refused_by_name(tmp_path: Path) -> None:
    def fp8(state: dict[str, torch.Tensor]) -> None:
        name = table_name(TEXT_ONLY, 0, 0)
        state[name] = state[name].float().to(torch.float8_e4m3fn)

    with pytest.raises(
        CheckpointError, match=r"shard_0\.weight' is stored as F8_E4M3: the fp8 form"
    ):
        read_ple_table(rewrite(tmp_path / "a", fp8), CONFIG, 0)

    def scale(state: dict[str, torch.Tensor]) -> None:
        state[table_name(TEXT_ONLY, 0).replace("weight", "weight_scale")] = torch.ones(1)

    with pytest.raises(
        CheckpointError, match=r"weight_scale' is a scale: the fp8 form .*FP8Embedding"
    ):
        read_ple_table(rewrite(tmp_path / "b", scale), CONFIG, 0)


def test_other_dtypes_are_refused(tmp_path: Path) -> None:
    def mixed(state: dict[str, torch.Tensor]) -> None:
        name = table_name(TEXT_ONLY, 0, 5)
        state[name] = state[name].float()

    with pytest.raises(CheckpointError, match=r"shard_5\.weight' .* has dtype F32 but .*shard_0"):
        read_ple_table(rewrite(tmp_path / "a", mixed), CONFIG, 0)

    def integer(state: dict[str, torch.Tensor]) -> None:
        name = table_name(TEXT_ONLY, 0, 0)
        state[name] = torch.zeros(state[name].shape, dtype=torch.int32)

    with pytest.raises(CheckpointError, match=r"has dtype I32; expected one of BF16, F16, F32"):
        read_ple_table(rewrite(tmp_path / "b", integer), CONFIG, 0)


def test_non_finite_rows_are_refused_by_tensor_and_row(tmp_path: Path) -> None:
    def nan(state: dict[str, torch.Tensor]) -> None:
        state[table_name(TEXT_ONLY, 1, 2)][5, 3] = float("inf")

    path = rewrite(tmp_path, nan)
    with pytest.raises(
        CheckpointError, match=r"shard_2\.weight' holds inf at row 5 value 3 \(table row 153\)"
    ):
        read_ple_table(path, CONFIG, 1, block_rows=4)
    # Rows and values that avoid it read.
    region = PleTableRegion(0, ROWS[1], 0, 3)
    assert torch.equal(
        read_ple_table(path, CONFIG, 1, region=region), random_table(1, torch.bfloat16)[:, :3]
    )


@pytest.mark.parametrize("buffer", list(BUFFERS))
def test_a_differing_buffer_is_refused(tmp_path: Path, buffer: str) -> None:
    name = f"{base(TEXT_ONLY, 1)}ple_embedding.{buffer}"
    index = 2 if buffer == "layer_multipliers" else 3

    def change(state: dict[str, torch.Tensor]) -> None:
        state[name][index] += 2

    path = rewrite(tmp_path, change)
    wanted = BUFFERS[buffer][1][index]
    message = rf"'{name}' holds {wanted + 2} at index {index}; the config gives {wanted}"
    with pytest.raises(CheckpointError, match=message):
        check_ple_buffers(path, CONFIG, 1)
    with pytest.raises(CheckpointError, match=message):
        read_ple_table(path, CONFIG, 1)
    assert len(check_ple_buffers(path, CONFIG, 0)) == 3  # the other layer's are equal


def test_buffer_of_wrong_shape_or_dtype_is_refused(tmp_path: Path) -> None:
    name = f"{base(TEXT_ONLY, 0)}ple_embedding.ngram_heads_offsets"

    def short(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name][:3].clone()

    with pytest.raises(
        CheckpointError, match=r"ngram_heads_offsets' has shape \[3\] .* expected torch.int64 \[4\]"
    ):
        check_ple_buffers(rewrite(tmp_path / "a", short), CONFIG, 0)

    def narrow(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name].int()

    with pytest.raises(CheckpointError, match=r"dtype torch.int32; expected torch.int64"):
        check_ple_buffers(rewrite(tmp_path / "b", narrow), CONFIG, 0)


def test_absent_buffers_are_accepted(tmp_path: Path) -> None:
    path = save(tmp_path, checkpoint_state(COMPOSITE, buffers=False))
    assert check_ple_buffers(path, CONFIG, 0) == ()
    plan = plan_ple_table(path, CONFIG, 0)
    assert plan.buffers == ()
    assert torch.equal(read_ple_table(path, CONFIG, 0), random_table(0, torch.bfloat16))


def test_prefix_both_or_neither_is_refused(tmp_path: Path) -> None:
    state = checkpoint_state(TEXT_ONLY) | checkpoint_state(COMPOSITE)
    path = save(tmp_path / "both", state)
    with pytest.raises(
        CheckpointError, match=r"under both of model\.language_model\.layers\.0\.ple\.\*"
    ):
        read_ple_table(path, CONFIG, 0)
    assert torch.equal(
        read_ple_table(path, CONFIG, 0, prefix=COMPOSITE), random_table(0, torch.bfloat16)
    )
    other = save(tmp_path / "neither", {"model.layers.1.mlp.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"under neither of"):
        read_ple_table(other, CONFIG, 0)
    with pytest.raises(ValidationError, match=r"prefix='language_model\.'"):
        read_ple_table(path, CONFIG, 0, prefix="language_model.")


def test_bad_arguments_are_refused(fp32_checkpoint: Path) -> None:
    with pytest.raises(ValidationError, match=r"ple_index=2; expected 0 <= ple_index < 2"):
        read_ple_table(fp32_checkpoint, CONFIG, 2)
    with pytest.raises(ValidationError, match=r"region rows \[0, 425\)"):
        read_ple_table(fp32_checkpoint, CONFIG, 0, region=PleTableRegion(0, 425, 0, WIDTH))
    with pytest.raises(ValidationError, match=r"values \[3, 2\)"):
        read_ple_table(fp32_checkpoint, CONFIG, 0, region=PleTableRegion(0, 4, 3, 2))
    with pytest.raises(
        ValidationError,
        match=r"expected the region's shape \[424, 2\] or the whole table's \[424, 4\]",
    ):
        read_ple_table(
            fp32_checkpoint, CONFIG, 0, region=PleTableRegion(0, 424, 0, 2), out=torch.empty(424, 3)
        )
    with pytest.raises(ValidationError, match=r"block_rows = 0"):
        read_ple_table(fp32_checkpoint, CONFIG, 0, block_rows=0)


# --------------------------------------------------------------------------- layer weights


@pytest.mark.parametrize("prefix", [COMPOSITE, TEXT_ONLY])
def test_layer_weights(tmp_path: Path, prefix: str) -> None:
    path = save(tmp_path, checkpoint_state(prefix), files=2)
    for index in (0, 1):
        weights = read_ple_layer_weights(path, CONFIG, index)
        for field, tensor in random_weights(torch.bfloat16, index).items():
            assert torch.equal(getattr(weights, field), tensor), field


def test_layer_weight_refusals(tmp_path: Path) -> None:
    names = PleLayerWeights.checkpoint_names(LAYERS[0], TEXT_ONLY)
    path = rewrite(tmp_path / "missing", lambda s: s.pop(names["norm_conv"]))
    with pytest.raises(CheckpointError, match=r"norm_conv\.weight missing"):
        read_ple_layer_weights(path, CONFIG, 0)

    def nan(state: dict[str, torch.Tensor]) -> None:
        state[names["conv1d"]][3, 0, 1] = float("nan")

    with pytest.raises(CheckpointError, match=r"conv1d\.weight' holds nan at \[3, 0, 1\]"):
        read_ple_layer_weights(rewrite(tmp_path / "nan", nan), CONFIG, 0)

    def shape(state: dict[str, torch.Tensor]) -> None:
        state[names["value_proj"]] = torch.zeros(D, E + 4, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"key_proj has shape \[64, 16\]"):
        read_ple_layer_weights(rewrite(tmp_path / "shape", shape), CONFIG, 0)
    other = CONFIG.replace(hc_count=4)
    with pytest.raises(CheckpointError, match=r"expected hc_count=4"):
        read_ple_layer_weights(rewrite(tmp_path / "ok", lambda s: None), other, 0)


# --------------------------------------------------------------------------- the oracle


VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=D)
ORACLE_TEXT = FIELDS | ORACLE_MODEL_FIELDS | dict(rms_norm_eps=1e-6)
ORACLE_KINDS = {  # prefix: (split_ngram_parts, dtype)
    COMPOSITE: (16, torch.bfloat16),
    TEXT_ONLY: (100, torch.float32),
}


@functools.cache
def oracle_saved(
    oracle: ModuleType, prefix: str, directory: Path
) -> tuple[Path, list[torch.nn.Module]]:
    """A tiny oracle model with every PLE parameter randomised, saved by ``save_pretrained``;
    returns the directory and its PLE modules in PLE index order."""
    import transformers

    parts, dtype = ORACLE_KINDS[prefix]
    text = ORACLE_TEXT | {"split_ngram_parts": parts}
    if prefix == COMPOSITE:
        model = transformers.Qwen4ExpForConditionalGeneration(
            transformers.Qwen4ExpConfig(text_config=text, vision_config=VISION)
        )
        layers = model.model.language_model.layers
    else:
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text))
        layers = model.model.layers
    ple = [layers[i].ple for i in LAYERS]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in ple:
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=g))
    model = model.to(dtype)
    model.save_pretrained(directory)
    return directory, ple


@pytest.fixture(scope="module")
def saved(
    oracle: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, list]]:
    root = tmp_path_factory.mktemp("oracle")
    return lambda prefix: oracle_saved(oracle, prefix, root / prefix.strip("."))


@pytest.mark.parametrize("prefix", [COMPOSITE, TEXT_ONLY])
def test_oracle_save_writes_torch_chunk_shards(saved: Callable, prefix: str) -> None:
    """What the files above mimic: ``save_pretrained`` writes ``torch.chunk(table, P)`` as
    ``shard_<k>``, and the buffers as int64; our writer gives the same names and shapes."""
    directory, ple = saved(prefix)
    parts, dtype = ORACLE_KINDS[prefix]
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        for index, module in enumerate(ple):
            table = module.ple_embedding.ngram_embedding.weight
            assert table.dtype == dtype and tuple(table.shape) == (ROWS[index], WIDTH)
            chunks = torch.chunk(table.detach(), parts)
            assert len(chunks) < parts if parts == 100 else len(chunks) == parts
            stored = sorted(
                n for n in names if ".ngram_embedding." in n and f"layers.{LAYERS[index]}." in n
            )
            assert stored == sorted(table_name(prefix, index, k) for k in range(len(chunks)))
            for k, chunk in enumerate(chunks):
                assert torch.equal(handle.get_tensor(table_name(prefix, index, k)), chunk)
            emb = f"{base(prefix, index)}ple_embedding."
            assert handle.get_tensor(f"{emb}layer_multipliers").dtype == torch.int64
            assert table_name(prefix, index) not in names
    ours = checkpoint_state(prefix, parts=parts, dtype=dtype)
    ple_names = {n for n in names if ".ple." in n}
    assert ple_names == set(ours)
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        for name in ple_names:
            assert handle.get_slice(name).get_shape() == list(ours[name].shape), name


@pytest.mark.parametrize("prefix", [COMPOSITE, TEXT_ONLY])
@pytest.mark.parametrize("ple_index", [0, 1])
def test_reader_returns_the_oracle_table_bit_for_bit(
    saved: Callable, prefix: str, ple_index: int
) -> None:
    directory, ple = saved(prefix)
    module = ple[ple_index]
    table = module.ple_embedding.ngram_embedding.weight.detach()
    config = PleConfig.from_hf(directory)
    assert find_ple_prefix(directory, LAYERS[ple_index]) == prefix
    found = read_ple_table(directory, config, ple_index, block_rows=23)
    assert found.dtype == table.dtype and torch.equal(found, table)
    assert len(check_ple_buffers(directory, config, ple_index)) == 3
    for name, buffer in module.ple_embedding.named_buffers():
        assert buffer.tolist() == BUFFERS[name][ple_index].tolist(), name
    rows = PleTableRegion(100, 333, 1, 3)
    assert torch.equal(
        read_ple_table(directory, config, ple_index, region=rows, block_rows=9), table[100:333, 1:3]
    )
    ranks = [PleTableRegion.width_shard(ROWS[ple_index], WIDTH, 3, rank) for rank in range(3)]
    shards = [read_ple_table(directory, config, ple_index, region=r) for r in ranks]
    assert torch.equal(torch.cat(shards, dim=1), table)
    weights = read_ple_layer_weights(directory, config, ple_index)
    for field in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d"):
        assert torch.equal(getattr(weights, field), getattr(module, field).weight), field


def test_oracle_buffers_refuse_another_seed(saved: Callable) -> None:
    directory, _ = saved(COMPOSITE)
    other = PleConfig.from_hf(directory).replace(seed=1235)
    with pytest.raises(
        CheckpointError, match=r"layer_multipliers' holds \d+ at index 0; the config gives \d+"
    ):
        read_ple_table(directory, other, 0)
