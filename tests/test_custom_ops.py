"""engramrt's custom operators: opcheck, the eager API's bytes, and a compiled model step.

On CPU the compiled step runs through ``aot_eager`` (the graph is traced
whole, ``fullgraph=True``, with the fake implementations, without code
generation); on a GPU through Inductor and, captured, in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.layer.common import random_hidden, random_weights

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.gate import engram_gate as eager_gate
from engramrt.gate import gate_tolerance
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, SlotHashCache, hash_sequence
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.lookup import lookup_rows_reference
from engramrt.runtime import synthetic_stores

custom_ops = pytest.importorskip("engramrt.custom_ops")

CFG = PRESETS["tiny"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def layout() -> EngramLayout:
    return EngramLayout(CFG)


def _hasher(layout, token_map, device, name: str, history=None) -> NgramHasher:
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    hasher = NgramHasher(consts, token_map, device)
    custom_ops.register_hasher(name, hasher, history)
    return hasher


def _batch(token_map, device, seed: int, num_tokens: int = 13) -> tuple[HashBatch, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, token_map.vocab_size, num_tokens + 3)
    batch = HashBatch.single(ids[3:], start=3, device=device)
    batch.lookback_token_ids = torch.from_numpy(ids[2::-1].copy()).view(1, 3).to(device)
    return batch, ids


def _packed(store) -> torch.Tensor:
    return store.table.cpu()


def test_opcheck_lookup_and_gate(device) -> None:
    stores = synthetic_stores(EngramLayout(CFG), "device", device=device, seed=2)
    table = stores[0].table
    g = torch.Generator().manual_seed(1)
    row_ids = torch.randint(0, table.shape[0], (9, CFG.n_cols), generator=g).to(device)
    torch.library.opcheck(
        custom_ops.lookup_rows, (row_ids, table, 0, CFG.n_cols, 0), test_utils="test_faketensor"
    )
    torch.library.opcheck(custom_ops.lookup_rows, (row_ids, table, 2, 7, 0))
    hidden = random_hidden(5, seed=1).to(device)
    kv = (torch.randn(5, (CFG.hc_mult + 1) * CFG.hidden_size, generator=g)).bfloat16().to(device)
    w = torch.ones(CFG.hc_mult, CFG.hidden_size, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(custom_ops.engram_gate, (hidden, kv, w, w, 1e-6, None))
    mask = torch.tensor([True, False, True, True, False], device=device)
    torch.library.opcheck(custom_ops.engram_gate, (hidden, kv, w, w, 1e-6, mask))


def test_opcheck_hash_ids_with_a_slot_history(layout, token_map, device) -> None:
    cache = SlotHashCache(64, 4, device)
    _hasher(layout, token_map, device, "opcheck-slots", cache)
    batch, _ = _batch(token_map, device, seed=3)
    batch.slot_mapping = torch.arange(3, 16, device=device)
    batch.block_table = torch.arange(16, dtype=torch.int32, device=device)[None]
    args = (
        batch.input_ids,
        batch.positions,
        batch.query_start_loc,
        None,
        batch.lookback_token_ids,
        None,
        batch.slot_mapping,
        batch.block_table,
        cache.slots,
        "opcheck-slots",
    )
    torch.library.opcheck(custom_ops.hash_ids_slot_cache, args)


def test_ops_give_the_eager_bytes(layout, token_map, device) -> None:
    """Row ids against one-shot hashing done here, rows against the lookup reference,
    the gate against the eager gate (same launcher: the same bits)."""
    hasher = _hasher(layout, token_map, device, "eager-bytes")
    batch, ids = _batch(token_map, device, seed=4)
    got = custom_ops.hash_batch(batch, "eager-bytes")
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    np.testing.assert_array_equal(
        got.cpu().numpy(), hash_sequence(token_map.compress(ids), consts)[3:]
    )
    assert got.dtype == hasher.out_dtype
    stores = synthetic_stores(layout, "device", device=device, seed=2)
    for li, store in enumerate(stores):
        custom_ops.register_source(f"eager-bytes-{li}", store)
        want = lookup_rows_reference(got[:, li].cpu(), _packed(store), CFG.head_dim)
        for rows in (
            custom_ops.lookup_rows(got[:, li], store.table, 0, CFG.n_cols, 0),
            custom_ops.fetch_rows(got[:, li], f"eager-bytes-{li}"),
        ):
            assert torch.equal(rows.cpu().view(torch.int16), want.view(torch.int16))
    hidden = random_hidden(13, seed=5).to(device)
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(13, (CFG.hc_mult + 1) * CFG.hidden_size, generator=g).bfloat16().to(device)
    w = (1 + 0.1 * torch.randn(CFG.hc_mult, CFG.hidden_size, generator=g)).bfloat16().to(device)
    out = custom_ops.engram_gate(hidden, kv, w, w, CFG.rms_norm_eps, None)
    assert torch.equal(
        out.view(torch.int16), eager_gate(hidden, kv, w, w, CFG.rms_norm_eps).view(torch.int16)
    )


def test_unregistered_names_are_clear_errors(device) -> None:
    ids = torch.zeros(2, CFG.n_cols, dtype=torch.int64, device=device)
    with pytest.raises(ValidationError, match="source name 'nowhere' is not registered"):
        custom_ops.fetch_rows(ids, "nowhere")
    with pytest.raises(ValidationError, match="expected an NgramHasher"):
        custom_ops.register_hasher("x", object())  # type: ignore[arg-type]


class TwoLayerStep(torch.nn.Module):
    """A model step as an engine compiles it: hash both layers, fetch each layer's rows
    and run its head (wkv + the gate operator)."""

    def __init__(self, heads: list[EngramHead], hasher: str, sources: list[str]) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(heads)
        self.hasher, self.sources = hasher, sources

    def forward(self, input_ids, positions, query_start_loc, lookback, hidden):
        row_ids = custom_ops.hash_ids(
            input_ids, positions, query_start_loc, None, lookback, None, self.hasher
        )
        outs, all_rows = [], []
        for li, head in enumerate(self.heads):
            rows = custom_ops.fetch_rows(row_ids[:, li], self.sources[li])
            hidden = custom_ops.head_step(head, hidden, rows)
            outs.append(hidden)
            all_rows.append(rows)
        return row_ids, all_rows, outs


def _model(layout, token_map, device, name: str) -> TwoLayerStep:
    _hasher(layout, token_map, device, name)
    stores = synthetic_stores(layout, "device", device=device, seed=7)
    heads = []
    for li, store in enumerate(stores):
        custom_ops.register_source(f"{name}-{li}", store)
        head = EngramHead(CFG, device=device, validate=False)
        head.load_weights(**random_weights(40 + li, fp8=li == 1, config=CFG))
        heads.append(head)
    return TwoLayerStep(heads, name, [f"{name}-0", f"{name}-1"])


def _check_compiled(compiled_out, eager_out, hidden) -> None:
    ids_c, rows_c, outs_c = compiled_out
    ids_e, rows_e, outs_e = eager_out
    assert torch.equal(ids_c, ids_e)
    for a, b in zip(rows_c, rows_e, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(outs_c, outs_e, strict=True):
        # The compiled graph may schedule the wkv GEMM differently: the output is held to
        # the gate's derived tolerance around the eager output, not to its bits.
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.isfinite(a.float()).all()


def test_compiled_two_layer_step_fullgraph(layout, token_map, device) -> None:
    model = _model(layout, token_map, device, "compiled-cpu")
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for seed in (8, 9):
        batch, _ = _batch(token_map, device, seed=seed)
        hidden = random_hidden(batch.num_tokens, seed=seed).to(device)
        args = (
            batch.input_ids,
            batch.positions,
            batch.query_start_loc,
            batch.lookback_token_ids,
            hidden,
        )
        eager_out = model(*args)
        compiled_out = compiled(*args)
        _check_compiled(compiled_out, eager_out, hidden)
        for li, head in enumerate(model.heads):
            kv = head.wkv(compiled_out[1][li].view(batch.num_tokens, -1))
            h_in = hidden if li == 0 else compiled_out[2][li - 1]
            ref = eager_gate(h_in, kv, head.q_weight, head.k_weight, head.eps, backend="reference")
            tol = gate_tolerance(
                h_in, kv, head.q_weight, head.k_weight, head.eps, ref,
                truncating_store=device.type == "cpu",
            )  # fmt: skip
            err = (compiled_out[2][li].double() - ref.double()).abs()
            assert bool((err <= tol.to(err.device)).all()), f"layer {li}: {float(err.max())}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_step_replays_in_a_cuda_graph(layout, token_map) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(layout, token_map, device, "compiled-graph")
    compiled = torch.compile(model, fullgraph=True)
    batch, _ = _batch(token_map, device, seed=10, num_tokens=32)
    hidden = random_hidden(32, seed=10).to(device)
    static = (batch.input_ids.clone(), batch.positions, batch.query_start_loc,
              batch.lookback_token_ids.clone(), hidden.clone())  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*static)
    rng = np.random.default_rng(11)
    for _ in range(3):
        static[0].copy_(torch.as_tensor(rng.integers(0, token_map.vocab_size, 32), device=device))
        static[3].copy_(
            torch.as_tensor(rng.integers(0, token_map.vocab_size, (1, 3)), device=device)
        )
        graph.replay()
        eager_out = model(*static)
        assert torch.equal(captured[0], eager_out[0])
        for a, b in zip(captured[1], eager_out[1], strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
