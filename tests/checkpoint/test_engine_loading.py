"""DeepSeek-V4.1 checkpoints, with exactly the tensor names engines read, load with no names.

The checkpoints are written here with ``safetensors`` itself in Hugging Face's
sharded layout (``model.safetensors.index.json``, one layer's tensors spread
over several files, unrelated model tensors beside them), with and without
``model.``, with ``weight_scale_inv`` or ``scale``. Rows are checked against a
dequantisation of the stored bytes done in this file (SPEC §6: the scale byte
``b`` shifted into an fp32 exponent), every row of the rank's columns.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tests.helpers import finite_packed_table
from tests.layer.common import random_weights

from engramrt.checkpoint import EngramWeightLoader, convert_checkpoint, load_layer, load_table
from engramrt.checkpoint.safetensors_format import read_header
from engramrt.config import PRESETS
from engramrt.errors import CheckpointError, ValidationError
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement, tier_class

CONFIG = PRESETS["tiny"]  # layers [1, 3], C = 12, E = 64, D = 256, hc = 4
LAYOUT = EngramLayout(CONFIG)
E = CONFIG.head_dim


def placed(
    tier: str = "host", tp: int = 1, rank: int = 0, disk_dir: Path | None = None
) -> TablePlacement:
    """``tier`` on the CPU with the interpreter-free lookup (for speed), rank ``rank`` of ``tp``."""
    options = tier_class(tier).options_type(backend="reference")  # type: ignore[call-arg]
    return TablePlacement(options, device="cpu", tp=tp, rank=rank, disk_dir=disk_dir)


def _tables() -> list[torch.Tensor]:
    return [
        finite_packed_table(rows, E, seed=40 + i) for i, rows in enumerate(CONFIG.num_embeddings)
    ]


TABLES = _tables()
HEADS = [random_weights(50 + i, fp8=True) for i in range(CONFIG.n_layers)]


def v41_tensors(
    prefix: str, scale: str, *, scale_dtype: torch.dtype = torch.float8_e8m0fnu
) -> dict[str, torch.Tensor]:
    """Every Engram tensor of CONFIG under DeepSeek-V4.1's names, written out by hand."""
    tensors = {}
    for layer_id, table, head in zip(CONFIG.layer_ids, TABLES, HEADS, strict=True):
        base = f"{prefix}layers.{layer_id}.engram."
        tensors[base + "embed.weight"] = table[:, :E].contiguous().view(torch.float8_e4m3fn)
        tensors[base + f"embed.{scale}"] = table[:, E:].contiguous().view(scale_dtype)
        tensors[base + "wkv.weight"] = head["wkv"]
        tensors[base + f"wkv.{scale}"] = head["wkv_scale"]
        tensors[base + "q_weight"] = head["q_weight"]
        tensors[base + "k_weight"] = head["k_weight"]
    return tensors


def unrelated(prefix: str) -> dict[str, torch.Tensor]:
    """Backbone tensors an engine also feeds (none contains '.engram.')."""
    return {
        f"{prefix}embed_tokens.weight": torch.randn(7, 5),
        f"{prefix}layers.1.attn.wq.weight": torch.randn(3, 4).bfloat16(),
        f"{prefix}layers.3.ffn.experts.0.w1.scale": torch.ones(1, 1),
        f"{prefix}layers.3.embed.weight": torch.randn(2, 2),  # an 'embed' outside Engram
    }


def write_hf_checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Three shards, names dealt round-robin (so a layer's values and scales sit in different
    files), plus ``model.safetensors.index.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for i, name in enumerate(names):
        shards[i % 3][name] = tensors[name]
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(shard, str(directory / file_name))
        weight_map.update(dict.fromkeys(shard, file_name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return directory


def iter_checkpoint(directory: Path):
    """``(name, tensor)`` pairs of every file, as an engine's iterator yields them."""
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """``[n, E + E/32]`` packed bytes -> ``[n, E]`` bf16, written from SPEC §6."""
    values = packed[:, :E].contiguous().view(torch.float8_e4m3fn).float()
    scales = (packed[:, E:].to(torch.int32) << 23).view(torch.float32)  # 2**(b - 127)
    return (values * scales.repeat_interleave(32, dim=1)).to(torch.bfloat16)


def assert_store_holds_shard(store, layer_index: int, tp: int, rank: int) -> None:
    """Every row of the rank's columns equals the stored bytes dequantised; other columns 0."""
    shard = LAYOUT.column_shard(layer_index, tp, rank)
    assert (store.row_begin, store.row_end) == (shard.row_begin, shard.row_end)
    offsets = torch.from_numpy(LAYOUT.offsets[layer_index].copy())  # [C]
    primes = torch.from_numpy(LAYOUT.col_primes[layer_index].copy())  # [C]
    steps = torch.arange(int(primes.max()))[:, None]  # [T, 1]
    row_ids = offsets + steps % primes  # [T, C]: column c walks all its prime_c rows
    got = store.lookup(row_ids).cpu()  # [T, C, E]
    want = dequantize(TABLES[layer_index][row_ids.reshape(-1)]).view(got.shape)
    owned = torch.zeros(CONFIG.n_cols, dtype=torch.bool)
    owned[shard.col_begin : shard.col_end] = True
    want[:, ~owned] = 0
    assert bool(owned.any()) and int(owned.sum()) == shard.col_end - shard.col_begin
    mismatch = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.shape[0]} values differ, first {mismatch[:4].tolist()}"
    )


def assert_head_holds(head: EngramHead, layer_index: int) -> None:
    reference = EngramHead(CONFIG, device="cpu")
    reference.load_weights(**HEADS[layer_index])
    for got, want in (
        (head.wkv.weight, reference.wkv.weight),
        (head.q_weight, HEADS[layer_index]["q_weight"]),
        (head.k_weight, HEADS[layer_index]["k_weight"]),
    ):
        assert torch.equal(got.detach().cpu().view(torch.int16), want.view(torch.int16))


SPELLINGS = [
    ("model.", "weight_scale_inv"),
    ("", "weight_scale_inv"),
    ("", "scale"),
    ("model.", "scale"),
]


@pytest.fixture(scope="module", params=SPELLINGS, ids=lambda p: f"{p[0] or 'bare.'}{p[1]}")
def hf_checkpoint(request, tmp_path_factory) -> Path:
    prefix, scale = request.param
    directory = tmp_path_factory.mktemp("hf")
    tensors = {**v41_tensors(prefix, scale), **unrelated(prefix)}
    return write_hf_checkpoint(directory, tensors)


# --- the files, read by name (load_table / load_layer) -----------------------------------


@pytest.mark.parametrize(("tp", "tier"), [(1, "device"), (2, "host"), (4, "disk")])
def test_hf_checkpoint_loads_with_no_names(hf_checkpoint, tmp_path, tp, tier) -> None:
    rank = tp - 1
    for layer_index in range(CONFIG.n_layers):
        store = load_table(
            hf_checkpoint, CONFIG, layer_index, placed(tier, tp, rank, tmp_path), block_rows=777
        )
        assert store.tier == tier
        assert_store_holds_shard(store, layer_index, tp, rank)
    if (
        tp == 1 and tier == "device"
    ):  # a layer over a column shard needs an exchange (tests/layer/test_parallel.py)
        layer = load_layer(hf_checkpoint, CONFIG, 1, placed("device"), max_tokens=4)
        assert_head_holds(layer.head, 1)
        assert_store_holds_shard(layer.source, 1, 1, 0)


# --- the engine's iterator (EngramWeightLoader.load_weights) ------------------------------


def _loader(tp: int, rank: int, tier: str = "host", tmp_path: Path | None = None, **kw):
    heads = [EngramHead(CONFIG, device="cpu") for _ in CONFIG.layer_ids]
    return EngramWeightLoader(
        CONFIG, placed(tier, tp, rank, tmp_path), heads=heads, block_rows=1000, **kw
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_load_weights_from_the_checkpoint_iterator(hf_checkpoint, tp) -> None:
    for rank in sorted({0, tp - 1}):
        loader = _loader(tp, rank, tier="device")
        used = loader.load_weights(iter_checkpoint(hf_checkpoint))
        assert len(used) == 6 * CONFIG.n_layers and all(".engram." in n for n in used)
        stores = loader.finish()
        for layer_index, store in enumerate(stores):
            assert_store_holds_shard(store, layer_index, tp, rank)
            assert_head_holds(loader.heads[layer_index], layer_index)


@pytest.mark.parametrize("order", ["shuffled", "scales first", "values first", "reversed"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_load_weights_in_any_order(tmp_path, order, tier) -> None:
    tp, rank = 4, 2
    pairs = list({**v41_tensors("model.", "weight_scale_inv"), **unrelated("model.")}.items())
    if order == "shuffled":
        random.Random(3).shuffle(pairs)
    elif order == "reversed":
        pairs.reverse()
    else:
        first = ".embed.weight_scale_inv" if order == "scales first" else ".embed.weight"
        pairs.sort(key=lambda p: not p[0].endswith(first))
    loader = _loader(tp, rank, tier=tier, tmp_path=tmp_path)
    loader.load_weights(pairs[:5])
    loader.load_weights(iter(pairs[5:]))  # an engine may call it once per file
    assert loader.pending_bytes() == 0
    for layer_index, store in enumerate(loader.finish()):
        assert store.tier == tier
        assert_store_holds_shard(store, layer_index, tp, rank)
        assert_head_holds(loader.heads[layer_index], layer_index)


def test_only_the_ranks_rows_are_kept_while_a_partner_is_missing() -> None:
    tp, rank = 4, 1
    tensors = v41_tensors("", "scale", scale_dtype=torch.uint8)
    loader = _loader(tp, rank)
    loader.load_weights([("layers.1.engram.embed.weight", tensors["layers.1.engram.embed.weight"])])
    shard = LAYOUT.column_shard(0, tp, rank)
    assert loader.pending_bytes() == shard.num_rows * E  # this rank's values, not the table
    assert shard.num_rows < CONFIG.num_embeddings[0] // 2
    loader.load_weights([("layers.1.engram.embed.scale", tensors["layers.1.engram.embed.scale"])])
    assert loader.pending_bytes() == 0
    given = {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"}
    loader.load_weights([(n, t) for n, t in tensors.items() if n not in given])  # the rest
    assert_store_holds_shard(loader.finish()[0], 0, tp, rank)


def test_the_row_check_fails_on_a_wrong_byte() -> None:
    """Control for :func:`assert_store_holds_shard`: one scale byte off, or another rank's
    store, fails it."""
    tensors = v41_tensors("", "weight_scale_inv", scale_dtype=torch.uint8)
    shard = LAYOUT.column_shard(1, 2, 1)
    scales = tensors["layers.3.engram.embed.weight_scale_inv"].clone()
    scales[shard.row_begin + 5, 1] += 1
    tensors["layers.3.engram.embed.weight_scale_inv"] = scales
    loader = _loader(2, 1)
    loader.load_weights(tensors.items())
    stores = loader.finish()
    assert_store_holds_shard(stores[0], 0, 2, 1)
    with pytest.raises(AssertionError, match="values differ"):
        assert_store_holds_shard(stores[1], 1, 2, 1)
    with pytest.raises(AssertionError):
        assert_store_holds_shard(stores[0], 0, 2, 0)


def test_heads_may_be_left_to_the_caller() -> None:
    loader = EngramWeightLoader(CONFIG, placed())
    loader.load_weights(v41_tensors("", "weight_scale_inv").items())
    loader.finish()
    assert loader.heads is None
    assert torch.equal(loader.head_weights[1]["k_weight"], HEADS[1]["k_weight"])


# --- refusals -----------------------------------------------------------------------------


def test_unknown_engram_name_is_an_error_naming_it() -> None:
    loader = _loader(1, 0)
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.1\.engram\.embed\.weights' looks"):
        loader.load_weights([("layers.1.engram.embed.weights", torch.zeros(1))])
    # Layer 2 is not an Engram layer of CONFIG (layers 1 and 3).
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.engram\.q_weight'.*\[1, 3\]"):
        loader.load_weights([("model.layers.2.engram.q_weight", torch.zeros(1))])


@pytest.mark.parametrize(
    ("name", "change", "needle"),
    [
        (
            "layers.3.engram.embed.weight",
            lambda t: t.to(torch.bfloat16),
            r"'layers\.3\.engram\.embed\.weight' \(layer 3 table values\) has shape \[\d+, 64\] "
            r"dtype torch\.bfloat16; expected torch\.float8_e4m3fn",
        ),
        (
            "layers.1.engram.embed.scale",
            lambda t: t[:-1],
            r"'layers\.1\.engram\.embed\.scale' \(layer 1 table scales\) has shape \[(\d+), 2\].*"
            r"expected torch\.float8_e8m0fnu or torch\.uint8 of shape \[(\d+), 2\]",
        ),
        (
            "layers.1.engram.q_weight",
            lambda t: t[:, :-1],
            r"layer 1 head .*q_weight has shape \[4, 255\]",
        ),
        (
            "layers.3.engram.wkv.scale",
            lambda t: t.double(),
            r"layer 3 head .*wkv_scale='layers\.3\.engram\.wkv\.scale'.*\): wkv_scale has shape "
            r"\[10, 6\] dtype torch\.float64; expected dtype torch\.float32",
        ),
    ],
)
def test_wrong_shape_or_dtype_names_the_tensor(name, change, needle) -> None:
    tensors = v41_tensors("", "scale")
    tensors[name] = change(tensors[name])
    with pytest.raises(CheckpointError, match=needle):
        _loader(2, 1).load_weights(tensors.items())


def test_missing_tensors_are_reported_at_finish() -> None:
    tensors = v41_tensors("model.", "weight_scale_inv")
    del tensors["model.layers.3.engram.embed.weight_scale_inv"]
    del tensors["model.layers.1.engram.k_weight"]
    loader = _loader(2, 0)
    loader.load_weights(tensors.items())
    with pytest.raises(CheckpointError, match=r"2 Engram tensor\(s\) never given") as info:
        loader.finish()
    message = str(info.value)
    assert (
        "layer 1 gate k_weight: 'layers.1.engram.k_weight' or 'model.layers.1.engram.k_weight'"
        in message
    )
    assert "layer 3 table scales: 'layers.3.engram.embed.weight_scale_inv'" in message
    assert "layer 3 table values" not in message and "layer 1 table" not in message


def test_a_tensor_given_twice_is_refused() -> None:
    tensors = v41_tensors("", "weight_scale_inv")
    loader = _loader(1, 0)
    loader.load_weights(tensors.items())
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.engram\.embed\.weight' .* was given after 'layers\.1\.engram\.embed\.weight'",
    ):
        loader.load_weights(
            [("model.layers.1.engram.embed.weight", tensors["layers.1.engram.embed.weight"])]
        )


def test_a_wrongly_named_tensor_is_not_silently_used(tmp_path) -> None:
    """Control: the invented names of earlier defaults, and an Engram table outside '.engram.',
    are neither read in place of the real names nor ignored without a report."""
    tensors = v41_tensors("model.", "weight_scale_inv")
    table = tensors.pop("model.layers.1.engram.embed.weight")
    wrong = {**tensors, "model.layers.1.engram.embedding.weight": table}
    directory = write_hf_checkpoint(tmp_path / "wrong", wrong)
    with pytest.raises(
        CheckpointError, match=r"layer 1: no weight tensor 'layers\.1\.engram\.embed\.weight'"
    ):
        load_table(directory, CONFIG, 0, placed())
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.1\.engram\.embedding\.weight' looks"
    ):
        _loader(1, 0).load_weights(wrong.items())
    loader = _loader(1, 0)
    loader.load_weights({**tensors, "model.layers.1.embed.weight": table}.items())  # not Engram
    with pytest.raises(
        CheckpointError, match=r"layer 1 table values: 'layers\.1\.engram\.embed\.weight'"
    ):
        loader.finish()


def test_convert_writes_the_v41_names(tmp_path) -> None:
    float_tables = {
        f"engram.{layer_id}.weight": torch.randn(rows, E)
        for layer_id, rows in zip(CONFIG.layer_ids, CONFIG.num_embeddings, strict=True)
    }
    save_file(float_tables, str(tmp_path / "src.safetensors"))
    (path,) = convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", CONFIG)
    assert set(read_header(path).tensors) == {
        "layers.1.engram.embed.weight",
        "layers.1.engram.embed.weight_scale_inv",
        "layers.3.engram.embed.weight",
        "layers.3.engram.embed.weight_scale_inv",
    }
    # ... and the engine's loader takes the converted file as it comes.
    loader = EngramWeightLoader(CONFIG, placed())
    loader.load_weights(_file_pairs(path))
    loader.load_weights(
        (f"layers.{layer_id}.engram.{role}", HEADS[i][role])
        for i, layer_id in enumerate(CONFIG.layer_ids)
        for role in ("q_weight", "k_weight")
    )
    loader.load_weights(
        (f"layers.{layer_id}.engram.wkv.weight", HEADS[i]["wkv"].float().bfloat16())
        for i, layer_id in enumerate(CONFIG.layer_ids)
    )
    assert len(loader.finish()) == CONFIG.n_layers


def _file_pairs(path: Path):
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            yield name, handle.get_tensor(name)


def test_overridden_names_replace_the_defaults() -> None:
    """Overrides stay: renamed tensors load, and the default names become unknown."""
    renamed = {}
    for name, tensor in v41_tensors("", "weight_scale_inv").items():
        name = name.replace("layers.", "blocks.").replace(".engram.", ".mem.")
        renamed[name.replace("mem.q_weight", "mem.qn")] = tensor
    loader = _loader(
        2,
        0,
        table_names={
            "weight": "blocks.{layer}.mem.embed.weight",
            "scale": ["blocks.{layer}.mem.embed.weight_scale_inv"],
        },
        weight_names={
            "wkv": "blocks.{layer}.mem.wkv.weight",
            "wkv_scale": ["x.{index}", "blocks.{layer}.mem.wkv.weight_scale_inv"],
            "q_weight": "blocks.{layer}.mem.qn",
            "k_weight": "blocks.{layer}.mem.k_weight",
        },
    )
    assert len(loader.load_weights(renamed.items())) == 6 * CONFIG.n_layers
    for layer_index, store in enumerate(loader.finish()):
        assert_store_holds_shard(store, layer_index, 2, 0)
        assert_head_holds(loader.heads[layer_index], layer_index)
    with pytest.raises(CheckpointError, match=r"'layers\.1\.engram\.q_weight' looks like"):
        _loader(1, 0, weight_names={"q_weight": "blocks.{layer}.qn"}).load_weights(
            v41_tensors("", "scale").items()
        )


@pytest.mark.parametrize(
    ("weight_names", "needle"),
    [
        ({"wq": "x"}, r"weight_names has the role\(s\) \['wq'\]"),
        ({"wkv": ""}, r"weight_names\['wkv'\] = ''; expected a tensor name"),
        (
            {"wkv": "a.{layr}"},
            r"weight_names\['wkv'\] = 'a\.\{layr\}' uses the field\(s\) \['layr'\]",
        ),
        ({"k_weight": [3]}, r"weight_names\['k_weight'\] = \[3\]"),
    ],
)
def test_bad_weight_names_are_refused(weight_names, needle) -> None:
    with pytest.raises(CheckpointError, match=needle):
        _loader(1, 0, weight_names=weight_names)
    with pytest.raises(CheckpointError, match=needle):
        load_layer("unused", CONFIG, 0, max_tokens=4, weight_names=weight_names)


def test_a_wkv_scale_for_a_bf16_wkv_is_refused() -> None:
    tensors = v41_tensors("", "weight_scale_inv")
    scale = tensors.pop("layers.3.engram.wkv.weight_scale_inv")
    tensors["layers.3.engram.wkv.weight"] = torch.randn(1280, 768).bfloat16()
    loader = _loader(1, 0)
    loader.load_weights(tensors.items())
    with pytest.raises(
        CheckpointError, match=r"'layers\.3\.engram\.wkv\.weight_scale_inv' .* loaded without it"
    ):
        loader.load_weights([("layers.3.engram.wkv.weight_scale_inv", scale)])


def test_a_pipeline_stage_owns_some_layers() -> None:
    heads = [EngramHead(CONFIG, device="cpu")]
    loader = EngramWeightLoader(CONFIG, placed("host", 2, 1), layer_ids=[3], heads=heads)
    assert loader.layer_indices == [1]
    tensors = v41_tensors("model.", "scale")
    used = loader.load_weights(tensors.items())
    assert used == {name for name in tensors if ".layers.3." in name}  # layer 1's: skipped
    (store,) = loader.finish()
    assert_store_holds_shard(store, 1, 2, 1)
    assert_head_holds(heads[0], 1)
    partial = EngramWeightLoader(CONFIG, placed(), layer_ids=[1])
    partial.load_weights((n, t) for n, t in tensors.items() if ".layers.3." in n)
    assert len(partial.missing()) == 6 and all(m.startswith("layer 1 ") for m in partial.missing())
    for bad in ([2], [1, 1], []):
        with pytest.raises(ValidationError, match=r"layer_ids = .*expected distinct Engram layers"):
            EngramWeightLoader(CONFIG, placed(), layer_ids=bad)
    with pytest.raises(ValidationError, match=r"heads has 2 head\(s\); expected 1"):
        EngramWeightLoader(CONFIG, placed(), layer_ids=[1], heads=heads * 2)
