"""Converting float tables to fp8 + ue8m0 files: exact bytes, rank files, atomicity, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engramrt.checkpoint import convert as convert_module
from engramrt.checkpoint import (
    convert_checkpoint,
    output_paths,
    plan_conversion,
    read_header,
    read_table,
)
from engramrt.checkpoint.conversion_set import MANIFEST_NAME
from engramrt.errors import CapacityError, CheckpointError, ShardingError
from engramrt.layout import EngramLayout
from engramrt.lookup import pack_rows
from engramrt.quant import quantize_rows

from .conftest import (
    SCALE,
    WEIGHT,
    bytes_without_conversion_id,
    float_tables,
    reference_packed,
    synthetic_config,
)

SOURCE = "engram.{layer}.weight"


def _write_source(path, config, tables, template=SOURCE):
    save_file(
        {
            template.format(layer=layer, index=index): t
            for index, (layer, t) in enumerate(zip(config.layer_ids, tables, strict=True))
        },
        str(path),
    )
    return path


def test_tiny_conversion_equals_quantize_rows_bit_for_bit(tmp_path, tiny, tiny_tables) -> None:
    tables, packed = tiny_tables
    src = _write_source(tmp_path / "src.safetensors", tiny, tables)
    progress: list[int] = []
    (path,) = convert_checkpoint(src, tmp_path / "dst", tiny, on_rows=progress.append)
    assert path == tmp_path / "dst" / "engram.safetensors"
    assert sum(progress) == sum(tiny.num_embeddings) and len(progress) == tiny.n_layers
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        for layer, table, want in zip(tiny.layer_ids, tables, packed, strict=True):
            values = f.get_tensor(WEIGHT.format(layer=layer))
            scales = f.get_tensor(SCALE.format(layer=layer))
            assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
            v, s = quantize_rows(table, backend="reference")
            assert torch.equal(values.view(torch.uint8), v.view(torch.uint8))
            assert torch.equal(scales, s)
            assert torch.equal(pack_rows(values, scales), want)
    assert metadata["engramrt_config"] == "tiny" and metadata["engramrt_tp"] == "1"
    layers = json.loads(metadata["engramrt_layers"])
    assert [(x["layer"], x["row_begin"], x["row_end"]) for x in layers] == [
        (layer, 0, rows) for layer, rows in zip(tiny.layer_ids, tiny.num_embeddings, strict=True)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_float_source_dtype_and_block_size_gives_the_same_bytes(tmp_path, small, dtype):
    tables = float_tables(small, seed=11, dtype=dtype)
    src = _write_source(tmp_path / "src.safetensors", small, tables)
    (one,) = convert_checkpoint(src, tmp_path / "a.safetensors", small, block_rows=7)
    (two,) = convert_checkpoint(src, tmp_path / "b.safetensors", small)
    assert bytes_without_conversion_id(one) == bytes_without_conversion_id(two)
    assert one.read_bytes() != two.read_bytes()  # each conversion has its own id
    for layer_index, want in enumerate(reference_packed(tables)):
        assert torch.equal(read_table(one, small, layer_index), want)


def test_conversion_on_the_gpu_writes_the_cpu_bytes(tmp_path, small, device) -> None:
    if device.type == "cpu":
        pytest.skip("compares a conversion on the GPU with the CPU's")
    tables = float_tables(small, seed=12, dtype=torch.float32)
    src = _write_source(tmp_path / "src.safetensors", small, tables)
    (on_cpu,) = convert_checkpoint(src, tmp_path / "cpu.safetensors", small, block_rows=5)
    (on_gpu,) = convert_checkpoint(
        src, tmp_path / "gpu.safetensors", small, block_rows=5, device=device
    )
    assert bytes_without_conversion_id(on_gpu) == bytes_without_conversion_id(on_cpu)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_rank_files_hold_only_their_rows(tmp_path, tiny, tiny_tables, tp) -> None:
    tables, packed = tiny_tables
    src = _write_source(tmp_path / "src.safetensors", tiny, tables)
    paths = convert_checkpoint(
        src, tmp_path / "dst", tiny, tp=tp, scale_dtype="e8m0", block_rows=3001
    )
    assert paths == output_paths(tmp_path / "dst", tp)
    assert [p.name for p in paths] == [f"engram-rank{r}-of-{tp}.safetensors" for r in range(tp)]
    layout = EngramLayout(tiny)
    for rank, path in enumerate(paths):
        header = read_header(path)
        assert (header.metadata["engramrt_tp"], header.metadata["engramrt_rank"]) == (
            str(tp),
            str(rank),
        )
        assert header.metadata["engramrt_scale_dtype"] == "e8m0"
        layers = json.loads(header.metadata["engramrt_layers"])
        for layer_index, layer in enumerate(tiny.layer_ids):
            shard = layout.column_shard(layer_index, tp, rank)
            assert header.tensors[WEIGHT.format(layer=layer)].shape == (
                shard.num_rows,
                tiny.head_dim,
            )
            assert header.tensors[SCALE.format(layer=layer)].dtype == "F8_E8M0"
            assert (layers[layer_index]["row_begin"], layers[layer_index]["row_end"]) == (
                shard.row_begin,
                shard.row_end,
            )
            assert (layers[layer_index]["col_begin"], layers[layer_index]["col_end"]) == (
                shard.col_begin,
                shard.col_end,
            )
            # A rank loads from its own file alone.
            got = read_table(path, tiny, layer_index, tp=tp, rank=rank)
            assert torch.equal(got, packed[layer_index][shard.row_begin : shard.row_end])
    # The directory of rank files serves a tp=1 reader too (rows stitched across files).
    full = read_table(tmp_path / "dst", tiny, 1)
    assert torch.equal(full, packed[1][: int(layout.rows_needed[1])])


def test_tables_with_more_rows_than_the_layout_needs(tmp_path) -> None:
    config = synthetic_config(extra_rows=(5, 0, 17))
    tables = float_tables(config, seed=4)
    packed = reference_packed(tables)
    src = _write_source(tmp_path / "src.safetensors", config, tables)
    (full,) = convert_checkpoint(src, tmp_path / "full.safetensors", config)
    assert read_header(full).tensors[WEIGHT.format(layer=7)].shape[0] == config.num_embeddings[2]
    ranks = convert_checkpoint(src, tmp_path / "ranks", config, tp=2)
    layout = EngramLayout(config)
    for rank, path in enumerate(ranks):
        shard = layout.column_shard(2, 2, rank)
        assert read_header(path).tensors[WEIGHT.format(layer=7)].shape[0] == shard.num_rows
        for source in (full, path):
            got = read_table(source, config, 2, tp=2, rank=rank)
            assert torch.equal(got, packed[2][shard.row_begin : shard.row_end])


def test_source_directory_with_index_and_demo_names(tmp_path, small) -> None:
    """Float tables named as DeepSeek's demo module nests them, spread over indexed files."""
    tables = float_tables(small, seed=6, dtype=torch.bfloat16)
    demo = "layers.{layer}.engram.multi_head_embedding.embedding.weight"
    directory = tmp_path / "model"
    directory.mkdir()
    weight_map = {}
    for i, (layer, table) in enumerate(zip(small.layer_ids, tables, strict=True)):
        name = demo.format(layer=layer)
        save_file(
            {name: table, f"layers.{layer}.other": torch.ones(3)},
            str(directory / f"p{i}.safetensors"),
        )
        weight_map[name] = f"p{i}.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(small.to_hf_dict()))
    (path,) = convert_checkpoint(directory, tmp_path / "out.safetensors", directory)
    for layer_index, want in enumerate(reference_packed(tables)):
        assert torch.equal(read_table(path, small, layer_index), want)


def test_names_override_for_source_and_output(tmp_path, small) -> None:
    tables = float_tables(small, seed=8)
    src = _write_source(tmp_path / "src.safetensors", small, tables, template="emb.{index}")
    names = {"source": "emb.{index}", "weight": "t.{layer}.w", "scale": {0: "s0", 5: "s5", 7: "s7"}}
    (path,) = convert_checkpoint(src, tmp_path / "out.safetensors", small, names=names)
    assert set(read_header(path).tensors) == {"t.0.w", "t.5.w", "t.7.w", "s0", "s5", "s7"}
    for layer_index, want in enumerate(reference_packed(tables)):
        assert torch.equal(read_table(path, small, layer_index, names=names), want)
    with pytest.raises(
        CheckpointError,
        match=r"layer 0: no weight tensor 'layers\.0\.engram\.embed\.weight' or 'model\.layers\.0",
    ):
        read_table(path, small, 0)


# --- atomicity and capacity ----------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 3])
def test_interrupted_conversion_leaves_nothing_that_loads(tmp_path, small, monkeypatch, tp):
    tables = float_tables(small, seed=3)
    src = _write_source(tmp_path / "src.safetensors", small, tables)
    dst = tmp_path / "dst"
    real_quantize = convert_module.quantize_rows
    calls = {"n": 0}

    def failing_quantize(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("simulated crash mid-conversion")
        return real_quantize(*args, **kwargs)

    monkeypatch.setattr(convert_module, "quantize_rows", failing_quantize)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(src, dst, small, tp=tp, block_rows=50)
    assert calls["n"] == 6
    assert list(dst.iterdir()) == []  # neither a destination file nor a temporary one
    with pytest.raises(CheckpointError, match="holds no"):
        read_table(dst, small, 0)

    # A complete earlier conversion survives a failed one untouched.
    monkeypatch.setattr(convert_module, "quantize_rows", real_quantize)
    paths = convert_checkpoint(src, dst, small, tp=tp)
    before = [p.read_bytes() for p in paths]
    calls["n"] = 0
    monkeypatch.setattr(convert_module, "quantize_rows", failing_quantize)
    other = _write_source(tmp_path / "other.safetensors", small, float_tables(small, seed=99))
    with pytest.raises(RuntimeError):
        convert_checkpoint(other, dst, small, tp=tp, block_rows=50)
    assert [p.read_bytes() for p in paths] == before
    assert sorted(dst.iterdir()) == sorted([*paths, dst / MANIFEST_NAME])


def test_not_enough_disk_is_refused_before_writing(tmp_path, small, monkeypatch) -> None:
    src = _write_source(tmp_path / "src.safetensors", small, float_tables(small, seed=3))
    plan = plan_conversion(src, tmp_path / "dst", small, tp=2)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=plan.nbytes - 1))
    with pytest.raises(CapacityError, match=f"needs {plan.nbytes} bytes .* only {plan.nbytes - 1}"):
        convert_checkpoint(src, tmp_path / "dst", small, tp=2)
    assert not (tmp_path / "dst").exists() or list((tmp_path / "dst").iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=plan.nbytes))
    paths = convert_checkpoint(src, tmp_path / "dst", small, tp=2)
    assert sum(p.stat().st_size for p in paths) == plan.nbytes


# --- refusals -----------------------------------------------------------------------


def test_conversion_refusals(tmp_path, small) -> None:
    tables = float_tables(small, seed=5)
    src = _write_source(tmp_path / "src.safetensors", small, tables)
    dst = tmp_path / "dst"
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint(tmp_path / "missing", dst, small)
    with pytest.raises(ShardingError, match="tp=5"):
        convert_checkpoint(src, dst, small, tp=5)
    with pytest.raises(CheckpointError, match="is a file; expected a directory for tp=2"):
        convert_checkpoint(src, tmp_path / "x.safetensors", small, tp=2)
    with pytest.raises(CheckpointError, match="is a source file"):
        convert_checkpoint(src, src, small)
    with pytest.raises(CheckpointError, match="scale_dtype = 'bf16'"):
        convert_checkpoint(src, dst, small, scale_dtype="bf16")
    assert not dst.exists()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            lambda t: t.pop("engram.5.weight"),
            r"layer 5: no source tensor 'layers\.5\..*' or "
            r"'layers\.5\..*' or 'engram\.5\.weight' in .*src\.safetensors",
        ),
        (
            lambda t: t.update({"engram.5.weight": t["engram.5.weight"][:-1].contiguous()}),
            r"'engram\.5\.weight' in src\.safetensors \(layer 5 source\) has shape \[433, 96\]; "
            r"expected \[434, 96\]",
        ),
        (
            lambda t: t.update({"engram.5.weight": t["engram.5.weight"][:, :64].contiguous()}),
            r"has shape \[434, 64\]; expected \[434, 96\] \(engram_head_dim = 96\)",
        ),
        (
            lambda t: t.update({"engram.5.weight": t["engram.5.weight"].to(torch.float8_e4m3fn)}),
            r"has dtype F8_E4M3; expected BF16 .* or F16 .* or F32",
        ),
    ],
    ids=["missing", "rows", "head_dim", "dtype"],
)
def test_bad_source_tensors(tmp_path, small, change, needle) -> None:
    tensors = {
        f"engram.{layer}.weight": t
        for layer, t in zip(small.layer_ids, float_tables(small, seed=5), strict=True)
    }
    change(tensors)
    save_file(tensors, str(tmp_path / "src.safetensors"))
    with pytest.raises(CheckpointError, match=needle):
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "dst", small)
    assert not (tmp_path / "dst").exists()


def test_non_finite_source_names_the_row(tmp_path, small) -> None:
    tables = float_tables(small, seed=5)
    tables[2][123, 45] = float("nan")
    src = _write_source(tmp_path / "src.safetensors", small, tables)
    with pytest.raises(
        CheckpointError, match=r"'engram\.7\.weight' \(layer 7\) has nan at \[123, 45\]"
    ):
        convert_checkpoint(src, tmp_path / "dst", small, block_rows=50)
    assert list((tmp_path / "dst").iterdir()) == []
