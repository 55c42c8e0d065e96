"""EngramLayer: lookup + wkv + gate against the reference, staging, errors, CUDA graphs.

Rows compare bit for bit with the lookup reference; kv within
:func:`engramrt.layer.linear_tolerance` of the exact float64 projection;
the output within :func:`engramrt.gate.gate_tolerance` of the gate
reference applied to the layer's own kv (``assert_layer_within_tolerance``).
On a CPU the lookup and the gate run as Triton kernels through the
interpreter; the graph-capture test needs a GPU.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers import assert_same_bits
from tests.layer.common import (
    CONFIG,
    CUDA,
    DEVICE,
    check_head_step,
    full_store,
    layer_table,
    random_hidden,
    random_row_ids,
    random_weights,
    shard_store,
)

from engramrt.errors import CheckpointError, ShardingError, ValidationError
from engramrt.layer import (
    EngramLayer,
    engram_layer_reference,
)
from engramrt.lookup import lookup_rows_reference

HC, DIM, E, C = CONFIG.hc_mult, CONFIG.hidden_size, CONFIG.head_dim, CONFIG.n_cols


@pytest.fixture(scope="module")
def table() -> torch.Tensor:
    return layer_table()


@pytest.fixture(scope="module")
def store(table: torch.Tensor):
    return full_store(table)


def make_layer(store, *, max_tokens: int = 32, fp8: bool = False, seed: int = 1, **kwargs):
    layer = EngramLayer(CONFIG, store, max_tokens=max_tokens, **kwargs)
    weights = random_weights(seed, fp8=fp8)
    layer.load_weights(**weights)
    return layer, weights


def check_step(layer, weights, table, hidden, row_ids, out, kv, token_mask=None) -> None:
    """Rows bit for bit, then kv and out within their derived tolerances."""
    rows = lookup_rows_reference(row_ids.cpu(), table, E).to(DEVICE)
    assert_same_bits(layer.staged_rows[: row_ids.shape[0]], rows)
    check_head_step(layer.head, weights, hidden, rows, kv, out, token_mask)
    if token_mask is not None:  # masked tokens pass through bit for bit
        assert_same_bits(out[~token_mask], hidden[~token_mask], label="masked tokens")


# --- against the reference -------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "fp8", "masked", "prepared"),
    [
        (1, False, False, False),
        (5, True, True, True),
        (13, False, True, True),
        (13, True, False, False),
    ],
)
def test_layer_matches_reference(store, table, num_tokens, fp8, masked, prepared) -> None:
    layer, weights = make_layer(store, fp8=fp8, seed=num_tokens)
    row_ids = random_row_ids(num_tokens, seed=100 + num_tokens).to(DEVICE)
    hidden = random_hidden(num_tokens, seed=200 + num_tokens).to(DEVICE)
    token_mask = None
    if masked:
        g = torch.Generator().manual_seed(num_tokens)
        token_mask = (torch.rand(num_tokens, generator=g) > 0.3).to(DEVICE)
        token_mask[0] = False
    if prepared:
        layer.prepare(row_ids)
        out, kv = layer(hidden, token_mask=token_mask, return_kv=True)
    else:
        out, kv = layer(hidden, row_ids, token_mask, return_kv=True)
    assert out.shape == (num_tokens, HC, DIM) and out.dtype == torch.bfloat16
    check_step(layer, weights, table, hidden, row_ids, out, kv, token_mask)


def test_strided_row_ids_from_the_hasher(store, table) -> None:
    """The hasher's ``[T, L, C]`` output sliced at one layer (a strided view) works."""
    layer, weights = make_layer(store)
    ids_all_layers = torch.stack([random_row_ids(6, seed=5), random_row_ids(6, seed=6)], dim=1).to(
        DEVICE
    )  # [T, L, C]
    row_ids = ids_all_layers[:, 0]
    assert not row_ids.is_contiguous()
    hidden = random_hidden(6, seed=7).to(DEVICE)
    out, kv = layer(hidden, row_ids, return_kv=True)
    check_step(layer, weights, table, hidden, row_ids, out, kv)


def test_fp32_norm_weights_are_kept(store, table) -> None:
    layer, weights = make_layer(store)
    weights["q_weight"] = weights["q_weight"].float() * 1.01
    weights["k_weight"] = weights["k_weight"].float()
    layer.load_weights(**weights)
    assert layer.head.q_weight.dtype == torch.float32
    row_ids = random_row_ids(3, seed=8).to(DEVICE)
    hidden = random_hidden(3, seed=9).to(DEVICE)
    out, kv = layer(hidden, row_ids, return_kv=True)
    check_step(layer, weights, table, hidden, row_ids, out, kv)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="'auto' picks the kernels on a GPU")
def test_auto_backend_without_interpreter_is_the_reference(table, monkeypatch) -> None:
    """On CPU tensors without TRITON_INTERPRET, backend='auto' runs the references:
    the layer's output is the reference's, bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer, _ = make_layer(full_store(table), fp8=True)
    row_ids = random_row_ids(9, seed=10)
    hidden = random_hidden(9, seed=11)
    out, kv = layer(hidden, row_ids, return_kv=True)
    rows = lookup_rows_reference(row_ids, table, E)
    expected_out, expected_kv = engram_layer_reference(
        hidden,
        rows,
        layer.head.wkv.weight,
        layer.head.q_weight,
        layer.head.k_weight,
        layer.head.eps,
    )
    assert_same_bits(layer.staged_rows[:9], rows)
    assert_same_bits(kv, expected_kv, label="kv")
    assert_same_bits(out, expected_out, label="out")


def test_unloaded_layer_is_the_identity(store) -> None:
    """Before load_weights, wkv is zero: every token's value is 0 and hidden passes."""
    layer = EngramLayer(CONFIG, store, max_tokens=4)
    hidden = random_hidden(4, seed=12).to(DEVICE)
    out = layer(hidden, random_row_ids(4, seed=13).to(DEVICE))
    assert_same_bits(out, hidden, label="out")


# --- staging -----------------------------------------------------------------------


def test_outputs_live_in_fixed_buffers(store) -> None:
    layer, _ = make_layer(store, max_tokens=8)
    first = layer(random_hidden(5, seed=1).to(DEVICE), random_row_ids(5, seed=2).to(DEVICE))
    second, kv = layer(
        random_hidden(3, seed=3).to(DEVICE), random_row_ids(3, seed=4).to(DEVICE), return_kv=True
    )
    assert first.data_ptr() == second.data_ptr() == layer.out_buffer.data_ptr()
    assert kv.data_ptr() == layer.kv_buffer.data_ptr()
    out = torch.full((3, HC, DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    given = layer(
        random_hidden(3, seed=3).to(DEVICE), random_row_ids(3, seed=4).to(DEVICE), out=out
    )
    assert given.data_ptr() == out.data_ptr()
    assert_same_bits(given, second, label="out= result")


def test_empty_batch(store) -> None:
    layer, _ = make_layer(store, max_tokens=4)
    row_ids = torch.empty(0, C, dtype=torch.int64, device=DEVICE)
    out = layer(torch.empty(0, HC, DIM, dtype=torch.bfloat16, device=DEVICE), row_ids)
    assert out.shape == (0, HC, DIM)
    layer.prepare(row_ids)
    assert layer(torch.empty(0, HC, DIM, dtype=torch.bfloat16, device=DEVICE)).shape == (0, HC, DIM)
    # Nothing written around an empty output: a poisoned buffer keeps its poison.
    buffer = torch.full((2, HC, DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    empty = torch.empty(0, HC, DIM, dtype=torch.bfloat16, device=DEVICE)
    assert layer(empty, row_ids, out=buffer[:0]).shape == (0, HC, DIM)
    assert bool(buffer.isnan().all())
    # Control: one token through the same buffer is written, the row after it is not.
    one = torch.randn(1, HC, DIM, device=DEVICE).bfloat16()
    layer(one, random_row_ids(1, seed=3).to(DEVICE), out=buffer[:1])
    assert not bool(buffer[0].isnan().any()) and bool(buffer[1].isnan().all())


def test_max_tokens_exactly(store, table) -> None:
    layer, weights = make_layer(store, max_tokens=6)
    row_ids = random_row_ids(6, seed=14).to(DEVICE)
    hidden = random_hidden(6, seed=15).to(DEVICE)
    out, kv = layer(hidden, row_ids, return_kv=True)
    check_step(layer, weights, table, hidden, row_ids, out, kv)


# --- errors ------------------------------------------------------------------------


def test_too_many_tokens_names_both_numbers(store) -> None:
    layer, _ = make_layer(store, max_tokens=4)
    row_ids = random_row_ids(5, seed=1).to(DEVICE)
    with pytest.raises(ValidationError, match=r"T = 5 tokens.*max_tokens = 4"):
        layer(random_hidden(5, seed=1).to(DEVICE), row_ids)
    with pytest.raises(ValidationError, match=r"T = 5 tokens.*max_tokens = 4"):
        layer.prepare(row_ids)


def test_shape_mismatches(store) -> None:
    layer, _ = make_layer(store, max_tokens=8)
    row_ids = random_row_ids(4, seed=1).to(DEVICE)
    hidden = random_hidden(4, seed=1).to(DEVICE)
    with pytest.raises(ValidationError, match=r"row_ids has shape \[4, 11\]; expected \[T, C\]"):
        layer(hidden, row_ids[:, :11])
    with pytest.raises(ValidationError, match=r"row_ids has dtype torch.float32"):
        layer(hidden, row_ids.float())
    with pytest.raises(
        ValidationError, match=r"hidden has shape \[3, 4, 256\]; expected \[4, 4, 256\]"
    ):
        layer(hidden[:3], row_ids)
    with pytest.raises(ValidationError, match=r"expected \[4, 4, 256\]"):
        layer(hidden[:, :3].contiguous(), row_ids)
    with pytest.raises(ValidationError, match="token_mask"):
        layer(hidden, row_ids, torch.ones(3, dtype=torch.bool, device=DEVICE))


def test_staging_protocol_errors(store) -> None:
    layer, _ = make_layer(store, max_tokens=8)
    row_ids = random_row_ids(4, seed=1).to(DEVICE)
    hidden = random_hidden(4, seed=1).to(DEVICE)
    with pytest.raises(ValidationError, match=r"call prepare\(row_ids\) first"):
        layer(hidden)
    layer.prepare(row_ids)
    with pytest.raises(ValidationError, match="already called"):
        layer.prepare(row_ids)
    with pytest.raises(ValidationError, match="rows of 4 tokens were already started"):
        layer(hidden, row_ids)
    with pytest.raises(ValidationError, match=r"expected \[4, 4, 256\]"):
        layer(hidden[:2])
    layer(hidden)  # the staged batch is still there after a rejected call
    with pytest.raises(ValidationError, match="call prepare"):
        layer(hidden)


@pytest.mark.skipif(CUDA, reason="checks the CPU refusal of a stream")
def test_stream_needs_cuda(store) -> None:
    layer, _ = make_layer(store)

    class FakeStream:
        pass

    with pytest.raises(ValidationError, match="streams need CUDA"):
        layer.prepare(random_row_ids(2, seed=1), stream=FakeStream())  # type: ignore[arg-type]


def test_construction_errors(table) -> None:
    with pytest.raises(ValidationError, match="max_tokens=0"):
        EngramLayer(CONFIG, full_store(table), max_tokens=0)
    other = CONFIG.replace(head_dim=32)
    with pytest.raises(ValidationError, match=r"E=64 values.*head_dim E=32"):
        EngramLayer(other, full_store(table), max_tokens=4)
    with pytest.raises(
        ShardingError, match=r"columns \[0, 6\) of C=12.*needs the rows of every column"
    ):
        EngramLayer(CONFIG, shard_store(table, tp=2, rank=0), max_tokens=4)


# --- weights -------------------------------------------------------------------------


def test_load_weights_errors_name_the_tensor(store) -> None:
    layer = EngramLayer(CONFIG, store, max_tokens=4)
    good = random_weights(3, fp8=True)
    out_f, in_f = (HC + 1) * DIM, C * E
    cases = [
        (
            {"wkv": good["wkv"][:, :-1]},
            rf"wkv has shape \[{out_f}, {in_f - 1}\].*expected shape \[{out_f}, {in_f}\]",
        ),
        (
            {"wkv": good["wkv"].float()},
            r"wkv has .*dtype torch.float32; expected dtype torch.bfloat16 or torch.float8_e4m3fn",
        ),
        ({"wkv_scale": None}, r"wkv_scale is missing .*expected float32 \[10, 6\]"),
        (
            {"wkv_scale": good["wkv_scale"][:, :5]},
            r"wkv_scale has shape \[10, 5\] dtype torch.float32; expected dtype torch.float32 shape \[10, 6\]",
        ),
        (
            {"wkv_scale": good["wkv_scale"].double()},
            r"wkv_scale has shape \[10, 6\] dtype torch.float64",
        ),
        (
            {"wkv": good["wkv"].float().bfloat16()},
            r"wkv_scale was given .* for a bf16 wkv; expected None",
        ),
        (
            {"q_weight": good["q_weight"][:2]},
            r"q_weight has shape \[2, 256\] dtype torch.bfloat16; expected shape \[4, 256\]",
        ),
        ({"k_weight": good["k_weight"].int()}, r"k_weight has shape \[4, 256\] dtype torch.int32"),
    ]
    for change, message in cases:
        with pytest.raises(CheckpointError, match=message):
            layer.load_weights(**{**good, **change})
    bad_scale = good["wkv_scale"].clone()
    bad_scale[2, 3] = float("inf")
    with pytest.raises(CheckpointError, match=r"wkv_scale\[2, 3\] = inf"):
        layer.load_weights(**{**good, "wkv_scale": bad_scale})
    # nothing was written by a rejected load (the k_weight check fails before wkv loads)
    assert not bool(layer.head.wkv.weight.any())
    assert bool((layer.head.q_weight == 1).all())


# --- CUDA graphs --------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="CUDA-graph capture needs a GPU (none on this machine)")
def test_graph_capture_and_no_allocation(store, table) -> None:
    """prepare (on a side stream) + forward capture into one graph; replays with new
    inputs written into the captured ones equal eager steps; forward allocates nothing."""
    num_tokens = 24
    layer, weights = make_layer(store, max_tokens=32)
    row_ids = random_row_ids(num_tokens, seed=20).to(DEVICE)
    hidden = random_hidden(num_tokens, seed=21).to(DEVICE)
    side = torch.cuda.Stream()

    def step() -> torch.Tensor:
        layer.prepare(row_ids, stream=side)
        return layer(hidden)

    for _ in range(2):  # compile the kernels, create this stream's cuBLAS workspace
        step()
    torch.cuda.synchronize()

    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()
    layer.prepare(row_ids)
    layer(hidden)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (30, 31):
        row_ids.copy_(random_row_ids(num_tokens, seed=seed).to(DEVICE))
        hidden.copy_(random_hidden(num_tokens, seed=seed + 100).to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        eager, kv = layer(hidden, row_ids, return_kv=True)
        assert_same_bits(replayed, eager, label="graph replay")
        check_step(layer, weights, table, hidden, row_ids, eager, kv)


# --- the head alone: rows in, output out -----------------------------------------------


def test_head_on_given_rows_matches_reference(table) -> None:
    """EngramHead takes rows from anywhere (here the lookup reference) and computes the
    layer's kv and output within the derived tolerances."""
    from engramrt.layer import EngramHead

    weights = random_weights(21, fp8=True)
    head = EngramHead(CONFIG, device=DEVICE)
    head.load_weights(**weights)
    row_ids = random_row_ids(7, seed=21)
    rows = lookup_rows_reference(row_ids, table, E).to(DEVICE)
    hidden = random_hidden(7, seed=22).to(DEVICE)
    out, kv = head(hidden, rows, return_kv=True)
    check_head_step(head, weights, hidden, rows, kv, out)


def test_layer_equals_its_head_on_the_sources_rows(store, table) -> None:
    layer, _ = make_layer(store, seed=5)
    row_ids = random_row_ids(6, seed=5).to(DEVICE)
    hidden = random_hidden(6, seed=6).to(DEVICE)
    out = layer(hidden, row_ids).clone()
    rows = lookup_rows_reference(row_ids.cpu(), table, E).to(DEVICE)
    assert_same_bits(out, layer.head(hidden, rows), label="layer vs head on reference rows")


def test_head_input_errors() -> None:
    from engramrt.layer import EngramHead

    head = EngramHead(CONFIG, device=DEVICE)
    hidden = random_hidden(3, seed=1).to(DEVICE)
    rows = torch.zeros(3, C, E, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValidationError, match=r"rows has shape \[3, 12, 32\] dtype torch.bfloat16"):
        head(hidden, rows[..., :32].contiguous())
    with pytest.raises(ValidationError, match=r"rows has .*dtype torch.float32"):
        head(hidden, rows.float())
    with pytest.raises(
        ValidationError, match=r"hidden has shape \[2, 4, 256\]; expected \[3, 4, 256\]"
    ):
        head(hidden[:2], rows)
    with pytest.raises(ValidationError, match="config is a str; expected an EngramConfig"):
        EngramHead("tiny", device=DEVICE)  # type: ignore[arg-type]


def test_layer_refuses_a_head_on_another_device_or_not_a_source(store) -> None:
    from engramrt.layer import EngramHead

    with pytest.raises(ValidationError, match="source is a Tensor; expected a RowSource"):
        EngramLayer(CONFIG, torch.zeros(1), max_tokens=4)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="head is a str"):
        EngramLayer("head", store, max_tokens=4)  # type: ignore[arg-type]
    if DEVICE.type == "cuda":
        with pytest.raises(ValidationError, match="expected one device"):
            EngramLayer(EngramHead(CONFIG, device="cpu"), store, max_tokens=4)
